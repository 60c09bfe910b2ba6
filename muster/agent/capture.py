"""Per-rank output capture: torchrun writes each local rank's streams to its own files
(``--log-dir D --redirects 3``); ``RankTailer`` follows them and numbers every line.

Layout torchrun uses: ``D/<run id>/attempt_0/<local rank>/{stdout,stderr}.log``.

Lines are bytes; a rank may write anything. A line that is UTF-8 goes out as its text
(NUL included: JSON carries it as \u0000). A line that is not goes out with a display text
(U+FFFD for each bad byte) and a 7th field, base64 of its exact bytes, so the store keeps
them and the wire stays plain JSON (orjson refuses the lone surrogates a reversible
decode such as surrogateescape would produce).
"""

from __future__ import annotations

import base64
import os
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MAX_LINE = 64 * 1024  # bytes; longer lines are cut (between characters), the rest follows
# Once every rank's two files are found, how often to look for new ones (a torchrun restart
# writes a new attempt_N directory): each look is 2 x procs directory walks.
DISCOVER_EVERY_S = 1.0

#: One captured line: (origin, rank, seq, time, stream, text), and for a line that is not
#: UTF-8 a 7th field: base64 of its exact bytes (``text`` then shows U+FFFD for bad bytes).
Line = tuple[str, int, int, float, str, str] | tuple[str, int, int, float, str, str, str]


@dataclass
class _Stream:
    path: Path
    rank: int
    stream: str
    offset: int = 0
    partial: bytes = b""


@dataclass
class RankTailer:
    """Follows every rank file of one member; calls ``emit`` with complete lines."""

    capture_dir: Path
    first_rank: int
    procs: int
    emit: Callable[[list[Line]], None]
    tail_size: int = 40
    _streams: dict[Path, _Stream] = field(default_factory=dict)
    _seq: dict[int, int] = field(default_factory=dict)
    tails: dict[int, deque[str]] = field(default_factory=dict)
    bytes_read: int = 0  # every byte the rank files gained, complete lines or not
    _next_look: float = 0.0

    def _discover(self, always: bool = False) -> None:
        now = time.monotonic()
        found = len({(st.rank, st.stream) for st in self._streams.values()})
        if not always and found == 2 * self.procs and now < self._next_look:
            return
        self._next_look = now + DISCOVER_EVERY_S
        for local in range(self.procs):
            for stream in ("stdout", "stderr"):
                for path in self.capture_dir.glob(f"*/attempt_*/{local}/{stream}.log"):
                    if path not in self._streams:
                        self._streams[path] = _Stream(path, self.first_rank + local, stream)

    def poll(self, final: bool = False) -> int:
        """Read what the files gained; on ``final`` also the last line without a newline."""
        self._discover(always=final)
        count = 0
        for st in self._streams.values():
            try:
                with open(st.path, "rb") as fh:
                    fh.seek(st.offset)
                    data = fh.read()
            except FileNotFoundError:
                continue
            if not data and not (final and st.partial):
                continue
            st.offset += len(data)
            self.bytes_read += len(data)  # a \r progress bar is output too (hang watch)
            buf = st.partial + data
            cut = len(buf) if final else buf.rfind(b"\n") + 1
            st.partial = buf[cut:]
            if cut:
                count += self._lines(st, buf[:cut], time.time())
        return count

    def _lines(self, st: _Stream, chunk: bytes, now: float) -> int:
        pieces = chunk.split(b"\n")
        if chunk.endswith(b"\n"):
            pieces.pop()
        parts = [part for piece in pieces for part in cut_line(piece.rstrip(b"\r"))]
        first = self._seq.get(st.rank, 0) + 1
        self._seq[st.rank] = first + len(parts) - 1
        rank, stream = st.rank, st.stream
        lines = [line_fields("rank", rank, first + i, now, stream, p) for i, p in enumerate(parts)]
        self.emit(lines)
        tail = self.tails.setdefault(rank, deque(maxlen=self.tail_size))
        tail.extend(line[5] for line in lines[-self.tail_size :])
        return len(lines)


def cut_line(data: bytes, most: int = MAX_LINE) -> list[bytes]:
    """``data`` in pieces of at most ``most`` bytes, cut between UTF-8 characters when it can."""
    parts = []
    while len(data) > most:
        cut = most
        # Back off over continuation bytes (10xxxxxx) so a character is not split in two.
        while cut > most - 3 and data[cut] & 0xC0 == 0x80:
            cut -= 1
        parts.append(data[:cut])
        data = data[cut:]
    parts.append(data)
    return parts


def line_fields(origin: str, rank: int, seq: int, now: float, stream: str, data: bytes) -> Line:
    """The wire form of one line: its text, plus base64 of its bytes when they are not UTF-8."""
    try:
        return (origin, rank, seq, now, stream, data.decode("utf-8"))
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        return (origin, rank, seq, now, stream, text, base64.b64encode(data).decode("ascii"))


_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)(?:.*\((SIG[A-Z0-9]+)\))?")


def root_cause(launcher_lines: list[str]) -> tuple[int | None, int | None, str | None]:
    """(global rank, exit code, signal) of torchrun's "Root Cause" section, if it printed one."""
    try:
        start = max(i for i, line in enumerate(launcher_lines) if "Root Cause" in line)
    except ValueError:
        return None, None, None
    rank = code = None
    signal = None
    for line in launcher_lines[start:]:
        if rank is None and (m := _ROOT_RANK.match(line)):
            rank = int(m.group(1))
        elif code is None and (m := _ROOT_EXIT.match(line)):
            code = int(m.group(1))
            signal = m.group(2)
    return rank, code, signal


_FAILED_PID = re.compile(r"\(pid: (\d+)\)")


def failed_pids(launcher_lines: list[str]) -> set[int]:
    """The pids torchrun's failure summary names (``exitcode : -9 (pid: 1234)``)."""
    try:
        start = max(i for i, line in enumerate(launcher_lines) if "Root Cause" in line)
    except ValueError:
        start = 0
    return {int(m.group(1)) for line in launcher_lines[start:] if (m := _FAILED_PID.search(line))}


def list_outputs(root: Path) -> list[Path]:
    """Every regular file under ``root``, in a stable order."""
    found: list[Path] = []
    for base, _dirs, names in os.walk(root):
        for name in names:
            path = Path(base) / name
            if path.is_file() and not path.is_symlink():
                found.append(path)
    return sorted(found)
