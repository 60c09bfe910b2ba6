/* libmuster-netshim.so: the relayed path's connect() redirect (muster.net.shim).
 *
 * Preloaded into a relayed gang's ranks (LD_PRELOAD, first). A TCP connect() to one of the
 * gang's peer addresses (MUSTER_NETSHIM_PEERS: comma-separated IPv4/IPv6 literals) goes to the
 * member's own SOCKS5 endpoint on loopback (MUSTER_NETSHIM_SOCKS, "127.0.0.1:PORT") instead:
 * the socket connects there, asks for the peer with a SOCKS5 CONNECT, and comes back
 * connected end to end, with its flags as the caller set them. Every other connect() (UDP,
 * other addresses, Unix sockets) goes straight to libc's. IPv4, IPv6 and v4-mapped IPv6
 * destinations are matched; non-blocking sockets are handled (connect returns 0, connected,
 * which POSIX allows and gloo, NCCL and libuv accept).
 *
 * muster_netshim_version() is exported for the self-test: a program that resolves it has
 * the shim loaded (a static or musl launcher never does).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#define MAX_PEERS 4096
#define HANDSHAKE_TIMEOUT_S 120 /* a stream through the relays, then the peer's own accept */

typedef int (*connect_fn)(int, const struct sockaddr *, socklen_t);

static connect_fn real_connect;
static struct in6_addr peers[MAX_PEERS]; /* IPv4 peers stored v4-mapped */
static int npeers;
static struct sockaddr_in socks4;        /* the endpoint, for AF_INET sockets */
static int have_socks;
static pthread_once_t once = PTHREAD_ONCE_INIT;

const char *muster_netshim_version(void) { return "muster-netshim 1"; }

static int parse_ip(const char *text, struct in6_addr *out) {
    struct in_addr v4;
    if (inet_pton(AF_INET, text, &v4) == 1) {
        memset(out, 0, sizeof(*out));
        out->s6_addr[10] = 0xff;
        out->s6_addr[11] = 0xff;
        memcpy(&out->s6_addr[12], &v4, 4);
        return 1;
    }
    return inet_pton(AF_INET6, text, out) == 1;
}

static void init(void) {
    real_connect = (connect_fn)dlsym(RTLD_NEXT, "connect");
    const char *list = getenv("MUSTER_NETSHIM_PEERS");
    const char *socks = getenv("MUSTER_NETSHIM_SOCKS");
    if (list != NULL) {
        char item[64];
        const char *p = list;
        while (*p && npeers < MAX_PEERS) {
            size_t n = strcspn(p, ",");
            if (n > 0 && n < sizeof(item)) {
                memcpy(item, p, n);
                item[n] = 0;
                if (parse_ip(item, &peers[npeers])) npeers++;
            }
            p += n;
            if (*p == ',') p++;
        }
    }
    if (socks != NULL) {
        char host[64];
        const char *colon = strrchr(socks, ':');
        size_t n = colon ? (size_t)(colon - socks) : 0;
        long port = colon ? strtol(colon + 1, NULL, 10) : 0;
        if (n > 0 && n < sizeof(host) && port > 0 && port < 65536) {
            memcpy(host, socks, n);
            host[n] = 0;
            memset(&socks4, 0, sizeof(socks4));
            socks4.sin_family = AF_INET;
            socks4.sin_port = htons((uint16_t)port);
            have_socks = inet_pton(AF_INET, host, &socks4.sin_addr) == 1;
        }
    }
}

__attribute__((constructor)) static void on_load(void) { pthread_once(&once, init); }

/* The destination as a v4-mapped-or-IPv6 address and its port, if it is an IP one. */
static int destination(const struct sockaddr *addr, socklen_t len, struct in6_addr *ip,
                       uint16_t *port) {
    if (addr == NULL) return 0;
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)addr;
        memset(ip, 0, sizeof(*ip));
        ip->s6_addr[10] = 0xff;
        ip->s6_addr[11] = 0xff;
        memcpy(&ip->s6_addr[12], &in->sin_addr, 4);
        *port = in->sin_port;
        return 1;
    }
    if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)addr;
        *ip = in6->sin6_addr;
        *port = in6->sin6_port;
        return 1;
    }
    return 0;
}

static int is_peer(const struct in6_addr *ip) {
    for (int i = 0; i < npeers; i++)
        if (memcmp(&peers[i], ip, sizeof(*ip)) == 0) return 1;
    return 0;
}

static int full_write(int fd, const unsigned char *buf, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, buf, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        buf += w;
        n -= (size_t)w;
    }
    return 0;
}

static int full_read(int fd, unsigned char *buf, size_t n) {
    while (n > 0) {
        ssize_t r = recv(fd, buf, n, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        buf += r;
        n -= (size_t)r;
    }
    return 0;
}

/* SOCKS5 on an already connected blocking socket: no authentication (the endpoint is on
 * loopback and admits only the member's own user's processes by its own means), then
 * CONNECT to the peer. Returns 0, or an errno. */
static int socks_connect(int fd, const struct in6_addr *ip, uint16_t port) {
    unsigned char hello[3] = {5, 1, 0}, answer[2];
    if (full_write(fd, hello, 3) || full_read(fd, answer, 2)) return ECONNRESET;
    if (answer[0] != 5 || answer[1] != 0) return ECONNREFUSED;
    unsigned char req[22];
    size_t n;
    int mapped = ip->s6_addr32[0] == 0 && ip->s6_addr32[1] == 0 &&
                 ip->s6_addr[8] == 0 && ip->s6_addr[9] == 0 && ip->s6_addr[10] == 0xff &&
                 ip->s6_addr[11] == 0xff;
    req[0] = 5;
    req[1] = 1;
    req[2] = 0;
    if (mapped) {
        req[3] = 1;
        memcpy(&req[4], &ip->s6_addr[12], 4);
        memcpy(&req[8], &port, 2);
        n = 10;
    } else {
        req[3] = 4;
        memcpy(&req[4], ip->s6_addr, 16);
        memcpy(&req[20], &port, 2);
        n = 22;
    }
    unsigned char reply[4];
    if (full_write(fd, req, n) || full_read(fd, reply, 4)) return ECONNRESET;
    size_t rest = reply[3] == 1 ? 6 : reply[3] == 4 ? 18 : 0;
    unsigned char skip[18];
    if (rest == 0 || full_read(fd, skip, rest)) return ECONNRESET;
    if (reply[0] != 5) return ECONNRESET;
    switch (reply[1]) {
    case 0: return 0;
    case 3: return ENETUNREACH;
    case 4: return EHOSTUNREACH;
    case 5: return ECONNREFUSED;
    case 6: return ETIMEDOUT;
    default: return ECONNREFUSED;
    }
}

/* A blocking connect interrupted by a signal goes on in the kernel: wait for it (bounded by
 * the send timeout set above) and read its outcome. Returns 0, or -1 with errno. */
static int finish_connect(int fd) {
    struct pollfd pfd = {fd, POLLOUT, 0};
    int rc;
    do {
        rc = poll(&pfd, 1, HANDSHAKE_TIMEOUT_S * 1000);
    } while (rc < 0 && errno == EINTR);
    if (rc == 0) {
        errno = ETIMEDOUT;
        return -1;
    }
    if (rc < 0) return -1;
    int soerr = 0;
    socklen_t slen = sizeof(soerr);
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &slen) != 0) return -1;
    if (soerr != 0) {
        errno = soerr;
        return -1;
    }
    return 0;
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    pthread_once(&once, init);
    if (real_connect == NULL) {
        errno = ENOSYS;
        return -1;
    }
    struct in6_addr ip;
    uint16_t port;
    int type = 0;
    socklen_t tlen = sizeof(type);
    if (!have_socks || npeers == 0 || !destination(addr, len, &ip, &port) || !is_peer(&ip) ||
        getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tlen) != 0 || type != SOCK_STREAM)
        return real_connect(fd, addr, len);

    int flags = fcntl(fd, F_GETFL);
    if (flags < 0) return -1;
    struct timeval old_rcv, old_snd, limit = {HANDSHAKE_TIMEOUT_S, 0};
    socklen_t tv = sizeof(old_rcv);
    getsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &old_rcv, &tv);
    tv = sizeof(old_snd);
    getsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &old_snd, &tv);
    if (flags & O_NONBLOCK) fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));

    int rc;
    if (addr->sa_family == AF_INET) {
        rc = real_connect(fd, (const struct sockaddr *)&socks4, sizeof(socks4));
    } else {
        /* An AF_INET6 socket reaches the IPv4 endpoint v4-mapped (unless it is v6-only:
         * then the endpoint's ::1 twin on the same port). */
        int v6only = 0;
        socklen_t vlen = sizeof(v6only);
        getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &vlen);
        struct sockaddr_in6 s6;
        memset(&s6, 0, sizeof(s6));
        s6.sin6_family = AF_INET6;
        s6.sin6_port = socks4.sin_port;
        if (v6only) {
            s6.sin6_addr = in6addr_loopback;
        } else {
            s6.sin6_addr.s6_addr[10] = 0xff;
            s6.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&s6.sin6_addr.s6_addr[12], &socks4.sin_addr, 4);
        }
        rc = real_connect(fd, (const struct sockaddr *)&s6, sizeof(s6));
    }
    if (rc != 0 && errno == EINTR) rc = finish_connect(fd);
    int err = rc == 0 ? socks_connect(fd, &ip, port) : errno;

    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &old_rcv, sizeof(old_rcv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &old_snd, sizeof(old_snd));
    fcntl(fd, F_SETFL, flags);
    if (err != 0) {
        errno = err == EAGAIN || err == EWOULDBLOCK ? ETIMEDOUT : err;
        return -1;
    }
    return 0;
}
