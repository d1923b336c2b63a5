"""A batch profile that holds: medians over interleaved passes, and a profile that service
contradicts is measured again (issue 11 part 4)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
from conftest import worker_status

from shoal.broker.connection import connect
from shoal.runtimes.sim import SimEmbeddingRuntime
from shoal.state.profiles import (
    BatchProfile,
    claim_reprofile,
    decode_batch_profile,
    ensure_profiles_kv,
    store_profile,
)
from shoal.state.workers import WorkerState
from shoal.worker.profiling import AUDIT_BATCHES, ProfileAudit, profile_batches

LINEAR = {1: 0.010, 2: 0.012, 4: 0.016, 8: 0.024, 16: 0.040}


def test_audit_fires_once_when_service_is_much_faster_than_the_profile():
    audit = ProfileAudit(LINEAR)
    fired = [audit.observe(8, 0.4 * LINEAR[8]) for _ in range(3 * AUDIT_BATCHES)]
    assert fired.index(True) == AUDIT_BATCHES - 1  # as soon as the window is full
    assert fired.count(True) == 1


def test_audit_keeps_a_profile_that_service_agrees_with_or_runs_slower_than():
    for factor in (1.0, 0.8, 1.5, 3.0):
        audit = ProfileAudit(LINEAR)
        # Sizes between and beyond the profiled ones are interpolated and extended.
        sizes = [3, 6, 12, 16, 32]
        expected = {3: 0.014, 6: 0.020, 12: 0.032, 16: 0.040, 32: 0.072}
        assert all(abs(audit.expected_seconds(n) - expected[n]) < 1e-9 for n in sizes)
        results = [
            audit.observe(n, factor * expected[n]) for _ in range(AUDIT_BATCHES) for n in sizes
        ]
        assert not any(results), factor


def test_a_few_fast_batches_among_many_do_not_fire():
    audit = ProfileAudit(LINEAR)
    batches = [0.3 if i % 3 == 0 else 1.0 for i in range(4 * AUDIT_BATCHES)]
    assert not any(audit.observe(8, ratio * LINEAR[8]) for ratio in batches)


class BusyAtFirst(SimEmbeddingRuntime):
    """The simulated device, 3x slower for its first `busy_s` seconds: a machine still
    starting other processes while the first worker profiles."""

    def __init__(self, busy_s: float) -> None:
        super().__init__("busy", {"batch_ms": 20, "token_us": 0})
        self._busy_until = time.perf_counter() + busy_s

    def embed(self, texts, adapters=None):
        began = time.perf_counter()
        output = super().embed(texts, adapters)
        if began < self._busy_until:
            time.sleep(2 * (time.perf_counter() - began))
        return output


def _profile(runtime: SimEmbeddingRuntime):
    with ThreadPoolExecutor(1) as executor:
        return asyncio.run(profile_batches(runtime, 1.0, executor))


def test_a_busy_spell_during_the_first_pass_does_not_move_the_profile():
    quiet = _profile(BusyAtFirst(busy_s=0))
    # Busy for most of the first of the three passes (9 sizes, each >= 0.12 s while slowed).
    busy = _profile(BusyAtFirst(busy_s=1.0))
    assert busy.chosen == quiet.chosen == 256  # a flat 20 ms a batch: the largest size
    for size, seconds in busy.latency_s.items():
        assert seconds < 1.3 * quiet.latency_s[size], (size, seconds, quiet.latency_s[size])


def _profiles(nats_url: str, model: str) -> dict[str, BatchProfile]:
    async def read() -> dict[str, BatchProfile]:
        nc = await connect(nats_url, name="test")
        try:
            kv = await ensure_profiles_kv(nc.jetstream())
            found = {}
            for key in await kv.keys():
                entry = await kv.get(key)
                if entry.value:
                    profile = decode_batch_profile(entry.value)
                    if profile.model == model:
                        found[key] = profile
            return found
        finally:
            await nc.close()

    return asyncio.run(read())


def _store(nats_url: str, key: str, profile: BatchProfile) -> None:
    async def put() -> None:
        nc = await connect(nats_url, name="test")
        try:
            await store_profile(await ensure_profiles_kv(nc.jetstream()), key, profile)
        finally:
            await nc.close()

    asyncio.run(put())


def _timed_on_a_busy_machine(good: BatchProfile) -> BatchProfile:
    """What a profile timed on a busy machine looks like: every size 3x slower, a small
    budget."""
    slow = {size: 3 * seconds for size, seconds in good.latency_s.items()}
    return msgspec.structs.replace(
        good,
        max_batch_items=4,
        latency_s=slow,
        throughput={size: size / seconds for size, seconds in slow.items()},
        profiled_by="a busy machine",
    )


def _busy_profile_stored(nats_url: str, launcher, model: str, sim: list[str]):
    """Profile `model` with a first worker, then store in its place the same profile as a
    busy machine would have timed it; the key and the good profile."""
    first = launcher.worker(nats_url, model, *sim)
    ((key, good),) = _profiles(nats_url, model).items()
    first.stop()
    _store(nats_url, key, _timed_on_a_busy_machine(good))
    return key, good


def test_a_worker_profiles_again_when_service_contradicts_a_busy_profile(
    nats_server, launcher, gateway_url
):
    model = "sim-audited"
    sim = ["--runtime", "sim", "--option", "batch_ms=20", "--option", "token_us=0"]
    key, good = _busy_profile_stored(nats_server.url, launcher, model, sim)
    assert good.max_batch_items == 256

    worker = launcher.worker(nats_server.url, model, *sim)
    assert worker_status(nats_server.url, worker.pid, WorkerState.READY).max_batch_items == 4

    def profiled_again():
        status = worker_status(nats_server.url, worker.pid, WorkerState.READY)
        return status if status and status.max_batch_items == 256 else None

    # Load enough for the audit's window (batches of at most 4, each 20 ms instead of 60),
    # then on until the new budget is in: the audit fires mid-load, and the sweep (9 sizes,
    # 3 passes, >= 0.1 s each: ~3 s) runs under traffic.
    body = {"model": model, "input": "x"}
    latencies: list[float] = []
    with httpx.Client(timeout=30) as client:

        def post(_: int) -> int:
            began = time.monotonic()
            status = client.post(f"{gateway_url}/v1/embeddings", json=body).status_code
            latencies.append(time.monotonic() - began)
            return status

        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(post, range(8 * AUDIT_BATCHES)))
        deadline = time.monotonic() + 30
        while profiled_again() is None and time.monotonic() < deadline:
            statuses.append(post(0))
    assert statuses == [200] * len(statuses)
    assert profiled_again() is not None
    # It served on while it profiled: the sweep runs batch by batch in the worker's executor
    # and requests' batches queue between. As one job it held them for its whole ~3 s.
    assert max(latencies) < 1.0, sorted(latencies)[-5:]
    stored = _profiles(nats_server.url, model)[key]
    assert stored.max_batch_items == 256 and stored.profiled_by != "a busy machine"
    assert stored.latency_s[4] < 2 * good.latency_s[4]
    assert "profiling again" in worker.log()


def _load_until_logged(gateway_url: str, model: str, worker, line: str) -> None:
    """Enough requests for the audit's window, then more until `line` is in the log."""
    body = {"model": model, "input": "x"}
    with httpx.Client(timeout=30) as client, ThreadPoolExecutor(16) as pool:
        list(
            pool.map(
                lambda _: client.post(f"{gateway_url}/v1/embeddings", json=body),
                range(2 * AUDIT_BATCHES),
            )
        )
        deadline = time.monotonic() + 30
        while line not in worker.log() and time.monotonic() < deadline:
            client.post(f"{gateway_url}/v1/embeddings", json=body)
    assert line in worker.log(), worker.log()[-2000:]


def test_a_worker_stopped_while_it_profiles_again_abandons_the_profile(
    nats_server, launcher, gateway_url
):
    model = "sim-audit-stopped"
    # 120 ms batches: the sweep of sizes (9 sizes, 3 passes, 2 runs each) takes ~6.5 s of the
    # executor, ~13 s with service's batches between: far longer than the stop takes.
    sim = ["--runtime", "sim", "--option", "batch_ms=120", "--option", "token_us=0"]
    key, _ = _busy_profile_stored(nats_server.url, launcher, model, sim)

    worker = launcher.worker(nats_server.url, model, *sim)
    _load_until_logged(gateway_url, model, worker, "; profiling again")

    # Still profiling when stopped: the new budget (256) is not in yet.
    assert worker_status(nats_server.url, worker.pid, WorkerState.READY).max_batch_items == 4
    assert worker.stop() == 0
    log = worker.log()
    assert "profiling again abandoned" in log, log[-2000:]
    assert "profiling again failed" not in log, log[-2000:]
    # Nothing half-measured was stored: the busy profile stays.
    assert _profiles(nats_server.url, model)[key].profiled_by == "a busy machine"

    # The next worker's audit finds the same contradiction, but the stopped worker's claim
    # stands (REPROFILE_EVERY_S): it serves on at its budget instead of starting the same
    # profile again (a fleet of workers that live shorter than a re-profile never stored it).
    after = launcher.worker(nats_server.url, model, *sim)
    _load_until_logged(gateway_url, model, after, "not profiling again")
    assert "; profiling again" not in after.log()
    assert worker_status(nats_server.url, after.pid, WorkerState.READY).max_batch_items == 4


def test_one_re_profile_claim_a_model_fleet_wide(nats_server) -> None:
    """The first claim wins; a second, from any worker, is refused while it stands; another
    model's (or hardware's) key is its own."""

    async def claims() -> list[bool]:
        nc = await connect(nats_server.url, name="test")
        try:
            js = nc.jetstream()
            return [
                await claim_reprofile(js, "m.sim.aaaa", "worker-1"),
                await claim_reprofile(js, "m.sim.aaaa", "worker-2"),
                await claim_reprofile(js, "m.sim.aaaa", "worker-1"),
                await claim_reprofile(js, "m.sim.bbbb", "worker-2"),
            ]
        finally:
            await nc.close()

    assert asyncio.run(claims()) == [True, False, False, True]
