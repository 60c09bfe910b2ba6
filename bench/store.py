"""Batched log-line ingest: muster's Store.append_logs against the raw driver, same run.

The anchor writes the same rows into an identical table with the driver alone (sqlite3's
executemany; psycopg's executemany), without idempotence. muster's path is the one the
controller uses: one transaction per batch, INSERT ... ON CONFLICT DO NOTHING so a resent
batch never duplicates. Prints lines/s for both and the ratio, on SQLite and, when a
PostgreSQL server can be started (Debian's postgresql package), on PostgreSQL.

    .venv/bin/python bench/store.py [--lines 200000] [--batch 1000]

Goal (issue 2): >= 100,000 lines/s on SQLite.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from muster.store import LogLineIn, Store, open_store

TEXT = "step 1234 loss 2.3456 lr 3.0e-04 tokens/s 123456.7 grad_norm 0.98"


def batches(total: int, size: int, ranks: int = 8) -> list[list[LogLineIn]]:
    now = time.time()
    lines = [
        LogLineIn("rank", i % ranks, i // ranks, now, "stdout", f"{TEXT} #{i}")
        for i in range(total)
    ]
    return [lines[i : i + size] for i in range(0, total, size)]


def muster_rate(store: Store, job_id: str, work: list[list[LogLineIn]]) -> float:
    t0 = time.perf_counter()
    stored = sum(store.append_logs(job_id, batch) for batch in work)
    elapsed = time.perf_counter() - t0
    assert stored == sum(map(len, work)), f"stored {stored}"
    return stored / elapsed


def rows(job_id: str, batch: list[LogLineIn]) -> list[tuple[object, ...]]:
    return [
        (job_id, ln.origin, ln.rank, ln.seq, int(ln.time * 1e6), ln.stream, ln.text) for ln in batch
    ]


DDL = (
    "CREATE TABLE raw_lines (job_id VARCHAR(80), origin VARCHAR(8), rank INTEGER, "
    "seq BIGINT, time_us BIGINT, stream VARCHAR(8), text TEXT, "
    "PRIMARY KEY (job_id, origin, rank, seq))"
)


def raw_sqlite_rate(path: str, work: list[list[LogLineIn]]) -> float:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(DDL)
    sql = "INSERT INTO raw_lines VALUES (?, ?, ?, ?, ?, ?, ?)"
    t0 = time.perf_counter()
    for batch in work:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(sql, rows("j", batch))
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - t0
    conn.close()
    return sum(map(len, work)) / elapsed


def raw_postgres_rate(url: str, work: list[list[LogLineIn]]) -> float:
    import psycopg

    with psycopg.connect(url) as conn:
        conn.execute(DDL)
        conn.commit()
        t0 = time.perf_counter()
        for batch in work:
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO raw_lines VALUES (%s, %s, %s, %s, %s, %s, %s)", rows("j", batch)
                )
            conn.commit()
        elapsed = time.perf_counter() - t0
    return sum(map(len, work)) / elapsed


def measure(name: str, url: str, raw: float, work: list[list[LogLineIn]]) -> float:
    store = open_store(url)
    job = store.submit_job({"name": "bench", "entrypoint": "t.py"})
    rate = muster_rate(store, job.id, work)
    store.db.dispose()
    print(f"{name:<11} {raw:>14,.0f} {rate:>14,.0f} {rate / raw:>7.2f}")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()
    work = batches(args.lines, args.batch)
    print(f"{args.lines:,} lines in batches of {args.batch}, {args.repeat} runs each")
    print(f"{'engine':<11} {'raw lines/s':>14} {'muster lines/s':>14} {'ratio':>7}")
    sqlite_rates = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            raw = raw_sqlite_rate(f"{tmp}/raw.db", work)
            sqlite_rates.append(measure("sqlite", f"{tmp}/muster.db", raw, work))
    median = statistics.median(sqlite_rates)
    print(
        f"sqlite median: {median:,.0f} lines/s; goal >= 100,000:",
        "met" if median >= 100_000 else "NOT met",
    )
    if args.no_postgres:
        return
    from tests.pg import start_postgres

    server, why_not = start_postgres()
    if server is None:
        print(f"postgresql skipped: {why_not}")
        return
    try:
        pg_rates = []
        for _ in range(args.repeat):
            url = server.create_database(f"b_{uuid.uuid4().hex[:10]}")
            raw = raw_postgres_rate(url, work)
            pg_rates.append(measure("postgresql", url, raw, work))
        print(f"postgresql median: {statistics.median(pg_rates):,.0f} lines/s")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
