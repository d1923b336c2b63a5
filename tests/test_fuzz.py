"""The short fuzz run: hypothesis-generated requests on every route of a real cluster.

A real nats-server (the session's), a gateway with the admin API on and two sim workers
(bench/fuzz.py's models). About a minute of requests; then no 5xx, every 4xx in the error
shape, no traceback in any of these processes' logs, all alive, and normal requests still
answered correctly. `python -m bench.fuzz --minutes N` is the long form.
"""

from __future__ import annotations

import time

import pytest
from conftest import Launcher

from bench.fuzz import (
    ADMIN_TOKEN,
    WORKER_ARGS,
    FuzzReport,
    normal_request_works,
    probe,
)

EXAMPLES = 600  # about a minute here (2 shared cores)


@pytest.fixture(scope="module")
def fuzz_cluster(nats_server, tmp_path_factory):
    launcher = Launcher(tmp_path_factory.mktemp("fuzz"), env={"SHOAL_ADMIN_TOKEN": ADMIN_TOKEN})
    try:
        gateway, url = launcher.gateway(nats_server.url)
        workers = [
            launcher.worker(nats_server.url, model, *args) for model, args in WORKER_ARGS.items()
        ]
        yield url, [gateway, *workers]
    finally:
        launcher.stop_all()


def test_fuzzed_requests_get_no_5xx_and_break_nothing(fuzz_cluster):
    url, processes = fuzz_cluster
    report = FuzzReport()
    started = time.monotonic()
    probe(url, EXAMPLES, report)
    elapsed = time.monotonic() - started
    summary = report.summary()
    assert report.requests >= EXAMPLES, summary
    # The generator reaches past validation: some requests are served, most are refused.
    assert summary["by_class"].get("2xx", 0) > 0 and summary["by_class"].get("4xx", 0) > 0
    assert not report.failures, summary
    assert normal_request_works(url)
    for process in processes:
        assert process.process.poll() is None, process.log()
        assert "Traceback" not in process.log(), process.log()
    print(f"fuzz: {report.requests} requests in {elapsed:.1f} s, {summary['by_class']}")
