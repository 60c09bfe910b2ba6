"""A store with direct-capable workers, for the controller tests that drive a gang by hand."""

from __future__ import annotations

from pathlib import Path

from muster.spec import NetworkCaps, WorkerInventory
from muster.store import Store, open_store


def direct_worker(i: int, wid: str, **location: str) -> WorkerInventory:
    """Worker ``wid`` at 10.0.0.<i + 1>, able to make a WireGuard device; ``location``:
    provider/region it declared."""
    return WorkerInventory(
        id=wid,
        hostname=wid,
        advertise_address=f"10.0.0.{i + 1}",
        torch_version="2.13.0",
        torchrun=True,
        backends=["gloo"],
        network=NetworkCaps(can_create_device=True),
        **location,  # type: ignore[arg-type]
    )


def store_with_workers(tmp_path: Path, workers: tuple[str, ...], **location: str) -> Store:
    """A SQLite store holding ``workers`` (w0 at 10.0.0.1, ...), each able to make a
    WireGuard device; ``location``: provider/region they declared."""
    store = open_store(str(tmp_path / "muster.db"))
    for i, wid in enumerate(workers):
        store.upsert_worker(direct_worker(i, wid, **location))
    return store
