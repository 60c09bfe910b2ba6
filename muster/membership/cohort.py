"""A window job's join window and the boxes it admitted (seed 003): the door each walk-in
passes, the world the roster forms, and how the window is shown. Pure: the controller's
WindowDesk (muster.controller.windows) feeds it and applies what it decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from muster.membership.admission import Hello, refusal
from muster.membership.window import Phase, Rules, Window, open_window
from muster.spec import JobSpec, WorkerInventory
from muster.spec.job import JoinWindow

# A window job's phase when the desk holds no open window for it, from the job's state.
AFTER_FORMING = {
    "queued": "waiting",  # submitted, its window opens at the next pass
    "running": "training",
    "succeeded": "done",
    "failed": "failed",
    "cancelled": "failed",
}


@dataclass
class WindowEntry:
    """One window job's join window and what the controller keeps beside it."""

    job: str
    spec: JobSpec
    bundle: str | None
    window: Window
    inventories: dict[str, WorkerInventory] = field(default_factory=dict)  # admitted
    hellos: dict[str, Hello] = field(default_factory=dict)  # admitted, by worker
    told: set[str] = field(default_factory=set)  # workers refused (told once per link)


def window_rules(spec: JobSpec) -> Rules:
    """The job's window with its defaults filled: quorum and target default to the job's
    size (num_workers x procs_per_worker), so a window sized like a pool gang forms the
    moment every rank is in and never starts below it."""
    gang = spec.gang
    join = gang.window or JoinWindow()
    capacity = gang.world_size  # num_workers x procs_per_worker, or a formed world's sum
    quorum = join.quorum or capacity
    target = None if join.start == "manual" else max(join.target_ranks or capacity, quorum)
    return Rules(join.start, quorum, target, float(join.join_timeout), float(join.max_join_timeout))


def world_spec(spec: JobSpec, window: Window, ranks: list[int]) -> JobSpec:
    """The job sized to a world of boxes with these rank counts (node r: ``ranks[r]``). The
    window's rules in force are written out too, so a window opened again for the job (its
    epoch fenced, the controller restarted) keeps them rather than re-deriving them from the
    formed size."""
    rules = window.rules
    join = (spec.gang.window or JoinWindow()).model_copy(
        update={"quorum": rules.quorum, "target_ranks": rules.target}
    )
    sized = {"num_workers": len(ranks), "node_procs": list(ranks), "window": join}
    return spec.model_copy(update={"distributed": spec.gang.model_copy(update=sized)})


def open_entry(job: str, spec: JobSpec, bundle: str | None, now: float) -> WindowEntry:
    return WindowEntry(job, spec, bundle, open_window(window_rules(spec), now))


def hello_of(inventory: WorkerInventory, job: str, bundle: str | None) -> Hello:
    """What a walk-in says of itself. The run is the job and the model signature the job's
    bundle: every walk-in fetches the same bundle from the controller, so those agree; the
    vendor and the torch version are the box's own."""
    vendor = inventory.gpus.vendor if inventory.gpus.count else None
    assert inventory.join is not None
    return Hello(
        host=inventory.join.host,
        vendor=vendor if vendor in ("nvidia", "amd") else None,
        torch=inventory.torch_version or "none",
        run=job,
        model_sig=bundle or "",
        data_sig=inventory.join.data_sig,
    )


def door(entry: WindowEntry, inventory: WorkerInventory) -> str:
    """Why this walk-in may not join ``entry``'s cohort ("" when it may)."""
    assert inventory.join is not None
    gang, walk_in = entry.spec.gang, inventory.join
    if entry.spec.resources.effective_device == "cuda" and inventory.gpus.count < walk_in.ranks:
        return (
            f"{walk_in.host} offers {walk_in.ranks} rank(s) but has {inventory.gpus.count} "
            f"GPU(s), and job {entry.job} runs on cuda (one rank per GPU): join with --devices "
            "listing its GPUs"
        )
    if not inventory.torchrun:
        return f"{inventory.join.host} has no torchrun (torch missing); install torch there"
    backend = gang.backend or (
        "nccl" if entry.spec.resources.effective_device == "cuda" else "gloo"
    )
    cohort = next(iter(entry.hellos.values()), None)
    return refusal(cohort, hello_of(inventory, entry.job, entry.bundle), backend)


def summary(job: str, window: Window, now: float) -> str:
    """The window as its job's why-pending line: the phase first (its kind), then counts."""
    rules = window.rules
    target = f", target {rules.target}" if rules.target is not None else ""
    head = f"join window {window.phase.value}: {window.ranks} rank(s) in, quorum {rules.quorum}"
    head += target
    if window.phase is Phase.STAGING:
        head += f"; startable: muster start {job}"
    due = window.next_tick(now)
    if due is None:
        return head
    timing = rules.start != "manual" and now < window.opened_at + rules.join_timeout
    return f"{head}; {'timeout' if timing else 'hard cap'} in {max(0.0, due - now):.0f}s"


def status(entry: WindowEntry | None, job_state: str, now: float) -> dict[str, Any]:
    """The read-only view of a job's window (``muster status``, GET .../window)."""
    if entry is None:
        return {"phase": None, "job_state": job_state, "roster": []}
    window = entry.window
    rules = window.rules
    return {
        "phase": window.phase.value,
        "job_state": job_state,
        "start": rules.start,
        "quorum": rules.quorum,
        "target": rules.target,
        "join_timeout": rules.join_timeout,
        "max_join_timeout": rules.max_join_timeout,
        "opened_at": window.opened_at,
        "next_deadline_in": (
            None if (due := window.next_tick(now)) is None else round(max(0.0, due - now), 1)
        ),
        "ranks": window.ranks,
        "startable": window.startable,
        "reason": window.reason,
        "roster": [
            {
                "host": m.host,
                "worker": m.worker,
                "first_rank": m.first_rank,
                "ranks": m.ranks,
                "joined_at": m.joined_at,
            }
            for m in window.roster
        ],
    }
