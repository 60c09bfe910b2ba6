"""The dashboard in headless Chromium (Playwright driving Debian's chromium) against a real
controller over TLS, real agents and real torchrun: a page without credentials is refused, a
job submitted through the API appears, its logs stream live with the rank filter working,
Cancel stops it, and the log view stays responsive over 1,000 ranks and 1,000,000 lines.
Screenshots of each page go to outputs/dashboard/ (printed; ignored by git)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from muster.cli.local import LocalCluster
from muster.spec import parse_job
from muster.store import open_store
from tests.e2e.helpers import submit, wait_state, write_job

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "outputs" / "dashboard"
REQUIRED = os.environ.get("MUSTER_TEST_REQUIRE_BROWSER") == "1"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.timeout(600)

TICKING = """
import os, sys, time
rank = int(os.environ["RANK"])
for i in range(100000):
    print(f"rank {rank} tick {i}", flush=True)
    time.sleep(0.2)
"""


def _browser_or_skip() -> tuple[Any, str]:
    why = ""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        why = "the playwright package is not installed (pip install -e '.[test]')"
    if not why and CHROMIUM is None:
        why = "no chromium on PATH (Debian: apt-get install chromium; .ci/run does)"
    if why:
        if REQUIRED:
            pytest.fail(f"MUSTER_TEST_REQUIRE_BROWSER=1 but {why}")
        pytest.skip(why)
    return sync_playwright, str(CHROMIUM)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_playwright, chromium = _browser_or_skip()
    with sync_playwright() as pw:
        # Flags for a closed network and a root user (see the env notes): no sandbox, no
        # background fetches that this machine refuses.
        b = pw.chromium.launch(
            executable_path=chromium,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        yield b
        b.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(agents=2, tls=True) as c:
        yield c


def shot(page: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")


def signed_in(browser: Any, cluster: LocalCluster) -> Any:
    context = browser.new_context(ignore_https_errors=True, viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(20_000)
    page.goto(f"{cluster.url}/ui/jobs")
    page.fill("#token", cluster.token())
    page.click("button[type=submit]")
    page.wait_for_url("**/ui/jobs")
    (cookie,) = context.cookies()
    assert cookie["name"].startswith("muster_session_")
    assert cookie["secure"], "over TLS the session cookie is Secure"
    assert cookie["httpOnly"], "no script reads it"
    return page


def visible_lines(page: Any) -> list[str]:
    return list(
        page.eval_on_selector_all("#logview .rows .ln", "rows => rows.map(r => r.textContent)")
    )


def waiting_job_with_lines(
    cluster: LocalCluster, name: str, *, nodes: int, procs: int, ranks: int, lines: int
) -> str:
    """A job of more nodes than the cluster has (it stays queued, the view following it)
    with ``lines`` log lines ("rank R line S", round robin over ``ranks``) written straight
    into the controller's SQLite file in one statement (the ingest path is measured in
    bench/logs.py; a million lines through it would take most of a minute here)."""
    assert cluster.data_dir is not None
    spec = parse_job(
        {
            "name": name,
            "entrypoint": "train.py",
            "distributed": {"num_workers": nodes, "procs_per_worker": procs, "backend": "gloo"},
        }
    )
    store = open_store(str(cluster.data_dir / "muster.db"))
    try:
        job = str(store.submit_job(spec).id)
        with store.db.engine.begin() as conn:
            conn.exec_driver_sql(
                "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
                "INSERT INTO log_lines (job_id, origin, rank, seq, time_us, stream, text, raw, "
                "ingest_id) SELECT ?, 'rank', i % ?, i / ? + 1, ?, 'stdout', "
                "'rank ' || (i % ?) || ' line ' || (i / ? + 1), NULL, i + 1 FROM n",
                (lines - 1, job, ranks, ranks, int(time.time() * 1e6), ranks, ranks),
            )
    finally:
        store.db.dispose()
    return job


def test_a_page_without_credentials_is_refused(browser: Any, cluster: LocalCluster) -> None:
    context = browser.new_context(ignore_https_errors=True)
    page = context.new_page()
    page.goto(f"{cluster.url}/ui/workers")
    assert "/ui/login" in page.url
    assert page.locator("#workers").count() == 0
    page.fill("#token", "not-the-token")
    page.click("button[type=submit]")
    assert "not this controller's API token" in page.inner_text("#login-error")
    shot(page, "login-refused")
    answer = page.request.get(f"{cluster.url}/ui/jobs/rows")
    assert answer.status == 401
    page.fill("#token", cluster.token())
    page.click("button[type=submit]")
    page.wait_for_url("**/ui/workers")
    page.wait_for_selector("tr.worker")
    assert page.locator("tr.worker").count() == 2
    assert "connected" in page.inner_text("#workers")
    shot(page, "workers")
    context.close()


def test_a_job_appears_its_logs_stream_filter_by_rank_and_cancel_stops_it(
    browser: Any, cluster: LocalCluster, tmp_path: Path
) -> None:
    page = signed_in(browser, cluster)
    api = cluster.client()
    # LOGLEVEL=INFO: torchrun says what it starts, so each node has launcher lines to show.
    ticking = write_job(
        tmp_path / "tick", "ticking", TICKING, timeout="10m", env={"LOGLEVEL": "INFO"}
    )
    job = submit(api, ticking)
    # It appears on the list without a reload (the rows refresh themselves).
    page.wait_for_selector(f'tr.job[data-job="{job}"]')
    wait_state(api, job, {"running"}, timeout=120)
    page.wait_for_selector(f'tr.job[data-job="{job}"][data-state="running"]')
    shot(page, "jobs")

    page.click(f'tr.job[data-job="{job}"] a')
    page.wait_for_url(f"**/ui/jobs/{job}")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#logview .ln')]"
        ".some(r => r.textContent.startsWith('[rank 3] rank 3 tick'))"
    )
    members = page.inner_text("#members")
    assert "node0" in members
    assert "node1" in members
    assert "0-1" in members
    assert "2-3" in members
    # Live: a later tick arrives without a reload.
    ticks = _last_tick(visible_lines(page), 3)
    page.wait_for_function(
        f"() => [...document.querySelectorAll('#logview .ln')]"
        f".some(r => r.textContent.startsWith('[rank 3] rank 3 tick {ticks + 3}'))"
    )
    shot(page, "job-logs")

    # The rank filter: only rank 2's lines, still following.
    page.fill("#log-ranks", "2")
    page.click("#log-filters button[type=submit]")
    page.wait_for_function(
        "() => { const r = [...document.querySelectorAll('#logview .ln')];"
        " return r.length > 0 && r.every(x => x.textContent.startsWith('[rank 2] ')); }"
    )
    before = _last_tick(visible_lines(page), 2)
    page.wait_for_function(
        f"() => [...document.querySelectorAll('#logview .ln')]"
        f".some(r => r.textContent.startsWith('[rank 2] rank 2 tick {before + 2}'))"
    )
    assert all(line.startswith("[rank 2] ") for line in visible_lines(page))
    shot(page, "job-logs-rank2")
    # torchrun's own lines of node 1.
    page.fill("#log-ranks", "")
    page.fill("#log-node", "1")
    page.select_option("#log-origin", "node")
    page.click("#log-filters button[type=submit]")
    page.wait_for_function(
        "() => { const r = [...document.querySelectorAll('#logview .ln')];"
        " return r.length > 0 && r.every(x => x.textContent.startsWith('[node 1 torchrun] ')); }"
    )

    # Cancel stops it.
    page.on("dialog", lambda dialog: dialog.accept())
    page.click("#cancel")
    page.wait_for_function(
        "() => document.querySelector('#job-state').textContent.trim() === 'cancelled'",
        timeout=60_000,
    )
    final = wait_state(api, job, timeout=60)
    assert final["state"] == "cancelled"
    assert page.locator("#cancel").count() == 0, "no Cancel on an ended job"
    shot(page, "job-cancelled")
    page.context.close()


def test_a_join_window_shows_its_roster_and_starts_from_the_page(
    browser: Any, cluster: LocalCluster, tmp_path: Path
) -> None:
    from tests.e2e.test_window import wait_window, walk_in, window_job

    api = cluster.client()
    job = submit(api, window_job(tmp_path, "manual", {"start": "manual", "quorum": 1}, hosts=1))
    page = signed_in(browser, cluster)
    page.goto(f"{cluster.url}/ui/jobs/{job}")
    page.wait_for_selector("#window-phase")
    assert page.inner_text("#window-phase") == "waiting"
    assert page.locator("#start").count() == 0, "no Start before the quorum is in"
    box = walk_in(cluster, job, "box-a")
    try:
        wait_window(api, job, "staging", ranks=1)
        page.wait_for_selector("#start")  # the page refreshes itself
        assert "box-a" in page.inner_text("#job-detail")
        assert page.inner_text("#window-phase") == "staging"
        shot(page, "job-window")
        page.click("#start")
        page.wait_for_function(
            "() => document.querySelector('#job-state').textContent.trim() === 'succeeded'",
            timeout=120_000,
        )
        assert box.wait(60) == 0
    finally:
        if box.poll() is None:
            box.kill()
    page.wait_for_function(
        "() => [...document.querySelectorAll('#logview .ln')]"
        ".some(r => r.textContent === '[rank 0] rank 0 of 1 sum=1')"
    )
    page.context.close()


def _last_tick(lines: list[str], rank: int) -> int:
    prefix = f"[rank {rank}] rank {rank} tick "
    ticks = [int(line[len(prefix) :]) for line in lines if line.startswith(prefix)]
    assert ticks, lines[-5:]
    return max(ticks)


def test_the_log_view_stays_responsive_with_1000_ranks_and_a_million_lines(
    browser: Any, cluster: LocalCluster
) -> None:
    """A million lines from 1,000 ranks: the newest show at once, only the rows on screen are
    in the page, older pages load on scroll, and a rank filter answers from the server."""
    # 250 nodes: it waits for workers that never come.
    job = waiting_job_with_lines(cluster, "big", nodes=250, procs=4, ranks=1000, lines=1_000_000)
    page = signed_in(browser, cluster)
    started = time.monotonic()
    page.goto(f"{cluster.url}/ui/jobs/{job}")
    page.wait_for_function("() => document.querySelectorAll('#logview .ln').length > 0")
    first_paint = time.monotonic() - started
    assert first_paint < 10, f"the first lines took {first_paint:.1f}s"
    rows = page.locator("#logview .ln").count()
    assert 0 < rows < 200, f"{rows} rows in the page: the list is not virtualised"
    assert "rank 999 line 1000" in "\n".join(visible_lines(page)), "the tail comes first"
    shot(page, "job-million-lines")

    # Scrolling to the top loads the page before, and keeps the reader's place.
    held = page.evaluate("() => window.musterLogs.lines.length")
    page.evaluate("() => { document.getElementById('logview').scrollTop = 0; }")
    page.wait_for_function(f"() => window.musterLogs.lines.length > {held}")
    # The reader's place is kept: the lines that were at the top are still there, the older
    # page above them.
    top = page.evaluate("() => document.getElementById('logview').scrollTop")
    assert top >= (page.evaluate("() => window.musterLogs.lines.length") - held) * 18 - 18 * 12
    assert page.locator("#logview .ln").count() < 200
    assert not page.is_checked("#log-follow"), "reading back pauses following"

    started = time.monotonic()
    page.fill("#log-ranks", "7")
    page.click("#log-filters button[type=submit]")
    page.wait_for_function(
        "() => { const r = [...document.querySelectorAll('#logview .ln')];"
        " return r.length > 0 && r.every(x => x.textContent.startsWith('[rank 7] ')); }"
    )
    filtered = time.monotonic() - started
    assert filtered < 10, f"the rank filter took {filtered:.1f}s"
    assert "[rank 7] rank 7 line 1000" in visible_lines(page)
    page.context.close()


# Every follow poll (a fetch with after=) is held 1.5 s in the page, and counted while out.
SLOW_POLLS = """
(() => {
  const real = window.fetch.bind(window);
  window.pollsOut = 0;
  window.fetch = async (url, opts) => {
    if (!String(url).includes("after=")) return real(url, opts);
    window.pollsOut += 1;
    try {
      await new Promise((r) => setTimeout(r, 1500));
      return await real(url, opts);
    } finally { window.pollsOut -= 1; }
  };
})();
"""


def test_scrolling_to_the_top_while_a_poll_is_out_still_loads_the_older_page(
    browser: Any, cluster: LocalCluster
) -> None:
    """The reader reaches the top while a follow poll is on its way (on a slow controller,
    most of the time): the older page still comes once the poll is back, and following stops."""
    # 50 nodes: it waits, so the view keeps following.
    job = waiting_job_with_lines(cluster, "slowpoll", nodes=50, procs=1, ranks=1, lines=5000)
    page = signed_in(browser, cluster)
    page.add_init_script(SLOW_POLLS)
    page.goto(f"{cluster.url}/ui/jobs/{job}")
    page.wait_for_function("() => document.querySelectorAll('#logview .ln').length > 0")
    assert "[rank 0] rank 0 line 5000" in visible_lines(page)
    assert page.is_checked("#log-follow")
    held = page.evaluate("() => window.musterLogs.lines.length")
    assert held == 2000, held
    page.wait_for_function("() => window.pollsOut > 0")
    page.evaluate("() => { document.getElementById('logview').scrollTop = 0; }")
    page.wait_for_function(f"() => window.musterLogs.lines.length > {held}")
    assert not page.is_checked("#log-follow"), "reading back pauses following"
    assert "[rank 0] rank 0 line 3000" in visible_lines(page), "the reader's place is kept"
    page.context.close()
