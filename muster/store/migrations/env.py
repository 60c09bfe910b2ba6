"""Alembic environment: muster runs migrations in-process on the connection it passes in."""

from __future__ import annotations

from alembic import context

from muster.store.models import Base

connection = context.config.attributes.get("connection")
if connection is None:  # pragma: no cover - muster always passes its own connection
    raise RuntimeError("run migrations through muster.store.open_store")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
