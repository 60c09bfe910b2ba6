"""The relayed path against the routed link, in one run (issue 13).

Two namespace hosts and a relay host of the test rig (tests/net/rig.py) on one switch:

- throughput: iperf3 (TCP, 5 s, 1 stream, 1 MiB writes, median of 3) routed directly between
  the two hosts, against one TCP stream through the relayed path (the member endpoints of
  muster.net.relayed on each host, SOCKS5 in, end-to-end encrypted, one `muster relay` in
  between; 5 s, median of 3);
- gloo all_reduce of 4 and 64 MiB between the two hosts (1 rank each, median of 5 after a
  warm-up): torchrun by hand routed, and relayed (the same torchrun with the shim preloaded);
- failover: one stream through relay A with relay B meshed beside it; A is killed after 2 s;
  the longest gap between the receiver's reads is the stall.

Goals (issue 13): >= 1 Gbit/s per gang encrypted on this machine; failover stall < 3 s with
0 broken connections. The endpoints here get their tickets from a secret the bench holds
(what the controller does for them); nothing else differs from a relayed job's members.

    sudo .venv/bin/python bench/relay.py
"""

from __future__ import annotations

import base64
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.net import ALL_REDUCE, iperf3
from muster.net.relayed import new_key
from muster.net.shim import library
from tests.net.rig import Host, Rig, missing_tools, why_unavailable

RELAY_PORTS = (7101, 7102)
SINK_PORT = 5301

MEMBER = textwrap.dedent(
    """
    import asyncio, base64, json, logging, sys
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from muster.net.relayed import Endpoint
    from muster.net.relaywire import issue_ticket
    cfg = json.load(open(sys.argv[1]))

    async def main():
        private = X25519PrivateKey.from_private_bytes(base64.b64decode(cfg["private"]))
        secret = cfg["secret"].encode()

        async def ticket(_index):
            return issue_ticket(secret, cfg["gang"], cfg["me"])

        peers = {int(k): base64.b64decode(v) for k, v in cfg["peers"].items()}
        relays = [tuple(r) for r in cfg["relays"]]
        e = Endpoint(cfg["gang"], cfg["me"], cfg["addresses"], private, peers, relays, ticket)
        await e.start()
        await asyncio.wait_for(e.up.wait(), 30)
        with open(cfg["socks_file"], "w") as f:
            f.write(e.socks)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)

# The receiving end: counts what arrives for ``seconds`` after the first byte; prints the
# rate and the longest gap between two reads.
SINK = textwrap.dedent(
    """
    import socket, sys, time
    server = socket.create_server((sys.argv[1], int(sys.argv[2])))
    conn, _ = server.accept()
    total, first, last, gap = 0, None, None, 0.0
    while True:
        data = conn.recv(1 << 20)
        now = time.perf_counter()
        if not data:
            break
        if first is None:
            first = now
        elif now - last > gap:
            gap = now - last
        last = now
        total += len(data)
    print(f"sink {total} {last - first:.6f} {gap:.6f}", flush=True)
    """
)

# The sending end, through the member's SOCKS5 endpoint (what the shim does in a rank).
SOURCE = textwrap.dedent(
    """
    import socket, struct, sys, time
    socks_host, socks_port = open(sys.argv[1]).read().rsplit(":", 1)
    peer, port, seconds = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    s = socket.create_connection((socks_host, int(socks_port)))
    s.sendall(b"\\x05\\x01\\x00")
    assert s.recv(2) == b"\\x05\\x00"
    s.sendall(b"\\x05\\x01\\x00\\x01" + socket.inet_aton(peer) + struct.pack("!H", port))
    reply = s.recv(10)
    assert reply[1] == 0, reply
    chunk = b"\\x5a" * (1 << 20)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        s.sendall(chunk)
    s.close()
    print("source done", flush=True)
    """
)


def members(rig: Rig, hosts: tuple[Host, Host], relays: list[tuple[str, int]], work: Path,
            secret: str, gang: str) -> list[str]:  # fmt: skip
    """A relayed endpoint on each host (member 0 on a, 1 on b); their SOCKS5 addresses."""
    keys = [new_key() for _ in hosts]
    script = work / "member.py"
    script.write_text(MEMBER)
    socks = []
    for me, host in enumerate(hosts):
        peer = 1 - me
        cfg = {
            "gang": gang,
            "me": me,
            "secret": secret,
            "addresses": [h.address for h in hosts],
            "private": base64.b64encode(keys[me][0].private_bytes_raw()).decode(),
            "peers": {str(peer): base64.b64encode(keys[peer][1]).decode()},
            "relays": relays,
            "socks_file": str(work / f"{gang.replace('/', '-')}-{me}.socks"),
        }
        path = work / f"{gang.replace('/', '-')}-{me}.json"
        path.write_text(json.dumps(cfg))
        path.chmod(0o600)
        rig.spawn(host, f"member-{gang.replace('/', '-')}-{me}", sys.executable, str(script),
                  str(path))  # fmt: skip
        socks.append(cfg["socks_file"])
    deadline = time.monotonic() + 60
    while not all(Path(f).exists() for f in socks):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the endpoints did not come up: {rig.log_tails()}")
        time.sleep(0.2)
    return [Path(f).read_text() for f in socks]


Kill = tuple[float, subprocess.Popen[bytes]]


def stream(
    rig: Rig, a: Host, b: Host, socks_file: Path, seconds: float, during: Kill | None = None
) -> tuple[float, float]:
    """One stream a -> b through a's endpoint: (Gbit/s, longest gap in s). ``during``: kill
    that process so many seconds in."""
    work = socks_file.parent
    (work / "sink.py").write_text(SINK)
    (work / "source.py").write_text(SOURCE)
    sink = subprocess.Popen(
        b.argv([sys.executable, str(work / "sink.py"), b.address, str(SINK_PORT)]),
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(0.5)
    source = subprocess.Popen(
        a.argv([sys.executable, str(work / "source.py"), str(socks_file), b.address,
                str(SINK_PORT), str(seconds)]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    if during is not None:
        time.sleep(during[0])
        during[1].kill()
    out_source = source.communicate(timeout=seconds + 120)[0]
    out = sink.communicate(timeout=120)[0]
    if "source done" not in out_source or not out.startswith("sink "):
        raise RuntimeError(f"the stream broke: {out_source} {out}")
    _, total, took, gap = out.split()
    return int(total) * 8 / float(took) / 1e9, float(gap)


def gloo(rig: Rig, hosts: tuple[Host, Host], script: Path,
         shim: list[str] | None) -> dict[int, float]:  # fmt: skip
    """The all_reduce script by hand; ``shim``: each host's SOCKS5 endpoint (relayed)."""
    port = 29400 + int(time.time()) % 500
    procs = []
    for rank, host in enumerate(hosts):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--node-rank", str(rank), "--master-addr", hosts[0].address,
            "--master-port", str(port), str(script),
        ]  # fmt: skip
        env = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        if shim is not None:
            env |= {
                "LD_PRELOAD": library(),
                "MUSTER_NETSHIM_PEERS": hosts[1 - rank].address,
                "MUSTER_NETSHIM_SOCKS": shim[rank],
            }
        procs.append(
            subprocess.Popen(
                host.argv(["env", *(f"{k}={v}" for k, v in env.items()), *cmd]),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=600)[0] for p in procs]
    result = {}
    for line in outs[0].splitlines():
        if line.startswith("allreduce "):
            _, mib, seconds = line.split()
            result[int(mib)] = float(seconds)
    if len(result) != 2:
        raise RuntimeError(f"the all_reduce did not finish: {outs}")
    return result


def main() -> None:
    why = why_unavailable() or missing_tools("iperf3")
    if why:
        sys.exit(f"bench/relay.py: {why}")
    secret = secrets.token_hex(32)
    with Rig() as rig, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "relay.secret").write_text(secret)
        (work / "relay.secret").chmod(0o600)
        a, b, r = rig.one_region(3)
        relays = []
        for port, other in zip(RELAY_PORTS, reversed(RELAY_PORTS), strict=True):
            relays.append(rig.spawn(
                r, f"relay{port}", sys.executable, "-m", "muster", "relay",
                "--listen", f"{r.address}:{port}", "--peer", f"{r.address}:{other}",
                "--secret-file", str(work / "relay.secret"),
            ))  # fmt: skip
        rig.spawn(b, "iperf3", "iperf3", "-s")
        time.sleep(1.0)

        routed = [iperf3(rig, a, b.address) for _ in range(3)]
        print(f"iperf3 routed           {statistics.median(routed):6.2f} Gbit/s (median of 3: "
              + ", ".join(f"{x:.2f}" for x in routed) + ")", flush=True)  # fmt: skip

        socks = members(rig, (a, b), [(r.address, RELAY_PORTS[0])], work, secret, "bench/1")
        (work / "one.socks").write_text(socks[0])
        relayed = [stream(rig, a, b, work / "one.socks", 5.0)[0] for _ in range(3)]
        gbps = statistics.median(relayed)
        print(f"relayed, encrypted      {gbps:6.2f} Gbit/s (median of 3: "
              + ", ".join(f"{x:.2f}" for x in relayed) + f"); "
              f"{gbps / statistics.median(routed):.3f}x routed; goal >= 1 Gbit/s: "
              f"{'met' if gbps >= 1.0 else 'NOT met'}", flush=True)  # fmt: skip

        script = work / "allreduce.py"
        script.write_text(ALL_REDUCE)
        direct = gloo(rig, (a, b), script, None)
        through = gloo(rig, (a, b), script, socks)
        for mib in (4, 64):
            print(f"gloo all_reduce {mib:2} MiB: routed {direct[mib] * 1e3:8.1f} ms, relayed "
                  f"{through[mib] * 1e3:8.1f} ms ({through[mib] / direct[mib]:.1f}x)")  # fmt: skip

        both = [(r.address, p) for p in RELAY_PORTS]
        socks2 = members(rig, (a, b), both, work, secret, "bench/2")
        (work / "two.socks").write_text(socks2[0])
        time.sleep(1.0)  # both links up (each member sends on the first relay)
        rate, stall = stream(rig, a, b, work / "two.socks", 8.0, during=(2.0, relays[0]))
        print(f"failover: relay A killed 2 s into an 8 s stream: longest gap {stall:.2f} s "
              f"(goal < 3 s: {'met' if stall < 3 else 'NOT met'}), 0 broken connections, "
              f"{rate:.2f} Gbit/s over the whole stream", flush=True)  # fmt: skip
        # Proof that A carried the stream until it died: both members lost their link to it.
        lost = f"relay {r.address}:{RELAY_PORTS[0]}: "
        for me, host in enumerate((a, b)):
            said = rig.log(host, f"member-bench-2-{me}").read_text()
            print(f"member {me} {'lost its link to relay A' if lost in said else 'NEVER lost A'}")


if __name__ == "__main__":
    main()
