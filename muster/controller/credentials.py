"""The controller's two secrets, made at its first start and kept in its database: the API
token (users: submit, cancel, read) and the join secret (agents: the link handshake and their
ticketed routes). Apart from auth.py (the HTTP side) so that `muster token` reads them without
importing the web framework (half a second of every call)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from muster.store import Store


@dataclass(frozen=True)
class Credentials:
    api_token: str
    join_secret: str


def credentials(store: Store) -> Credentials:
    """Both secrets: made at first start, kept in the database."""
    return Credentials(
        api_token=store.setting("api_token", lambda: secrets.token_urlsafe(32)),
        join_secret=store.setting("join_token", lambda: secrets.token_urlsafe(32)),
    )
