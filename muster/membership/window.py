"""The join window (seed 003): who walked in, and when the world forms. Pure: events in, a
new window and what to tell each side out.

A window opens with its rules, admits walk-ins in order (each brings some ranks), and forms
the world once:

- ``auto``: at the target, or at ``join_timeout`` with the quorum met; without the quorum it
  keeps waiting (walk-ins still come) until the hard cap fails it.
- ``manual``: the quorum met moves it to ``staging``, held until ``muster start`` (or the hard
  cap fails it); the clock does not form it.
- ``hybrid``: both; staging as manual, and the target or the timeout still form it.

Walk-ins are admitted while ``waiting`` and ``staging``; a walk-in that leaves before the
world forms gives its ranks back and those after it move down, so ranks stay contiguous in
admission order. At ``forming`` the roster freezes: later dials are refused, and the world is
exactly the roster. After that the gang's run drives the phase (``Started`` -> training,
``Ended`` -> done or failed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

StartMode = Literal["auto", "manual", "hybrid"]


class Phase(str, Enum):
    WAITING = "waiting"
    STAGING = "staging"
    FORMING = "forming"
    TRAINING = "training"
    DONE = "done"
    FAILED = "failed"

    @property
    def open(self) -> bool:
        """Walk-ins are admitted."""
        return self in (Phase.WAITING, Phase.STAGING)

    @property
    def terminal(self) -> bool:
        return self in (Phase.DONE, Phase.FAILED)


@dataclass(frozen=True)
class Rules:
    """A window's settings, resolved (defaults filled from the capacity)."""

    start: StartMode
    quorum: int  # fewest ranks the world may form with
    target: int | None  # ranks at which auto/hybrid form at once; None: no early close
    join_timeout: float  # seconds after opening: auto/hybrid form here with the quorum
    max_join_timeout: float  # hard cap: not formed by then -> failed

    def __post_init__(self) -> None:
        if self.quorum < 1:
            raise ValueError("quorum must be at least 1")
        if self.start == "manual" and self.target is not None:
            raise ValueError("a manual window has no target")
        if self.target is not None and self.target < self.quorum:
            raise ValueError("target below quorum")
        if self.max_join_timeout < self.join_timeout:
            raise ValueError("max_join_timeout below join_timeout")


@dataclass(frozen=True)
class Member:
    """One walk-in on the roster: its ranks are [first_rank, first_rank + ranks)."""

    worker: str  # the link it dialled on (one walk-in per link)
    host: str  # its name on the roster
    ranks: int
    first_rank: int
    joined_at: float


# ---- events ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Join:
    worker: str
    host: str
    ranks: int


@dataclass(frozen=True)
class Leave:
    """A walk-in's link closed (or it withdrew)."""

    worker: str


@dataclass(frozen=True)
class Start:
    """The operator's ``muster start`` (already authenticated)."""


@dataclass(frozen=True)
class Tick:
    """The clock: timeouts are checked against ``now``."""


@dataclass(frozen=True)
class Started:
    """The formed world's gang is running (every member started)."""


@dataclass(frozen=True)
class Ended:
    ok: bool
    reason: str = ""


Event = Join | Leave | Start | Tick | Started | Ended


# ---- outcomes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Admitted:
    worker: str
    first_rank: int
    ranks: int


@dataclass(frozen=True)
class Refused:
    """A dial, or a start, turned down; ``reason`` names it and the fix."""

    worker: str | None  # None: the operator's start
    reason: str


@dataclass(frozen=True)
class Formed:
    """The world froze: the roster in rank order, and its size."""

    roster: tuple[Member, ...]
    world_size: int


@dataclass(frozen=True)
class Failed:
    reason: str


@dataclass(frozen=True)
class Renumbered:
    """Walk-ins whose ranks moved down after one before them left."""

    members: tuple[Member, ...]


Outcome = Admitted | Refused | Formed | Failed | Renumbered


@dataclass(frozen=True)
class Window:
    rules: Rules
    opened_at: float
    phase: Phase = Phase.WAITING
    roster: tuple[Member, ...] = ()
    reason: str = ""  # why it failed, or how it formed
    formed_at: float | None = None
    started_by: str = field(default="")  # "target", "timeout", "operator"

    @property
    def ranks(self) -> int:
        return sum(m.ranks for m in self.roster)

    @property
    def quorum_met(self) -> bool:
        return self.ranks >= self.rules.quorum

    def next_tick(self, now: float) -> float | None:
        """When the clock next matters (a Tick then may move the window), or None once it
        is closed: the timeout while it can still form the window, then the hard cap."""
        if not self.phase.open:
            return None
        timeout = self.opened_at + self.rules.join_timeout
        if self.rules.start != "manual" and now < timeout:
            return timeout
        return self.opened_at + self.rules.max_join_timeout

    @property
    def startable(self) -> bool:
        """The operator may fire the start now."""
        return self.phase is Phase.STAGING


def open_window(rules: Rules, now: float) -> Window:
    return Window(rules, now)


def step(window: Window, event: Event, now: float) -> tuple[Window, list[Outcome]]:
    """Apply one event at time ``now``; the new window and what each side is told."""
    out: list[Outcome] = []
    window = _clock(window, now, out)  # a dial after the timeout or the cap meets a closed window
    if isinstance(event, Join):
        window = _join(window, event, now, out)
    elif isinstance(event, Leave):
        window = _leave(window, event, out)
    elif isinstance(event, Start):
        window = _start(window, now, out)
    elif isinstance(event, Started):
        if window.phase is Phase.FORMING:
            window = dataclasses.replace(window, phase=Phase.TRAINING)
    elif isinstance(event, Ended) and not window.phase.terminal:
        ok = event.ok and not window.phase.open  # a window ended before it formed ran nothing
        reason = event.reason or ("" if ok else "the run ended before the world formed")
        window = dataclasses.replace(
            window, phase=Phase.DONE if ok else Phase.FAILED, reason=reason
        )
        if not ok:
            out.append(Failed(reason))
    return _clock(window, now, out), out


def _join(window: Window, event: Join, now: float, out: list[Outcome]) -> Window:
    refused = _refusal(window, event)
    if refused:
        out.append(Refused(event.worker, refused))
        return window
    member = Member(event.worker, event.host, event.ranks, window.ranks, now)
    window = dataclasses.replace(window, roster=(*window.roster, member))
    out.append(Admitted(member.worker, member.first_rank, member.ranks))
    return window


def _refusal(window: Window, event: Join) -> str:
    if not window.phase.open:
        return (
            f"the window is {window.phase.value}: the world formed without {event.host}; "
            "dial again for the next run (muster join --persist waits for it)"
        )
    if event.ranks < 1:
        return f"{event.host} offers no ranks; offer devices (--devices) or CPU ranks (--procs)"
    for member in window.roster:
        if member.worker == event.worker:
            return f"{event.host} is already on the roster (ranks from {member.first_rank})"
        if member.host == event.host:
            return (
                f"host name {event.host!r} is taken on the roster by {member.worker}; "
                "give this box another name (--host NAME)"
            )
    return ""


def _leave(window: Window, event: Leave, out: list[Outcome]) -> Window:
    if not window.phase.open or all(m.worker != event.worker for m in window.roster):
        return window  # after forming, the gang's run decides what a lost host means
    kept: list[Member] = []
    moved: list[Member] = []
    first = 0
    for member in window.roster:
        if member.worker == event.worker:
            continue
        if member.first_rank != first:
            member = dataclasses.replace(member, first_rank=first)
            moved.append(member)
        kept.append(member)
        first += member.ranks
    window = dataclasses.replace(window, roster=tuple(kept))
    if moved:
        out.append(Renumbered(tuple(moved)))
    if window.phase is Phase.STAGING and not window.quorum_met:
        window = dataclasses.replace(window, phase=Phase.WAITING)  # no longer startable
    return window


def _start(window: Window, now: float, out: list[Outcome]) -> Window:
    why = start_refusal(window)
    if why:
        out.append(Refused(None, why))
        return window
    return _form(window, now, "operator", out)


def start_refusal(window: Window) -> str:
    """Why ``muster start`` is refused now, or "" when it fires."""
    rules = window.rules
    if rules.start == "auto":
        return "the window starts on its own (start: auto); use start: manual or hybrid to hold it"
    if not window.phase.open:
        return f"the window is already closed ({window.phase.value})"
    if not window.quorum_met:
        return (
            f"quorum not met: {window.ranks} of {rules.quorum} ranks have joined; wait for "
            "more walk-ins (arming below quorum is refused, not queued)"
        )
    return ""


def _clock(window: Window, now: float, out: list[Outcome]) -> Window:
    """The rules that follow from the roster and the time, applied until nothing moves."""
    rules = window.rules
    if not window.phase.open:
        return window
    if window.phase is Phase.WAITING and window.quorum_met and rules.start != "auto":
        window = dataclasses.replace(window, phase=Phase.STAGING)
    timed_out = now >= window.opened_at + rules.join_timeout
    if rules.start != "manual" and window.quorum_met:
        if rules.target is not None and window.ranks >= rules.target:
            return _form(window, now, "target", out)
        if timed_out:
            return _form(window, now, "timeout", out)
    if now >= window.opened_at + rules.max_join_timeout:
        if window.phase is Phase.STAGING:
            why = (
                f"the start was never fired within max_join_timeout ({rules.max_join_timeout:g}s); "
                "run muster start while the roster is staging, or raise max_join_timeout"
            )
        else:
            why = (
                f"quorum never met within max_join_timeout ({rules.max_join_timeout:g}s): "
                f"{window.ranks} of {rules.quorum} ranks joined; start more workers or lower "
                "the quorum"
            )
        out.append(Failed(why))
        return dataclasses.replace(window, phase=Phase.FAILED, reason=why)
    return window


def _form(window: Window, now: float, by: str, out: list[Outcome]) -> Window:
    window = dataclasses.replace(
        window, phase=Phase.FORMING, formed_at=now, started_by=by, reason=f"formed on {by}"
    )
    out.append(Formed(window.roster, window.ranks))
    return window
