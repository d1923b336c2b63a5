"""Zero-tuning batches: a short profile on first load picks a model's batch budget.

The first worker to load a model on a kind of hardware times the runtime at batch sizes 1, 2,
4, ... and picks the largest size whose throughput is within 5% of the best seen, among sizes
within the latency target. For embedding and rerank models a size is items per batch and the
target bounds one batch's time (`SHOAL_BATCH_LATENCY_TARGET`, seconds, default 1); for a
generative model a size is sequences decoded together (at most the runtime's max_sequences)
and the target bounds one decode step, the time between two tokens of a stream
(`SHOAL_TOKEN_LATENCY_TARGET`, default 0.25 s: at least 4 tokens a second per stream, about
reading speed). The result goes to the `shoal_profiles` KV bucket under (model, runtime, spec,
hardware fingerprint); every later worker with the same key reads it instead of profiling.
Workers that start together race for the key with a KV create: one profiles, the others wait.
The token budget is not profiled: it bounds memory on long texts and stays as configured.

An engine (the `engine` runtime: a server child that batches for itself) is profiled from
outside, over HTTP: `profile_engine` keeps 1, 2, 4, ... 16 requests in flight to it for a few
seconds each and takes the smallest concurrency whose throughput (tokens a second, or inputs
a second for embeddings) is within 10% of the best, among those whose streams stay within the
token latency target. Smallest, unlike batches: an engine gains nothing from requests it only
queues, and each one the relay holds is kept from other workers. It is stored and shared as
any profile is; its `max_batch_items` is the relay's concurrency.

A profile has to hold on a machine that is still busy starting (or shared): the sizes are
timed in `PROFILE_PASSES` interleaved passes and each size's median is kept, so a busy spell
slows one timing of each size rather than all timings of some sizes. And a worker audits the
profile it uses against what its batches cost in service (`ProfileAudit`): when they run much
faster than the profile says, the profile was measured under load, and the worker profiles
once more and stores the new result for every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import statistics
import sys
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Protocol

import msgspec
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from shoal.config import LatencyTargets
from shoal.protocol import Endpoint, ModelSpec, Task, encode_json, now_ms
from shoal.runtimes.base import (
    EmbeddingRuntime,
    GenerationRuntime,
    SamplingParams,
    ScoringRuntime,
)
from shoal.runtimes.registry import runtime_record
from shoal.state.profiles import (
    REPROFILE_EVERY_S,
    BatchProfile,
    claim_profile,
    claim_reprofile,
    ensure_profiles_kv,
    profile_key,
    read_profile,
    store_profile,
)

log = logging.getLogger(__name__)

PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROFILE_PASSES = 3
MIN_SECONDS_PER_SIZE = 0.1  # a pass; each size is timed once a pass
WITHIN_BEST = 0.95
WAIT_FOR_OTHER_S = 120.0  # a profile claimed longer ago than this was abandoned
AUDIT_BATCHES = 32
FASTER_THAN_PROFILE = 0.7  # in service at most 0.7x the profile's seconds: profiled too busy
_PROFILE_TEXT = "Sentence number {i} about pulling work from a shared queue, for profiling."
MIN_STEPS_PER_SIZE = 3
ENGINE_SIZES = (1, 2, 4, 8, 16)
ENGINE_WITHIN_BEST = 0.9
ENGINE_MIN_CONCURRENCY = 2
ENGINE_PROFILE_TOKENS = 16  # generated per profiling request


@dataclass(frozen=True, slots=True)
class BatchBudget:
    """How much one batch may hold, and the seconds per batch size the profile measured."""

    max_batch_items: int
    max_batch_tokens: int
    latency_s: dict[int, float] = field(default_factory=dict)


def is_scoring(runtime: object) -> bool:
    """Whether a loaded runtime is a cross-encoder (`ScoringRuntime`) rather than an embedder."""
    return callable(getattr(runtime, "score", None)) and not hasattr(runtime, "embed")


def run_texts(runtime: EmbeddingRuntime | ScoringRuntime, texts: list[str]) -> None:
    """Run one batch of len(texts) items, whatever the runtime's interface.

    A cross-encoder scores each text against itself: a pair as long as a typical request's.
    """
    if is_scoring(runtime):
        runtime.score([(text, text) for text in texts])  # type: ignore[union-attr]
    else:
        runtime.embed(texts)  # type: ignore[union-attr]


def hardware_fingerprint() -> str:
    """The kind of machine a profile holds for: CPU model and cores, and GPU when in use."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    parts = [cpu, f"{os.cpu_count()} cores"]
    torch = sys.modules.get("torch")  # only when a runtime already imported it
    if torch is not None and torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name(0))
    return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class Measurements:
    throughput: dict[int, float]  # items per second, by batch size
    latency_s: dict[int, float]  # seconds per batch, by batch size
    chosen: int


async def profile_batches(
    runtime: EmbeddingRuntime | ScoringRuntime, latency_target_s: float, executor: Executor
) -> Measurements:
    """Time the runtime over batch sizes and pick the budget.

    `PROFILE_PASSES` passes over the sizes, each size's median seconds per batch kept. The
    first pass stops at the first size past the latency target; later passes time only the
    sizes the first one reached.

    Each batch timed is its own job in `executor`, the thread the worker's batches run in, so
    a worker that profiles again in service goes on serving: its batches queue between the
    profile's. As one job, the sweep held that thread for all of its seconds (~2.9 s on the
    simulated device of tests/test_profile_audit.py; ~9 s for all-MiniLM-L6-v2 on 2 cores, from
    its in-process speeds).
    """
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(executor, run_texts, runtime, [_PROFILE_TEXT.format(i=0)])

    async def seconds_per_batch(size: int) -> float:
        texts = [_PROFILE_TEXT.format(i=i) for i in range(size)]
        runs, spent = 0, 0.0
        while runs < 2 or spent < MIN_SECONDS_PER_SIZE:
            spent += await loop.run_in_executor(executor, _timed_run, runtime, texts)
            runs += 1
        return spent / runs

    timings: dict[int, list[float]] = {}
    for size in PROFILE_SIZES:
        timings[size] = [await seconds_per_batch(size)]
        if timings[size][0] > latency_target_s:
            break  # larger batches only take longer
    for _ in range(PROFILE_PASSES - 1):
        for size, seconds in timings.items():
            seconds.append(await seconds_per_batch(size))
    latency = {size: statistics.median(seconds) for size, seconds in timings.items()}
    throughput = {size: size / seconds for size, seconds in latency.items()}
    return Measurements(throughput, latency, choose_budget(throughput, latency, latency_target_s))


def _timed_run(runtime: EmbeddingRuntime | ScoringRuntime, texts: list[str]) -> float:
    """Seconds one batch of `texts` took (in the executor thread)."""
    began = time.perf_counter()
    run_texts(runtime, texts)
    return time.perf_counter() - began


class ProfileAudit:
    """Whether a stored profile is contradicted by what batches cost in service.

    Each batch's seconds are compared with the profile's seconds at its size (interpolated
    between profiled sizes). Once `AUDIT_BATCHES` batches are in, a median ratio below
    `FASTER_THAN_PROFILE` means the profile was timed on a busier machine than the one now
    serving, so its budget may be too small: `observe` answers True, once. Slower service
    than profiled is not a contradiction: in service a batch also decodes requests and
    encodes responses, and the worker's network loop competes for the CPU.
    """

    def __init__(self, latency_s: dict[int, float]) -> None:
        self._profile = sorted((int(size), float(s)) for size, s in latency_s.items() if s > 0)
        self._ratios: deque[float] = deque(maxlen=AUDIT_BATCHES)
        self._done = len(self._profile) < 2  # nothing to audit against

    def expected_seconds(self, items: int) -> float:
        """The profile's seconds for a batch of `items`, linear between profiled sizes (past
        the largest, its last segment extended; below the smallest, the smallest's)."""
        points = self._profile
        if items <= points[0][0]:
            return points[0][1]
        for (n0, s0), (n1, s1) in pairwise(points):
            if items <= n1:
                return s0 + (s1 - s0) * (items - n0) / (n1 - n0)
        (n0, s0), (n1, s1) = points[-2], points[-1]
        return max(s1, s1 + (s1 - s0) * (items - n1) / (n1 - n0))

    def observe(self, items: int, seconds: float) -> bool:
        """Record one batch; True the first time the profile is found contradicted."""
        if self._done or items < 1 or seconds <= 0:
            return False
        self._ratios.append(seconds / self.expected_seconds(items))
        if len(self._ratios) < AUDIT_BATCHES:
            return False
        if statistics.median(self._ratios) < FASTER_THAN_PROFILE:
            self._done = True
            return True
        return False


def profile_sequences(runtime: GenerationRuntime, latency_target_s: float) -> Measurements:
    """Time decode steps over 1, 2, 4 ... max_sequences sequences (in the executor thread).

    Throughput is tokens per second over all sequences, latency the seconds per step; prompts
    are processed before the timing starts, so only decoding is measured.
    """
    throughput: dict[int, float] = {}
    latency: dict[int, float] = {}
    largest = runtime.max_sequences
    sizes = [s for s in PROFILE_SIZES if s < largest] + [largest]
    for size in sizes:
        seconds = _seconds_per_step(runtime, size)
        throughput[size], latency[size] = size / seconds, seconds
        # A step's time grows slowly and not always monotonically with the sequences in it
        # (the torch runtime measured 0.21 s at 2 and 0.19 s at 4): go on past the target,
        # stop only once a step takes twice as long.
        if seconds > 2 * latency_target_s:
            break
    return Measurements(throughput, latency, choose_budget(throughput, latency, latency_target_s))


def _seconds_per_step(runtime: GenerationRuntime, size: int) -> float:
    prompts = [runtime.tokenize(_PROFILE_TEXT.format(i=i)) for i in range(size)]
    room = runtime.context_length - max(len(p) for p in prompts) - 1
    for slot, prompt in enumerate(prompts):
        runtime.add_sequence(slot, prompt, SamplingParams(temperature=0.0))
    try:
        started: set[int] = set()
        while len(started) < size and room > 0:  # process the prompts first
            started.update(runtime.step())
            room -= 1
        if room > 1:  # and one decode step untimed: the first at a new size may allocate
            runtime.step()
            room -= 1
        steps, began = 0, time.perf_counter()
        while steps < room and (
            steps < MIN_STEPS_PER_SIZE or time.perf_counter() - began < MIN_SECONDS_PER_SIZE
        ):
            runtime.step()
            steps += 1
        if steps == 0:
            raise ValueError("the context is too short to profile decoding")
        return (time.perf_counter() - began) / steps
    finally:
        for slot in range(size):
            runtime.remove_sequence(slot)


class ProfiledEngine(Protocol):
    """What engine profiling needs of the `engine` runtime (runtimes/engine.py)."""

    served_model: str
    profile_seconds: float

    async def post(self, endpoint: str, body: bytes) -> Any: ...


async def profile_engine(
    engine: ProfiledEngine,
    task: Task,
    latency_target_s: float,
    sizes: tuple[int, ...] = ENGINE_SIZES,
) -> Measurements:
    """Time the engine at each concurrency in `sizes` and choose one (in the event loop).

    For a generative model a unit of work is a generated token (completions, greedy,
    `ENGINE_PROFILE_TOKENS` each) and latency is seconds between two tokens of one stream;
    for embeddings, one input and seconds per request. Each size is timed in a closed loop
    for the engine's `profile_seconds`. Timing stops early once a doubling gains under 5%
    over the best so far: the engine is saturated. ValueError if the engine refuses the
    profiling requests (the caller falls back to a fixed concurrency).
    """
    generate = task is Task.GENERATE
    if generate:
        endpoint = Endpoint.COMPLETIONS.value
        prompt = _PROFILE_TEXT.format(i=0)
        # Greedy: every request the same length.
        body = {"prompt": prompt, "max_tokens": ENGINE_PROFILE_TOKENS, "temperature": 0.0}
    else:
        endpoint, body = Endpoint.EMBEDDINGS.value, {"input": _PROFILE_TEXT.format(i=0)}
    request = encode_json({**body, "model": engine.served_model})
    await _engine_units(engine, endpoint, request, generate)  # warm up, and learn it answers
    throughput: dict[int, float] = {}
    latency: dict[int, float] = {}
    for size in sizes:
        units, seconds = await _engine_closed_loop(
            engine, endpoint, request, generate, size, engine.profile_seconds
        )
        throughput[size] = units / seconds
        # Little's law: each of `size` streams gets 1/size of the throughput.
        latency[size] = size / throughput[size]
        best_before = max((v for s, v in throughput.items() if s < size), default=0.0)
        if best_before and throughput[size] < best_before / WITHIN_BEST:
            break
    fitting = [s for s in throughput if latency[s] <= latency_target_s] or [min(throughput)]
    best = max(throughput[s] for s in fitting)
    chosen = min(s for s in fitting if throughput[s] >= ENGINE_WITHIN_BEST * best)
    # At least 2: the relay replaces a finished request only after a pull through the queue,
    # and a second one in flight keeps even a one-at-a-time engine busy meanwhile.
    return Measurements(throughput, latency, max(chosen, ENGINE_MIN_CONCURRENCY))


async def _engine_units(engine: ProfiledEngine, endpoint: str, body: bytes, generate: bool) -> int:
    reply = await engine.post(endpoint, body)
    if reply.status != 200:
        raise ValueError(f"the engine answered {reply.status}: {reply.body[:300]!r}")
    document = msgspec.json.decode(reply.body)
    if generate:
        return int((document.get("usage") or {}).get("completion_tokens") or 0)
    return len(document.get("data") or [])


async def _engine_closed_loop(
    engine: ProfiledEngine, endpoint: str, body: bytes, generate: bool, size: int, seconds: float
) -> tuple[int, float]:
    """`size` clients, each sending its next request when the last one ends, for `seconds`:
    the units done and the time until the last request ended."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    deadline = began + seconds

    async def client() -> int:
        done = 0
        while True:  # at least one request each, so the size is timed with all in flight
            done += await _engine_units(engine, endpoint, body, generate)
            if loop.time() >= deadline:
                return done

    units = sum(await asyncio.gather(*(client() for _ in range(size))))
    return units, loop.time() - began


def choose_budget(
    throughput: dict[int, float], latency_s: dict[int, float], latency_target_s: float
) -> int:
    """The largest batch size within 5% of the best throughput, among those within target.

    Largest, not smallest: past the knee a runtime's curve is flat within the timing noise,
    so "smallest within 5%" lands anywhere on the flat part (profiles of one model chose 8
    to 256), while through the cluster each batch also pays the worker's per-batch costs and
    larger batches keep gaining. A budget is a cap: at low load batches stay small anyway.
    """
    fitting = [s for s in throughput if latency_s[s] <= latency_target_s] or [min(throughput)]
    best = max(throughput[s] for s in fitting)
    return max(s for s in fitting if throughput[s] >= WITHIN_BEST * best)


async def tuned_budget(
    js: JetStreamContext,
    spec: ModelSpec,
    runtime: EmbeddingRuntime | ScoringRuntime | GenerationRuntime,
    executor: Executor,
    worker_id: str,
    max_batch_tokens: int,
    targets: LatencyTargets,
) -> BatchBudget:
    """The model's batch budget from its stored profile, profiling first if there is none
    (an engine's: the relay's concurrency, `profile_engine`)."""
    kv = await ensure_profiles_kv(js)
    hardware = hardware_fingerprint()
    key = profile_key(spec, hardware)
    deadline = time.monotonic() + WAIT_FOR_OTHER_S
    while True:
        stored = await read_profile(kv, key)
        if stored is not None:
            return BatchBudget(stored.max_batch_items, max_batch_tokens, stored.latency_s)
        if await claim_profile(kv, key) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)  # another worker is profiling this model: wait for it
    try:
        return await measure_and_store(
            kv, key, spec, runtime, executor, worker_id, max_batch_tokens, targets
        )
    except BaseException:
        # Drop the claim: the other workers would wait WAIT_FOR_OTHER_S for a profile that
        # is not coming.
        with contextlib.suppress(Exception):
            await kv.delete(key)
        raise


async def reprofile(
    js: JetStreamContext,
    spec: ModelSpec,
    runtime: EmbeddingRuntime | ScoringRuntime,
    executor: Executor,
    worker_id: str,
    max_batch_tokens: int,
    targets: LatencyTargets,
) -> BatchBudget | None:
    """Profile again (the stored profile was contradicted in service) and replace it; None
    when another worker of the fleet claimed that lately (state/profiles.py)."""
    kv = await ensure_profiles_kv(js)
    key = profile_key(spec, hardware_fingerprint())
    if not await claim_reprofile(js, key, worker_id):
        log.warning(
            "%s: batches run much faster than the stored profile says, but not profiling "
            "again: another worker claimed that within the last %.0f s; the budget stays",
            spec.name,
            REPROFILE_EVERY_S,
        )
        return None
    log.warning(
        "%s: batches run much faster than the stored profile says (it was timed on a "
        "busier machine); profiling again",
        spec.name,
    )
    return await measure_and_store(
        kv, key, spec, runtime, executor, worker_id, max_batch_tokens, targets
    )


async def measure_and_store(
    kv: KeyValue,
    key: str,
    spec: ModelSpec,
    runtime: EmbeddingRuntime | ScoringRuntime | GenerationRuntime,
    executor: Executor,
    worker_id: str,
    max_batch_tokens: int,
    targets: LatencyTargets,
) -> BatchBudget:
    """Profile the runtime in the executor (an engine: over HTTP, in the event loop), store
    the profile under `key`, return the budget."""
    if runtime_record(spec.runtime).engine:
        target = targets.token_s if spec.task is Task.GENERATE else targets.batch_s
        measured = await profile_engine(runtime, spec.task, target)  # type: ignore[arg-type]
    elif spec.task is Task.GENERATE:
        loop = asyncio.get_running_loop()
        measured = await loop.run_in_executor(executor, profile_sequences, runtime, targets.token_s)
    else:
        measured = await profile_batches(
            runtime,  # type: ignore[arg-type]
            targets.batch_s,
            executor,
        )
    profile = BatchProfile(
        model=spec.name,
        runtime=spec.runtime,
        hardware=hardware_fingerprint(),
        max_batch_items=measured.chosen,
        max_batch_tokens=max_batch_tokens,
        throughput={s: round(v, 2) for s, v in measured.throughput.items()},
        latency_s={s: round(v, 5) for s, v in measured.latency_s.items()},
        profiled_by=worker_id,
        profiled_ms=now_ms(),
    )
    await store_profile(kv, key, profile)
    log.info("%s: profiled, batch budget %d items", spec.name, profile.max_batch_items)
    return BatchBudget(profile.max_batch_items, max_batch_tokens, profile.latency_s)
