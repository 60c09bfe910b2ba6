"""Who may call what: two credentials, checked by every route for itself.

    credential      held by                  may call
    --------------  -----------------------  ------------------------------------------------
    API token       users (CLI, SDK)         submit, cancel, read jobs/logs/artifacts/workers,
                                             upload bundles, /metrics
    join secret     agents                   the control-link handshake only (it never goes
                                             on the wire: the agent proves it holds it)
    ticket          one agent's live link    that agent's own HTTP calls: download the bundle
                                             of a job it is placed in, upload its member's
                                             outputs; it dies with the link
    (none)          a box walking in to a    a control link named open-JOB-HOST that may only
                    window with               offer itself to JOB's window (then run its part);
                    open_admission            see muster.wire and Controller.open_to

On loopback without TLS the user routes are open (one machine, one user: the demo), to this
machine's own processes: a call whose Host is not a loopback name (DNS rebinding) or whose
Origin is another site (a web page in the user's browser) is refused (``open_refusal``);
whenever TLS is on or the bind is off loopback they want the API token. The dashboard's
login (muster.controller.dashboard) checks the API token once and sets a session cookie,
signed with it, that stands for the token on user routes for 12 hours: alone on GET, and
with the header ``X-Muster-UI: 1`` on anything that changes state (a page on another site
can make a browser send the cookie, never that header). Its name carries a digest of the API
token, so two controllers on one host (cookies ignore ports) keep their own sessions.
Changing the API token ends every session. The agent routes
always want a live ticket. No credential, or one the controller does not know: 401. A known
credential without the right to the call (a ticket on a user route, the API token on an
agent route, the join secret anywhere): 403. Every comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import Request

from muster.controller.credentials import Credentials
from muster.errors import Forbidden, Unauthorized

API_HINT = "send Authorization: Bearer <API token> (`muster token --api` on the controller)"
SESSION_COOKIE = "muster_session"  # + a digest of the API token: one cookie per controller
SESSION_TTL_S = 12 * 3600
UI_HEADER = "x-muster-ui"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def same_secret(given: str, expected: str) -> bool:
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


def ticket_digest(ticket: str) -> str:
    """Tickets are looked up by their sha256, so the lookup's timing says nothing of them."""
    return hashlib.sha256(ticket.encode()).hexdigest()


class Tickets:
    """The live links' tickets: digest -> worker id."""

    def __init__(self) -> None:
        self._workers: dict[str, str] = {}

    def issue(self, worker_id: str) -> str:
        ticket = secrets.token_urlsafe(32)
        self._workers[ticket_digest(ticket)] = worker_id
        return ticket

    def revoke(self, ticket: str) -> None:
        self._workers.pop(ticket_digest(ticket), None)

    def worker(self, ticket: str) -> str | None:
        return self._workers.get(ticket_digest(ticket)) if ticket else None


@dataclass
class Guard:
    """The app's auth state: the credentials, the live tickets, whether users need a token."""

    creds: Credentials
    tickets: Tickets
    users_need_token: bool

    def _parse(self, request: Request) -> tuple[str, str]:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        return scheme.strip().lower(), value.strip()

    def session(self, now: float | None = None) -> str:
        """A dashboard session cookie's value: its expiry, signed with the API token."""
        expires = int((time.time() if now is None else now) + SESSION_TTL_S)
        return f"{expires}.{self._sign(expires)}"

    def _sign(self, expires: int) -> str:
        key = self.creds.api_token.encode()
        return hmac.new(key, f"muster-ui-session:{expires}".encode(), "sha256").hexdigest()

    @property
    def cookie_name(self) -> str:
        digest = hashlib.sha256(f"muster-ui-cookie:{self.creds.api_token}".encode()).hexdigest()
        return f"{SESSION_COOKIE}_{digest[:12]}"

    def has_session(self, request: Request) -> bool:
        value = request.cookies.get(self.cookie_name, "")
        expires, _, signature = value.partition(".")
        if not (expires.isascii() and expires.isdigit() and len(expires) <= 12):
            return False
        if int(expires) < time.time():
            return False
        return same_secret(signature, self._sign(int(expires)))

    def may_read(self, request: Request) -> bool:
        """Whether a dashboard page may be shown: what a user GET route would let through."""
        scheme, value = self._parse(request)
        if scheme == "bearer" and same_secret(value, self.creds.api_token):
            return True
        if self.has_session(request):
            return True
        return not self.users_need_token and open_refusal(request) is None

    def user(self, request: Request) -> None:
        """A user route: the API token (or nothing, on loopback without TLS)."""
        scheme, value = self._parse(request)
        if scheme == "bearer" and same_secret(value, self.creds.api_token):
            return
        if not value and self.has_session(request):
            if request.method in SAFE_METHODS or request.headers.get(UI_HEADER) == "1":
                return
            raise Forbidden(
                f"a dashboard session changes nothing without the header {UI_HEADER}: 1 "
                "(the dashboard's own buttons send it)"
            )
        if not self.users_need_token:
            refused = open_refusal(request)
            if refused is not None:
                raise Forbidden(refused)
            return
        if scheme == "ticket" and self.tickets.worker(value) is not None:
            raise Forbidden("an agent's ticket may only fetch its bundle and upload its outputs")
        if scheme == "bearer" and same_secret(value, self.creds.join_secret):
            raise Forbidden(f"the join secret is for agents' links only; {API_HINT}")
        raise Unauthorized(API_HINT if not value else f"unknown credential; {API_HINT}")

    def agent(self, request: Request) -> str:
        """An agent route: a live link's ticket; returns the worker id it was issued to."""
        scheme, value = self._parse(request)
        if scheme == "ticket":
            worker = self.tickets.worker(value)
            if worker is not None:
                return worker
            raise Unauthorized("this ticket is not a live agent link's; the agent re-dials")
        if scheme == "bearer" and (
            same_secret(value, self.creds.api_token) or same_secret(value, self.creds.join_secret)
        ):
            raise Forbidden("this route is for agents, with the ticket of their live link")
        raise Unauthorized("send Authorization: Ticket <ticket of the agent's live link>")


DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def is_loopback(host: str | None) -> bool:
    """A loopback address (any of 127/8, ::1) or localhost."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _where(url: str, scheme: str) -> tuple[str | None, int | None]:
    """(host, port) of ``url``; the port defaulted by scheme; raises ValueError."""
    parts = urlsplit(url)
    return parts.hostname, parts.port or DEFAULT_PORTS.get(parts.scheme or scheme)


def open_refusal(request: Request) -> str | None:
    """Why a call without a token is refused even on an open loopback controller, or None.

    Open means this machine's own processes, not every web page its browser opens: a page
    elsewhere can post to 127.0.0.1 (its Origin then names its own site), or rebind a name
    of its own to 127.0.0.1 (the Host then names it). Either would run code on the agents.
    """
    scheme = request.url.scheme
    raw = request.headers.get("host", "")
    try:  # the Host header itself (the URL falls back to the bound address on odd ones)
        host, port = _where(f"//{raw}", scheme)
    except ValueError:
        host, port = None, None
    if not is_loopback(host):
        return (
            f"Host {raw!r}: a controller open on loopback answers only to a loopback address "
            f"or localhost without a token; {API_HINT}"
        )
    origin = request.headers.get("origin")
    if origin is None:
        return None
    try:
        seen = _where(origin, scheme) if origin != "null" else (None, None)
    except ValueError:
        seen = (None, None)
    same_scheme = urlsplit(origin).scheme in (scheme, {"ws": "http", "wss": "https"}.get(scheme))
    if not (is_loopback(seen[0]) and seen[1] == port and same_scheme):
        return (
            f"Origin {origin!r}: a page from another site may not call this controller; {API_HINT}"
        )
    return None


def guard(request: Request) -> Guard:
    return request.app.state.guard  # type: ignore[no-any-return]


def require_user(request: Request) -> None:
    guard(request).user(request)


def require_agent(request: Request) -> str:
    return guard(request).agent(request)
