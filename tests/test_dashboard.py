"""The fleet dashboard (`/dashboard`, `/dashboard/data`): its window arithmetic, its snapshot
on a real cluster, and the page itself in headless Chromium while load runs.

The browser is Debian's `chromium` driven by Playwright with `executable_path` (never
`playwright install`, which downloads a browser build); without either, the browser test
skips and says why. With SHOAL_DASHBOARD_SCREENSHOT=<path>, the browser test also writes its
screenshot there (docs/img/dashboard.png was made this way).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Launcher, deploy_without_workers, wait_until

from shoal.broker.connection import connect
from shoal.broker.embedded import EmbeddedNats
from shoal.gateway.dashboard import (
    GatewayFigures,
    WindowHistory,
    _ModelCounts,
    _Sample,
    _WorkerCounts,
    histogram_quantile,
)
from shoal.protocol import ModelSpec, Task
from shoal.state.workers import WorkerState, WorkerStatus, ensure_workers_kv, put_status

TOKEN = "dashboard-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODEL = "dash-embed"
BROKEN = "dash-broken"  # deployed, and one (injected) worker report says its load failed
CHROMIUM = os.environ.get("SHOAL_CHROMIUM", "/usr/bin/chromium")
INF = float("inf")


# -- the window arithmetic, without a cluster --------------------------------------------------


def test_histogram_quantile_interpolates_within_the_bucket_like_prometheus():
    bounds = (0.01, 0.1, 1.0, INF)
    # 10 observations up to 10 ms, 80 in (10 ms, 100 ms], 10 in (100 ms, 1 s].
    cumulative = (10, 90, 100, 100)
    assert histogram_quantile(0.5, bounds, cumulative) == pytest.approx(0.01 + 0.09 * 40 / 80)
    assert histogram_quantile(0.99, bounds, cumulative) == pytest.approx(0.1 + 0.9 * 9 / 10)
    assert histogram_quantile(0.05, bounds, cumulative) == pytest.approx(0.005)
    assert histogram_quantile(0.5, bounds, (0, 0, 0, 0)) is None
    # Everything past the last finite bound: the last finite bound, as Prometheus answers.
    assert histogram_quantile(0.99, bounds, (0, 0, 0, 5)) == 1.0


def _gateway_sample(at: float, fast: int, slow: int, errors: int) -> _Sample:
    """A sample where MODEL had `fast` requests under 10 ms, `slow` ones up to 1 s, and
    `errors` of the slow ones answered 429."""
    buckets = (float(fast), float(fast), float(fast + slow), float(fast + slow))
    statuses = {"200": fast + slow - errors, "429": errors} if errors else {"200": fast + slow}
    return _Sample(at, {MODEL: _ModelCounts(buckets, statuses)}, {})


def test_gateway_figures_are_over_the_window_not_since_the_start():
    bounds = (0.01, 0.1, 1.0, INF)
    history = WindowHistory(window_s=10.0)
    # 1000 fast requests long ago, then 100 slow ones in the last 10 s.
    history.add(_gateway_sample(0.0, 1000, 0, 0))
    history.add(_gateway_sample(50.0, 1000, 0, 0))
    history.add(_gateway_sample(60.0, 1000, 100, 4))
    figures = history.gateway_figures(MODEL, bounds)
    assert figures.requests == 1100 and figures.errors == 4
    assert figures.by_status == {"200": 1096, "429": 4}
    assert figures.requests_per_s == pytest.approx(10.0)
    assert figures.errors_per_s == pytest.approx(0.4)
    # Only the window's requests count: all slow, so p50 is in (100 ms, 1 s], not under 10 ms.
    assert 0.1 < figures.p50_s <= 1.0 and figures.p99_s <= 1.0
    assert len(history.samples) == 2  # the sample 60 s old was dropped
    assert history.gateway_figures("other", bounds) == GatewayFigures()


def test_worker_rates_follow_the_workers_report_times():
    history = WindowHistory(window_s=10.0)
    key = ("w1", MODEL)
    # Read at 0, 1 and 2 s by the gateway, but the worker wrote its reports 4 s apart:
    # 200 items in 4 s is 50 per second, in 20 batches of 10.
    for at, updated_ms, items, batches in ((0.0, 1000, 100, 10), (1.0, 1000, 100, 10)):
        history.add(_Sample(at, {}, {key: _WorkerCounts(updated_ms, items, batches, 0)}))
    assert history.worker_rates(key) == (None, None, None)  # one report, read twice
    history.add(_Sample(2.0, {}, {key: _WorkerCounts(5000, 300, 30, 0)}))
    items_per_s, per_batch, _ = history.worker_rates(key)
    assert items_per_s == pytest.approx(50.0) and per_batch == pytest.approx(10.0)
    # A restarted worker's counters start again: no negative rate.
    history.add(_Sample(3.0, {}, {key: _WorkerCounts(6000, 5, 1, 0)}))
    assert history.worker_rates(key) == (None, None, None)


# -- on a cluster -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("dashboard")
    nats = EmbeddedNats(store_dir=tmp / "nats")
    nats.start()
    launcher = Launcher(tmp, env={"SHOAL_ADMIN_TOKEN": TOKEN})
    try:
        deploy_without_workers(
            nats.url, ModelSpec(name=BROKEN, runtime="sim", task=Task.EMBEDDINGS)
        )
        _, url = launcher.gateway(nats.url, ready=False)
        launcher.worker(
            nats.url, MODEL, "--runtime", "sim", "--option", "batch_ms=4", "--max-batch-items", "16"
        )
        yield nats.url, url
    finally:
        launcher.stop_all()
        nats.stop()


def report_failed_load(nats_url: str) -> None:
    """A worker's report that BROKEN failed to load (as a worker writes it; it expires in
    15 s like any report): the dashboard must show it as a load failure."""
    status = WorkerStatus(
        worker_id="w-broken",
        model=BROKEN,
        runtime="sim",
        simulated=True,
        pid=1,
        state=WorkerState.FAILED,
        pinned=False,
        updated_ms=int(time.time() * 1000),
        error="out of memory while loading",
    )

    async def put() -> None:
        nc = await connect(nats_url, name="test")
        try:
            await put_status(await ensure_workers_kv(nc.jetstream()), status)
        finally:
            await nc.close()

    # In a thread of its own: Playwright's sync API keeps an event loop running in this one.
    thread = threading.Thread(target=asyncio.run, args=(put(),))
    thread.start()
    thread.join()


class Load:
    """Embedding requests from a few threads until stopped; a few of them malformed, so the
    error figures have something to count."""

    def __init__(self, url: str, threads: int = 3) -> None:
        self.url = url
        self.ok = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _run(self, index: int) -> None:
        with httpx.Client(timeout=30) as client:
            sent = 0
            while not self._stop.is_set():
                sent += 1
                body = {"model": MODEL, "input": [f"text {index} {sent}"] * 4}
                if index == 0 and sent % 50 == 0:
                    body["input"] = 5  # the worker answers 400
                response = client.post(f"{self.url}/v1/embeddings", json=body)
                self.ok += response.status_code == 200


def data(url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(
        f"{url}/dashboard/data", headers=AUTH if headers is None else headers, timeout=10
    )


def test_the_snapshot_needs_the_admin_token_and_the_page_does_not(cluster):
    _, url = cluster
    assert data(url, {}).status_code == 401
    assert data(url, {"Authorization": "Bearer wrong"}).status_code == 401
    page = httpx.get(f"{url}/dashboard", timeout=10)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    # Only the page's own inline script may run, and it may only talk to this gateway.
    policy = page.headers["content-security-policy"]
    assert "script-src 'sha256-" in policy and "connect-src 'self'" in policy
    assert "unsafe-inline" not in policy
    # Read-only: nothing but GET.
    assert httpx.post(f"{url}/dashboard/data", headers=AUTH, timeout=10).status_code == 405


def test_the_snapshot_counts_the_load(cluster):
    nats_url, url = cluster
    report_failed_load(nats_url)
    before = data(url).json()
    model = next(m for m in before["models"] if m["name"] == MODEL)
    assert model["runtime"] == "sim" and model["simulated"] and model["task"] == "embeddings"
    assert [w["state"] for w in model["workers"]] == ["ready"]
    assert model["max_batch_items"] == 16
    broken = next(m for m in before["models"] if m["name"] == BROKEN)
    assert broken["load_failures"] == [
        {"worker_id": "w-broken", "error": "out of memory while loading"}
    ]
    assert broken["workers_ready"] == 0 and broken["workers_failed"] == 1

    with Load(url) as load:
        wait_until(lambda: load.ok >= 200, 60)
        # Worker reports come once a second: the rate shows within a couple of them.
        after = wait_until(
            lambda: (
                (m := _model(data(url).json(), MODEL))["items_per_s"]
                and m["gateway"]["p99_s"]
                and m
            ),
            15,
        )
    assert after["items_done"] > model["items_done"]
    assert after["items_per_s"] > 0 and after["gateway"]["requests_per_s"] > 0
    assert 0 < after["gateway"]["p50_s"] <= after["gateway"]["p99_s"] < 30
    assert after["mean_batch"] is None or 1 <= after["mean_batch"] <= 16
    # Counted when answered, and 200 had been answered before this snapshot was asked for.
    assert after["gateway"]["requests"] >= 200
    assert after["workers"][0]["items_done"] == after["items_done"]


def _model(snapshot: dict, name: str) -> dict:
    return next(m for m in snapshot["models"] if m["name"] == name)


# -- in the browser ---------------------------------------------------------------------------


def _chromium_or_skip() -> None:
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        pytest.skip(
            f"no Chromium at {CHROMIUM}: `apt-get install chromium` (Debian), or set "
            "SHOAL_CHROMIUM to a Chromium binary"
        )
    pytest.importorskip(
        "playwright.sync_api", reason="the Python package playwright (the test extra) is missing"
    )


def _number(text: str) -> float:
    match = re.search(r"[\d,]+(?:\.\d+)?", text)
    assert match, f"no number in {text!r}"
    return float(match.group().replace(",", ""))


def test_the_page_shows_the_fleet_and_its_numbers_move_under_load(cluster, tmp_path):
    _chromium_or_skip()
    from playwright.sync_api import Page, expect, sync_playwright

    nats_url, url = cluster
    report_failed_load(nats_url)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        try:
            errors: list[str] = []

            def watch(page: Page) -> None:
                """Collect script errors and Content-Security-Policy violations; not the
                expected 401 before the token is given ("Failed to load resource")."""
                page.on("pageerror", lambda err: errors.append(str(err)))
                page.on(
                    "console",
                    lambda m: (
                        m.type == "error"
                        and not m.text.startswith("Failed to load resource")
                        and errors.append(m.text)
                    ),
                )

            page = browser.new_page(viewport={"width": 1280, "height": 900})
            watch(page)

            # Without the token, the page asks for it; given in the form, the fleet shows.
            page.goto(f"{url}/dashboard")
            form = page.locator("#token-form")
            expect(form).to_be_visible()
            page.fill("#token-input", TOKEN)
            page.click("#token-form button")
            card = page.locator(f'section[data-model="{MODEL}"]')
            expect(card).to_be_visible(timeout=10_000)

            # Given in the URL fragment, it is taken and cleared from the address bar.
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            watch(page)
            page.goto(f"{url}/dashboard#token={TOKEN}")
            card = page.locator(f'section[data-model="{MODEL}"]')
            expect(card).to_be_visible(timeout=10_000)
            assert "#" not in page.url
            expect(page.locator("#status")).to_have_text(re.compile("^live"))
            worker = card.locator("tr[data-worker]")
            expect(worker).to_have_count(1)
            expect(worker.locator('[data-field="state"]')).to_have_text("ready")
            worker_id = worker.get_attribute("data-worker")
            assert (
                worker_id and worker_id in worker.locator('[data-field="worker_id"]').inner_text()
            )
            expect(card.locator("h2")).to_have_text(MODEL)
            expect(card.locator(".badge.sim")).to_have_text("simulated")
            broken = page.locator(f'section[data-model="{BROKEN}"]')
            expect(broken.locator(".failures")).to_contain_text("out of memory while loading")

            answered = card.locator('[data-stat="items_done"] .v')
            start = _number(answered.inner_text())
            with Load(url):
                # The answered count and the rate move while the load runs.
                wait_until(lambda: _number(answered.inner_text()) > start + 100, 60)
                rate = card.locator('[data-stat="items_per_s"] .v')
                wait_until(lambda: rate.inner_text() not in ("\u2013", "0"), 15)
                latency = card.locator('[data-stat="latency"] .v')
                wait_until(lambda: "ms" in latency.inner_text(), 15)
                time.sleep(12)  # some seconds of plot history for the screenshot
                report_failed_load(nats_url)  # still fresh in the picture
                time.sleep(1.5)
                shot = page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
                assert _number(answered.inner_text()) > start + 100
            assert card.locator("svg path").count() >= 5  # plots drawn (p50 and p99 share one)
            assert not errors, errors
        finally:
            browser.close()
    target = os.environ.get("SHOAL_DASHBOARD_SCREENSHOT")
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_bytes(shot)
