"""The adaptive batch wait: the policy on its own, and a simulated worker that uses it.

The device is the SIMULATED accelerator (runtime `sim`): in the cluster test 200 ms per batch,
nothing per token, so a batch's fixed cost dominates as on a GPU.
"""

from __future__ import annotations

import math
import random
import threading
import time

import httpx
import pytest
from conftest import wait_until, worker_status

from shoal.worker.batch_wait import (
    WINDOW,
    CostCurve,
    CostFit,
    LoadMeter,
    items_share,
    knee_items,
    plan_wait,
)


def test_knee_of_a_fixed_cost_curve():
    fit = CostFit(fixed_s=0.100, per_item_s=0.0017)
    # Per item: 0.1 / n + 0.0017 within 10% of a 32-batch's (0.00483) from n = 28 on.
    assert knee_items(fit, 32) == 28
    plan = plan_wait(fit, held=3, budget=32, latency_target_s=1.0)
    assert plan.target_items == 28
    assert plan.max_wait_s == pytest.approx(0.100)  # at most one fixed cost


def test_never_waits_when_waiting_cannot_pay():
    fit = CostFit(fixed_s=0.100, per_item_s=0.0017)
    assert plan_wait(fit, held=28, budget=32, latency_target_s=1.0).max_wait_s == 0
    assert plan_wait(fit, held=32, budget=32, latency_target_s=1.0).max_wait_s == 0
    no_fixed_cost = CostFit(fixed_s=0.0, per_item_s=0.004)
    assert plan_wait(no_fixed_cost, held=1, budget=64, latency_target_s=1.0).max_wait_s == 0
    assert plan_wait(None, held=1, budget=64, latency_target_s=1.0).max_wait_s == 0


def test_wait_stays_within_the_latency_target():
    fit = CostFit(fixed_s=0.5, per_item_s=0.01)
    knee = knee_items(fit, 64)
    assert fit.seconds(knee) == pytest.approx(1.03)
    for target, wait in ((2.0, 0.5), (1.2, 0.17), (1.0, 0.0)):
        plan = plan_wait(fit, held=1, budget=64, latency_target_s=target)
        assert plan.max_wait_s == pytest.approx(wait)
        # A wait never pushes the end of the batch it waits for past the target.
        assert (
            plan.max_wait_s == 0
            or plan.max_wait_s + fit.seconds(plan.target_items) <= target + 1e-9
        )


def test_waits_for_the_knee_only_while_the_items_take_at_most_half_the_device():
    # all-MiniLM-L6-v2 on torch, 2 CPU threads, as fitted in service at half load (9 ms a
    # batch, 1.75 ms an item; budget 128; the load meter read 0.65-0.69 there): the items
    # take ~0.67 of the device, so it waits only while the batch held is fixed-cost
    # dominated (below fixed / per_item, 5.03), for 6 at most, not for the knee of 36.
    cpu = CostFit(fixed_s=0.0088, per_item_s=0.00175)
    assert knee_items(cpu, 128) == 36
    assert items_share(cpu, 128, 0.7) == pytest.approx(0.673, abs=1e-3)
    for held in (6, 8, 20):
        assert plan_wait(cpu, held, budget=128, latency_target_s=1.0, load=0.7).max_wait_s == 0
    lone = plan_wait(cpu, held=1, budget=128, latency_target_s=1.0, load=0.7)
    assert lone.target_items == 6
    assert lone.max_wait_s == pytest.approx(0.0088 * 0.3**0.5)
    # The same curve at a third of that rate leaves the device mostly to the fixed cost.
    assert plan_wait(cpu, held=8, budget=128, latency_target_s=1.0, load=0.3).target_items == 36
    # The GPU-like hot-path device (1 ms + 34 us an item, budget 256) under a closed loop of
    # many connections: it holds 105, well past fixed / per_item (29), yet the items take
    # only ~0.36 of its time, so it still waits for the knee (stopping at 30 cost 5-9% of
    # the hot path's throughput).
    hot = CostFit(fixed_s=0.001, per_item_s=0.000034)
    assert items_share(hot, 256, 0.4) == pytest.approx(0.36, abs=0.01)
    plan = plan_wait(hot, held=105, budget=256, latency_target_s=1.0, load=0.4)
    assert plan.target_items == knee_items(hot, 256) > 105 and plan.max_wait_s > 0
    # The simulated 100 ms device (~1.9 ms an item, budget 32): waits for the knee.
    gpu = CostFit(fixed_s=0.100, per_item_s=0.0019)
    assert knee_items(gpu, 32) == 28
    for held in (1, 12, 27):
        plan = plan_wait(gpu, held, budget=32, latency_target_s=1.0, load=0.5)
        assert plan.target_items == 28
        assert plan.max_wait_s == pytest.approx(0.100 * 0.5**0.5)
    assert plan_wait(gpu, held=28, budget=32, latency_target_s=1.0, load=0.5).max_wait_s == 0


def test_curve_is_fitted_from_measured_batches():
    curve = CostCurve()
    assert curve.fit() is None
    for n in (1, 2, 4, 8, 16, 32, 3, 5, 7, 9):
        curve.observe(n, 0.1 + 0.002 * n)
    fit = curve.fit()
    assert fit is not None
    assert fit.fixed_s == pytest.approx(0.1, abs=1e-6)
    assert fit.per_item_s == pytest.approx(0.002, abs=1e-6)
    same_size = CostCurve()
    for _ in range(10):
        same_size.observe(4, 0.11)
    assert same_size.fit() is None  # one size cannot tell fixed from per-item cost
    seeded = CostCurve({1: 0.101, 8: 0.108, 64: 0.164})  # a profile's points
    assert seeded.fit() is not None


def test_batches_all_of_one_size_do_not_bend_the_profiled_curve():
    # A closed loop of 64 clients against a budget of 128 runs batch after batch of 64. The
    # window fills with them; the profile's sizes keep the line's slope, and the batches
    # in service (10% slower than profiled: they also decode and encode) set its level.
    truth = CostFit(fixed_s=0.012, per_item_s=0.0015)
    profile = {n: truth.seconds(n) for n in (1, 2, 4, 8, 16, 32, 64, 128)}
    curve = CostCurve(profile)
    noise = random.Random(7)
    for _ in range(3 * WINDOW):
        curve.observe(64, 1.1 * truth.seconds(64) * noise.uniform(0.9, 1.1))
    fit = curve.fit()
    assert fit is not None
    assert fit.per_item_s == pytest.approx(truth.per_item_s, rel=0.25)
    assert fit.fixed_s == pytest.approx(truth.fixed_s, rel=0.6)
    assert fit.seconds(64) == pytest.approx(1.1 * truth.seconds(64), rel=0.05)
    # Without a profile one size cannot tell fixed from per-item cost: no curve, no wait.
    alone = CostCurve()
    for _ in range(WINDOW):
        alone.observe(64, truth.seconds(64))
    assert alone.fit() is None


def test_a_curve_that_bends_up_still_predicts_the_batches_that_run():
    # all-MiniLM-L6-v2 on a 2-core CPU, as profiled (docs/benchmarks.md): bigger batches cost
    # more an item, so the least-squares line meets zero items below zero. A closed loop of
    # 64 clients then runs batches of ~32 at ~125 ms. The late pull asks for the next batch
    # from the prediction: it must not lie far above them (the clamped line said 164 ms).
    profile = {
        1: 0.02352, 2: 0.02803, 4: 0.03506, 8: 0.04848, 16: 0.07381,
        32: 0.14392, 64: 0.26729, 128: 0.61081, 256: 1.31245,
    }  # fmt: skip
    curve = CostCurve(profile)
    for i in range(WINDOW):
        curve.observe(31 + i % 2, 0.125)
    fit = curve.fit()
    assert fit is not None
    assert fit.fixed_s == 0.0  # no batch costs less than nothing, so no wait pays
    assert fit.seconds(32) == pytest.approx(0.125, rel=0.1)
    assert plan_wait(fit, held=16, budget=64, latency_target_s=0.5).max_wait_s == 0.0


def test_a_new_profile_replaces_the_old_one_in_the_curve():
    slow = CostFit(fixed_s=0.100, per_item_s=0.004)
    fast = CostFit(fixed_s=0.010, per_item_s=0.001)
    curve = CostCurve({n: slow.seconds(n) for n in (1, 8, 64)})
    curve.use_profile({n: fast.seconds(n) for n in (1, 8, 64)})
    fit = curve.fit()
    assert fit is not None
    assert fit.fixed_s == pytest.approx(fast.fixed_s)
    assert fit.per_item_s == pytest.approx(fast.per_item_s)


def _batches_for_two_requests(
    gateway_url: str, nats_url: str, model: str, pid: int, done: int
) -> int:
    """Batches the worker ran for two requests, the second sent 30 ms after the first.

    `done`: items the worker answered before (its status is written once a second).
    """
    before = wait_until(
        lambda: (s := worker_status(nats_url, pid)) and s.items_done >= done and s, 10
    ).batches
    body = {"model": model, "input": "one"}
    results: list[int] = []

    def send(text: str) -> None:
        answer = httpx.post(
            f"{gateway_url}/v1/embeddings", json={**body, "input": text}, timeout=30
        )
        results.append(answer.status_code)

    first = threading.Thread(target=send, args=("first",))
    first.start()
    time.sleep(0.03)  # the second arrives while an eager worker already runs the first
    send("second")
    first.join()
    assert results == [200, 200]
    return wait_until(
        lambda: (
            (s := worker_status(nats_url, pid)) and s.items_done >= done + 2 and s.batches - before
        ),
        10,
    )


def test_a_worker_waits_for_a_fuller_batch_within_its_bound(
    nats_server, session_launcher, gateway_url
):
    sim = ["--runtime", "sim", "--option", "batch_ms=200", "--option", "token_us=0"]
    adaptive = session_launcher.worker(nats_server.url, "sim-wait-adaptive", *sim)  # profiled
    eager = session_launcher.worker(
        nats_server.url, "sim-wait-eager", *sim, "--max-batch-items", "32", "--batch-wait", "off"
    )
    # Warm up: the eager worker runs them one by one, the adaptive one learns its curve.
    for model in ("sim-wait-adaptive", "sim-wait-eager"):
        for text in ("warm", "up"):
            httpx.post(
                f"{gateway_url}/v1/embeddings", json={"model": model, "input": text}, timeout=30
            )
    assert (
        _batches_for_two_requests(gateway_url, nats_server.url, "sim-wait-eager", eager.pid, 2) == 2
    )
    assert (
        _batches_for_two_requests(
            gateway_url, nats_server.url, "sim-wait-adaptive", adaptive.pid, 2
        )
        == 1
    )
    # A lone request waits at most one fixed cost (200 ms) before its 200 ms batch.
    began = time.perf_counter()
    answer = httpx.post(
        f"{gateway_url}/v1/embeddings",
        json={"model": "sim-wait-adaptive", "input": "alone"},
        timeout=30,
    )
    assert answer.status_code == 200
    assert time.perf_counter() - began < 0.4 + 0.3  # wait + batch + the path, loosely
    metrics = httpx.get(worker_status(nats_server.url, adaptive.pid).metrics_url).text
    waited = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("shoal_worker_batch_wait_seconds_")
        and 'model="sim-wait-adaptive"' in line
    }
    count = next(
        v for k, v in waited.items() if k.startswith("shoal_worker_batch_wait_seconds_count")
    )
    total = next(
        v for k, v in waited.items() if k.startswith("shoal_worker_batch_wait_seconds_sum")
    )
    assert count >= 1 and total / count <= 0.2 + 0.02


def test_the_wait_shrinks_as_the_load_nears_capacity():
    fit = CostFit(fixed_s=0.100, per_item_s=0.0017)
    idle = plan_wait(fit, held=3, budget=32, latency_target_s=1.0, load=0.0)
    half = plan_wait(fit, held=3, budget=32, latency_target_s=1.0, load=0.5)
    busy = plan_wait(fit, held=3, budget=32, latency_target_s=1.0, load=0.9)
    full = plan_wait(fit, held=3, budget=32, latency_target_s=1.0, load=1.0)
    assert idle.max_wait_s == pytest.approx(0.100)
    assert half.max_wait_s == pytest.approx(0.100 * 0.5**0.5)
    assert busy.max_wait_s == pytest.approx(0.100 * 0.1**0.5)
    assert full.max_wait_s == 0
    assert idle.target_items == half.target_items == busy.target_items == 28


def test_load_is_the_items_run_lately_against_full_batches_back_to_back():
    fit = CostFit(fixed_s=0.100, per_item_s=0.0017)  # a full batch of 32: 0.1544 s
    capacity = 32 / fit.seconds(32)  # ~207 items/s
    meter = LoadMeter(time_constant_s=2.0)
    assert meter.load(fit, 32, now=0.0) == 0.0  # nothing run yet
    for i in range(1, 301):  # a batch of 10 items ending every 0.1 s for 30 s: 100 items/s
        meter.observe(10, ended_at=i * 0.1)
    assert meter.items_per_s(now=30.0) == pytest.approx(100.0, rel=0.03)
    assert meter.load(fit, 32, now=30.0) == pytest.approx(100.0 / capacity, rel=0.03)
    # It follows a change within a few time constants: a quiet spell lowers it...
    assert meter.load(fit, 32, now=34.0) == pytest.approx(100.0 / capacity * math.exp(-2), rel=0.03)
    # ...and a flood (full batches back to back) raises it to capacity.
    for i in range(1, 61):
        meter.observe(32, ended_at=34.0 + i * fit.seconds(32))
    assert meter.load(fit, 32, now=34.0 + 60 * fit.seconds(32)) > 0.95
    assert meter.load(None, 32, now=50.0) == 0.0  # no curve yet: no effect on the wait
