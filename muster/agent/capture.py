"""Per-rank output capture: torchrun writes each local rank's streams to its own files
(``--log-dir D --redirects 3``); ``RankTailer`` follows them and numbers every line.

Layout torchrun uses: ``D/<run id>/attempt_0/<local rank>/{stdout,stderr}.log``.
"""

from __future__ import annotations

import os
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MAX_LINE = 64 * 1024  # longer lines are cut; the rest follows as another line

#: One captured line: (origin, rank, seq, time, stream, text)
Line = tuple[str, int, int, float, str, str]


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
    emit: Callable[[Line], None]
    tail_size: int = 40
    _streams: dict[Path, _Stream] = field(default_factory=dict)
    _seq: dict[int, int] = field(default_factory=dict)
    tails: dict[int, deque[str]] = field(default_factory=dict)

    def _discover(self) -> None:
        for local in range(self.procs):
            for stream in ("stdout", "stderr"):
                for path in self.capture_dir.glob(f"*/attempt_*/{local}/{stream}.log"):
                    if path not in self._streams:
                        self._streams[path] = _Stream(path, self.first_rank + local, stream)

    def poll(self, final: bool = False) -> int:
        """Read what the files gained; on ``final`` also the last line without a newline."""
        self._discover()
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
            buf = st.partial + data
            lines = buf.split(b"\n")
            st.partial = lines.pop()
            if final and st.partial:
                lines.append(st.partial)
                st.partial = b""
            now = time.time()
            for raw in lines:
                for start in range(0, max(len(raw), 1), MAX_LINE):
                    self._line(st, raw[start : start + MAX_LINE], now)
                    count += 1
        return count

    def _line(self, st: _Stream, raw: bytes, now: float) -> None:
        seq = self._seq.get(st.rank, 0) + 1
        self._seq[st.rank] = seq
        text = raw.decode("utf-8", errors="replace").rstrip("\r")
        self.tails.setdefault(st.rank, deque(maxlen=self.tail_size)).append(text)
        self.emit(("rank", st.rank, seq, now, st.stream, text))


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


def list_outputs(root: Path) -> list[Path]:
    """Every regular file under ``root``, in a stable order."""
    found: list[Path] = []
    for base, _dirs, names in os.walk(root):
        for name in names:
            path = Path(base) / name
            if path.is_file() and not path.is_symlink():
                found.append(path)
    return sorted(found)
