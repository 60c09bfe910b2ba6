"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-29 09:41:49.156276
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("job_id", sa.String(length=80), nullable=True),
        sa.Column("worker_id", sa.String(length=128), nullable=True),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index("ix_events_job_time", ["job_id", "id"], unique=False)

    op.create_table(
        "jobs",
        sa.Column(
            "seq",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("id", sa.String(length=80), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("path_class", sa.String(length=16), nullable=True),
        sa.Column("why_pending", sa.Text(), nullable=True),
        sa.Column("root_cause", sa.Text(), nullable=True),
        sa.Column("bundle_sha256", sa.String(length=64), nullable=True),
        sa.Column("submitted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_jobs")),
        sa.UniqueConstraint("id", name=op.f("uq_jobs_id")),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_jobs_name"), ["name"], unique=False)
        batch_op.create_index(batch_op.f("ix_jobs_state"), ["state"], unique=False)

    op.create_table(
        "log_lines",
        sa.Column("job_id", sa.String(length=80), nullable=False),
        sa.Column("origin", sa.String(length=8), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("time_us", sa.BigInteger(), nullable=False),
        sa.Column("stream", sa.String(length=8), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "origin", "rank", "seq", name=op.f("pk_log_lines")),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "artifacts",
        sa.Column("job_id", sa.String(length=80), nullable=False),
        sa.Column("node_rank", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(length=1024), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("stored_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_artifacts_job_id_jobs")),
        sa.PrimaryKeyConstraint("job_id", "node_rank", "path", name=op.f("pk_artifacts")),
    )
    op.create_table(
        "conditions",
        sa.Column("job_id", sa.String(length=80), nullable=False),
        sa.Column("type", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=8), nullable=False),
        sa.Column("reason", sa.String(length=64), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("last_transition", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_conditions_job_id_jobs")),
        sa.PrimaryKeyConstraint("job_id", "type", name=op.f("pk_conditions")),
    )
    op.create_table(
        "gang_epochs",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("job_id", sa.String(length=80), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("path_class", sa.String(length=16), nullable=False),
        sa.Column("master_addr", sa.String(length=255), nullable=True),
        sa.Column("master_port", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("fenced_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_gang_epochs_job_id_jobs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gang_epochs")),
        sa.UniqueConstraint("job_id", "number", name=op.f("uq_gang_epochs_job_id_number")),
    )
    with op.batch_alter_table("gang_epochs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_gang_epochs_job_id"), ["job_id"], unique=False)

    op.create_table(
        "workers",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("advertise_address", sa.String(length=255), nullable=True),
        sa.Column("inventory", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("job_id", sa.String(length=80), nullable=True),
        sa.Column("joined_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_workers_job_id_jobs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
    )
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_workers_job_id"), ["job_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_workers_state"), ["state"], unique=False)

    op.create_table(
        "members",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("epoch_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.String(length=80), nullable=False),
        sa.Column("node_rank", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(length=128), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("signal", sa.String(length=16), nullable=True),
        sa.Column("advertise_address", sa.String(length=255), nullable=True),
        sa.Column("path_address", sa.String(length=255), nullable=True),
        sa.Column("assigned_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["epoch_id"], ["gang_epochs.id"], name=op.f("fk_members_epoch_id_gang_epochs")
        ),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_members_job_id_jobs")),
        sa.ForeignKeyConstraint(
            ["worker_id"], ["workers.id"], name=op.f("fk_members_worker_id_workers")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_members")),
        sa.UniqueConstraint("epoch_id", "node_rank", name=op.f("uq_members_epoch_id_node_rank")),
        sa.UniqueConstraint("epoch_id", "worker_id", name=op.f("uq_members_epoch_id_worker_id")),
    )
    with op.batch_alter_table("members", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_members_epoch_id"), ["epoch_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_members_job_id"), ["job_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_members_worker_id"), ["worker_id"], unique=False)

    op.create_table(
        "probe_results",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("epoch_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("src_node", sa.Integer(), nullable=False),
        sa.Column("dst_node", sa.Integer(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("rtt_ms", sa.Float(), nullable=True),
        sa.Column("tcp_gbps", sa.Float(), nullable=True),
        sa.Column("path", sa.String(length=64), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("measured_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["epoch_id"], ["gang_epochs.id"], name=op.f("fk_probe_results_epoch_id_gang_epochs")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_probe_results")),
    )
    with op.batch_alter_table("probe_results", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_probe_results_epoch_id"), ["epoch_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("probe_results", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_probe_results_epoch_id"))

    op.drop_table("probe_results")
    with op.batch_alter_table("members", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_members_worker_id"))
        batch_op.drop_index(batch_op.f("ix_members_job_id"))
        batch_op.drop_index(batch_op.f("ix_members_epoch_id"))

    op.drop_table("members")
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_workers_state"))
        batch_op.drop_index(batch_op.f("ix_workers_job_id"))

    op.drop_table("workers")
    with op.batch_alter_table("gang_epochs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_gang_epochs_job_id"))

    op.drop_table("gang_epochs")
    op.drop_table("conditions")
    op.drop_table("artifacts")
    op.drop_table("log_lines")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_state"))
        batch_op.drop_index(batch_op.f("ix_jobs_name"))

    op.drop_table("jobs")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("ix_events_job_time")

    op.drop_table("events")
