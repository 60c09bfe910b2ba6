"""Building worker inventories for scheduler tests."""

from __future__ import annotations

from typing import Any

from muster.spec import Gpus, NetworkCaps, WorkerInventory, WorkerState, WorkerView


def worker(
    wid: str,
    *,
    torch: str | None = "2.5.1",
    torchrun: bool = True,
    backends: tuple[str, ...] = ("gloo", "nccl"),
    gpus: int = 0,
    vendor: str | None = None,
    provider: str = "aws",
    region: str = "us-east-1",
    region_class: str = "us",
    private: str | None = None,
    device: bool = True,
    container: bool = False,
    address: bool = True,
) -> WorkerInventory:
    return WorkerInventory(
        id=wid,
        hostname=f"{wid}.example",
        advertise_address=f"192.0.2.{abs(hash(wid)) % 250 + 1}" if address else None,
        torch_version=torch,
        torchrun=torchrun,
        backends=list(backends),
        gpus=Gpus(count=gpus, vendor=vendor if gpus else None),  # type: ignore[arg-type]
        provider=provider,
        region=region,
        region_class=region_class,
        network=NetworkCaps(
            private_network_id=private, can_create_device=device, container_only=container
        ),
    )


def idle(*workers: WorkerInventory) -> list[WorkerView]:
    return [WorkerView(inventory=w) for w in workers]


def busy(w: WorkerInventory) -> WorkerView:
    return WorkerView(inventory=w, state=WorkerState.BUSY)


def gang(n: int, p: int = 1, **extra: Any) -> dict[str, Any]:
    dist = {"num_workers": n, "procs_per_worker": p}
    dist.update(extra.pop("dist", {}))
    return {"name": "job", "entrypoint": "train.py", "distributed": dist, **extra}
