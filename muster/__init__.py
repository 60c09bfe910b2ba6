"""muster: run one PyTorch training job across many machines as a gang.

``from muster import launch, Client, AsyncClient, JobResult`` is the Python SDK
(muster.client); it is imported on first use, so ``import muster`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "JobResult", "launch"]

if TYPE_CHECKING:
    from muster.client import AsyncClient, Client, JobResult, launch


def __getattr__(name: str) -> Any:
    if name in __all__:
        from muster import client

        return getattr(client, name)
    raise AttributeError(f"module 'muster' has no attribute {name!r}")
