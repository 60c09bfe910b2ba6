"""What an agent offers: its machine's inventory, as the scheduler sees it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from muster.spec.network import MESH_INTERFACE
from muster.spec.states import WorkerState

GpuVendor = Literal["nvidia", "amd", "intel", "apple"]

# A provider, region or region class name (``aws``, ``us-east-1``, ``eu``): what `muster
# agent --provider/--region/--region-class` takes. "local" is the default: not declared.
LOCATION = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,62}$"
UNDECLARED = "local"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Gpus(_Model):
    count: int = Field(default=0, ge=0)
    vendor: GpuVendor | None = None
    model: str | None = None
    memory_mb: int = Field(default=0, ge=0, description="memory per GPU")


class NetworkCaps(_Model):
    """Which gang paths this machine can take part in (seed 000)."""

    private_network_id: str | None = Field(
        default=None, description="id of the provider private network it sits on, if any"
    )
    private_address: str | None = Field(default=None, description="its address on that network")
    private_interface: str | None = Field(
        default=None, description="interface holding private_address; None: torch picks one"
    )
    primary_interface: str | None = Field(
        default=None, description="interface of the advertise address; None: torch picks one"
    )
    can_create_device: bool = Field(
        default=False, description="may create a WireGuard device (direct path)"
    )
    device: str = Field(
        default=MESH_INTERFACE,
        pattern=r"^[A-Za-z0-9_.-]{1,15}$",
        description="the name of its WireGuard device on the direct path (one per agent)",
    )
    container_only: bool = Field(
        default=False, description="no network device, no CAP_NET_ADMIN, no UDP"
    )


class WalkIn(_Model):
    """An agent that walked in to one job's join window (``muster join``) rather than
    offering itself to the pool: it serves that job only."""

    job: str | None = Field(
        default=None, min_length=1, max_length=64, description="None: the oldest open window"
    )
    host: str = Field(min_length=1, max_length=253, description="its name on the roster")
    ranks: int = Field(ge=1, le=1024, description="ranks it offers (devices or CPU procs)")
    data_sig: str | None = Field(
        default=None, max_length=64, description="sha256 of its data manifest (--data-path)"
    )


class WorkerInventory(_Model):
    """One machine an agent runs on."""

    id: str = Field(max_length=128)
    hostname: str = Field(max_length=255)
    advertise_address: str | None = Field(default=None, max_length=255)
    python_version: str = ""
    torch_version: str | None = Field(default=None, description="None when torch is missing")
    torchrun: bool = False
    backends: list[str] = Field(default_factory=list)
    gpus: Gpus = Field(default_factory=Gpus)
    provider: str = Field(default=UNDECLARED, pattern=LOCATION, description="aws, gcp, onprem")
    region: str = Field(
        default=UNDECLARED, pattern=LOCATION, description="the provider's region (us-east-1)"
    )
    region_class: str = Field(
        default=UNDECLARED,
        pattern=LOCATION,
        description="regions close enough for a `regional` job (eu, us-east)",
    )
    network: NetworkCaps = Field(default_factory=NetworkCaps)
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)
    join: WalkIn | None = Field(default=None, description="a walk-in: the window it joins")


class WorkerView(_Model):
    """A worker in a scheduler snapshot: its inventory and its state."""

    inventory: WorkerInventory
    state: WorkerState = WorkerState.IDLE

    @property
    def id(self) -> str:
        return self.inventory.id
