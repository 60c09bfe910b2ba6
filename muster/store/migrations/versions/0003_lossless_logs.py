"""lossless log lines, ingest-order log cursor; drop the unused probe_results, fenced_at

log_lines.raw keeps a line's exact bytes when its text is not clean (NUL, not UTF-8);
log_lines.ingest_id numbers each job's lines in the order they were stored, so a follower
needs one number as its cursor. Existing lines are numbered in (time, origin, rank, seq)
order. Needs SQLite 3.35 or newer (UPDATE ... FROM, ALTER TABLE DROP COLUMN).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from muster.errors import StoreUnavailable

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

MIN_SQLITE = (3, 35, 0)


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        import sqlite3

        if sqlite3.sqlite_version_info < MIN_SQLITE:
            raise StoreUnavailable(
                f"this database needs SQLite 3.35 or newer, Python has {sqlite3.sqlite_version}; "
                "use a Python built with a newer SQLite, or PostgreSQL (--db postgresql://...)"
            )
    op.add_column("log_lines", sa.Column("raw", sa.LargeBinary(), nullable=True))
    op.add_column(
        "log_lines",
        sa.Column("ingest_id", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
    )
    op.execute(
        "UPDATE log_lines SET ingest_id = o.n FROM (SELECT job_id, origin, rank, seq, "
        "row_number() OVER (PARTITION BY job_id ORDER BY time_us, origin, rank, seq) AS n "
        "FROM log_lines) AS o WHERE log_lines.job_id = o.job_id AND log_lines.origin = o.origin "
        "AND log_lines.rank = o.rank AND log_lines.seq = o.seq"
    )
    op.create_index("ix_log_lines_job_ingest", "log_lines", ["job_id", "ingest_id"])
    op.drop_index("ix_probe_results_epoch_id", table_name="probe_results")
    op.drop_table("probe_results")
    op.drop_column("gang_epochs", "fenced_at")


def downgrade() -> None:
    op.add_column("gang_epochs", sa.Column("fenced_at", sa.DateTime(timezone=True), nullable=True))
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
    op.create_index("ix_probe_results_epoch_id", "probe_results", ["epoch_id"])
    op.drop_index("ix_log_lines_job_ingest", table_name="log_lines")
    # A line kept only as bytes goes back to its display text: the old schema cannot hold more.
    op.drop_column("log_lines", "ingest_id")
    op.drop_column("log_lines", "raw")
