"""Network vocabulary shared by the spec, the scheduler and the plan (seed 000).

- ``NetworkClass`` (spec.distributed.network): how close the members must be.
  colocated = one provider region; regional = one region class, any provider; global = anywhere.
- ``Transport`` (spec.distributed.transport): which paths the job accepts.
  direct = Private or Direct only; auto = Relayed too.
- ``PathClass``: the path a placed gang uses. One class for every member of a gang.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

NetworkClass = Literal["colocated", "regional", "global"]
Transport = Literal["direct", "auto"]

#: The device the direct path creates on every member.
MESH_INTERFACE = "muster0"


class PathClass(str, Enum):
    """How a gang's members reach each other, best first."""

    PRIVATE = "private"  # the provider's private network, one region
    DIRECT = "direct"  # WireGuard between the members, device muster0
    RELAYED = "relayed"  # user-space WireGuard through relays, LD_PRELOAD shim

    @property
    def relative_cost(self) -> int:
        """Cost the scheduler uses when comparing placements: relayed counts 4x direct."""
        return _COST[self]


_COST = {PathClass.PRIVATE: 1, PathClass.DIRECT: 2, PathClass.RELAYED: 8}
