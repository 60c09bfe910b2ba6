"""A worker's control link at the controller's seam (unit tests only)."""

from __future__ import annotations

from typing import Any

from muster.wire import Kind


class FakeLink:
    """A worker's control link at the seam: what the controller sends it."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.sent: list[tuple[Kind, dict[str, Any]]] = []

    async def send(self, kind: Kind, body: dict[str, Any]) -> bool:
        self.sent.append((kind, body))
        return True
