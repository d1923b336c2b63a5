"""Dead letters: a request that crashes its worker every time ends in SHOAL_DLQ.

Real processes: the session's nats-server, a gateway with an admin token, and a worker on the
simulated runtime with its fault option `crash_on` (a text holding the marker SIGKILLs the
worker, as a crashing kernel would). The test restarts the worker each time it dies, as
`shoal up` does. The work consumer gets `max_deliver` 4 and an ack wait of 2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from conftest import (
    Launcher,
    ShoalProcess,
    scheduler_context,
    wait_until,
    wait_until_async,
    worker_status,
)
from nats.aio.msg import Msg

from shoal.broker.connection import connect
from shoal.broker.dlq import DLQ_STREAM, ensure_dlq_stream, list_dead_letters
from shoal.broker.jetstream import ensure_model_consumer, ensure_work_stream, read_backlog
from shoal.catalog import resolve_model
from shoal.config import QueueSettings, WorkerSettings
from shoal.protocol import (
    WORK_STREAM,
    Endpoint,
    Result,
    Task,
    WorkEnvelope,
    WorkRequest,
    decode_results,
    encode_msgpack,
    now_ms,
    work_subject,
)
from shoal.runtimes.sim import SimEmbeddingRuntime, pseudo_embedding
from shoal.state.attempts import Attempt, ensure_attempts_kv, mark_attempt
from shoal.state.workers import WorkerState
from shoal.worker.items import WorkItem
from shoal.worker.schedulers.batch import BatchScheduler, batch_handler

MARKER = "POISON-PILL"
MAX_DELIVER = 4
TIMEOUT_S = 60.0
TOKEN = "dlq-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


class RestartingWorker:
    """A worker that is started again whenever it dies (what `shoal up` does for a worker)."""

    def __init__(self, launcher: Launcher, nats_url: str, model: str, *options: str) -> None:
        self._args = (
            "worker",
            "--nats",
            nats_url,
            "--model",
            model,
            "--runtime",
            "sim",
            "--option",
            f"crash_on={MARKER}",
            *options,
            "--max-batch-items",
            "64",
        )
        self._launcher = launcher
        self.deaths: list[int] = []  # exit codes of the workers that died
        self.current: ShoalProcess = launcher.spawn(*self._args)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            code = self.current.process.poll()
            if code is not None:
                self.deaths.append(code)
                self.current = self._launcher.spawn(*self._args)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.current.stop()


def _nats(nats_url: str, work):
    async def run():
        nc = await connect(nats_url, name="test-dlq")
        try:
            return await work(nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(run())


def _embed(url: str, model: str, text: str) -> tuple[int, dict, float]:
    started = time.monotonic()
    response = httpx.post(
        f"{url}/v1/embeddings", json={"model": model, "input": text}, timeout=TIMEOUT_S + 30
    )
    return response.status_code, response.json(), time.monotonic() - started


def _shoal(nats_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoal", "dlq", *args, "--nats", nats_url],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def cluster(nats_server, tmp_path):
    """A gateway (admin token, 60 s timeout) and a restarting poison-sensitive worker."""
    model = f"sim-poison-{uuid.uuid4().hex[:6]}"
    launcher = Launcher(
        tmp_path, env={"SHOAL_MAX_DELIVER": str(MAX_DELIVER), "SHOAL_ACK_WAIT": "2"}
    )
    _, url = launcher.gateway(
        nats_server.url, "--admin-token", TOKEN, "--request-timeout", str(TIMEOUT_S)
    )
    worker = RestartingWorker(launcher, nats_server.url, model)
    # Ready once the gateway knows the model (the worker registers it) and answers it.
    wait_until(lambda: _embed(url, model, "warm-up")[0] == 200, 60, worker.current)
    _nats(nats_server.url, _empty_dlq)  # earlier tests' entries
    yield url, model, worker, launcher
    worker.stop()
    launcher.stop_all()


async def _empty_dlq(js) -> None:
    await ensure_dlq_stream(js)
    await js.purge_stream(DLQ_STREAM)


def test_poison_request_is_dead_lettered_and_its_batch_answered(nats_server, cluster) -> None:
    url, model, worker, _ = cluster
    texts = [f"innocent sentence {i}" for i in range(12)]
    poison = f"this one carries the {MARKER}"
    # Sent together, so that the poison shares the first batch (and envelopes) with others.
    with ThreadPoolExecutor(len(texts) + 1) as pool:
        poisoned = pool.submit(_embed, url, model, poison)
        time.sleep(0.01)
        innocents = [pool.submit(_embed, url, model, text) for text in texts]
        results = [f.result() for f in innocents]
        status, body, elapsed = poisoned.result()

    # Every other request of the batch is answered, and answered right.
    for text, (code, payload, _) in zip(texts, results, strict=True):
        assert code == 200, payload
        vector = np.asarray(payload["data"][0]["embedding"], dtype=np.float32)
        np.testing.assert_allclose(vector, pseudo_embedding(text, 384), atol=1e-6)
    # The poison's client gets a clear error before its deadline, not a 504 at it.
    assert status == 502, body
    assert body["error"]["code"] == "dead_lettered"
    assert f"{MAX_DELIVER} times" in body["error"]["message"]
    assert elapsed < TIMEOUT_S - 5
    # It crashed a worker on every delivery, and each was restarted.
    assert len(worker.deaths) == MAX_DELIVER
    assert all(code == -9 for code in worker.deaths)

    # In the DLQ: payload, deliveries, last error, model.
    entries = _nats(nats_server.url, list_dead_letters)
    assert len(entries) == 1
    entry = entries[0]
    assert entry.model == model
    assert entry.deliveries == MAX_DELIVER
    assert entry.work_subject == work_subject(model)
    assert "while running request" in entry.last_error
    assert f"delivery {MAX_DELIVER} of {MAX_DELIVER}" in entry.last_error
    shown = _admin(url, "GET", f"/admin/dlq/{entry.seq}")
    bodies = [json.loads(r["body"]) for r in shown["requests"]]
    culprits = [b for b in bodies if MARKER in b["input"]]
    assert culprits == [{"model": model, "input": poison}]
    # The culprit named by the last error is the poison request itself.
    poison_id = next(r["request_id"] for r in shown["requests"] if MARKER in r["body"])
    assert poison_id in entry.last_error
    # It left the work queue: nothing is pending or stuck there.
    assert _nats(nats_server.url, lambda js: read_backlog(js, model)) == 0
    assert _subject_count(nats_server.url, model) == 0

    # The worker serves again.
    assert _embed(url, model, "after the storm")[0] == 200


def _subject_count(nats_url: str, model: str) -> int:
    async def count(js):
        info = await js.stream_info(WORK_STREAM, subjects_filter=work_subject(model))
        return sum((info.state.subjects or {}).values())

    return _nats(nats_url, count)


def _admin(url: str, method: str, path: str, token: str | None = TOKEN, expect: int = 200):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.request(method, f"{url}{path}", headers=headers, timeout=30)
    assert response.status_code == expect, response.text
    return response.json()


def _dead_letter_one(url: str, model: str, worker: RestartingWorker, tag: str) -> None:
    status, body, _ = _embed(url, model, f"{tag} {MARKER}")
    assert status == 502 and body["error"]["code"] == "dead_lettered", body


def test_dlq_cli_list_show_replay_purge(nats_server, cluster) -> None:
    url, model, worker, _ = cluster
    _dead_letter_one(url, model, worker, "first")
    _dead_letter_one(url, model, worker, "second")

    listed = _shoal(nats_server.url, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    entries = json.loads(listed.stdout)
    assert [e["deliveries"] for e in entries] == [MAX_DELIVER, MAX_DELIVER]
    first, second = entries
    table = _shoal(nats_server.url, "list")
    assert model in table.stdout and str(first["seq"]) in table.stdout

    shown = _shoal(nats_server.url, "show", str(first["seq"]))
    assert shown.returncode == 0, shown.stderr
    assert f"first {MARKER}" in shown.stdout and "Shoal-Deliveries: 4" in shown.stdout
    missing = _shoal(nats_server.url, "show", "999999")
    assert missing.returncode == 1 and "no dead letter 999999" in missing.stderr

    # Replay puts it back on the work queue: the worker crashes on it again, and after
    # max_deliver more deliveries it is back in the DLQ, counted as replayed once.
    deaths = len(worker.deaths)
    replayed = _shoal(nats_server.url, "replay", str(first["seq"]))
    assert replayed.returncode == 0, replayed.stderr
    assert f"replayed {first['seq']}" in replayed.stdout

    def back_in_dlq():
        now = _nats(nats_server.url, list_dead_letters)
        return [e for e in now if e.replays == 1]

    again = wait_until(back_in_dlq, 60)
    assert len(again) == 1 and again[0].deliveries == MAX_DELIVER
    assert len(worker.deaths) == deaths + MAX_DELIVER
    remaining = {e.seq for e in _nats(nats_server.url, list_dead_letters)}
    assert first["seq"] not in remaining and second["seq"] in remaining

    purged = _shoal(nats_server.url, "purge", str(second["seq"]))
    assert purged.returncode == 0 and "purged 1" in purged.stdout
    assert _shoal(nats_server.url, "replay").returncode == 2  # neither seq nor --all
    purged = _shoal(nats_server.url, "purge", "--all")
    assert purged.returncode == 0 and "purged 1" in purged.stdout
    assert _shoal(nats_server.url, "list").stdout.strip() == "no dead letters"


def test_dlq_admin_api(nats_server, cluster) -> None:
    url, model, worker, _ = cluster
    # The admin token guards the DLQ routes like every admin route.
    _admin(url, "GET", "/admin/dlq", token=None, expect=401)
    _admin(url, "GET", "/admin/dlq", token="wrong", expect=401)
    assert _admin(url, "GET", "/admin/dlq")["data"] == []

    _dead_letter_one(url, model, worker, "admin")
    listing = _admin(url, "GET", "/admin/dlq")["data"]
    assert len(listing) == 1
    seq = listing[0]["seq"]
    assert listing[0]["model"] == model and listing[0]["deliveries"] == MAX_DELIVER
    shown = _admin(url, "GET", f"/admin/dlq/{seq}")
    assert shown["headers"]["Shoal-Deliveries"] == str(MAX_DELIVER)
    assert any(MARKER in r["body"] for r in shown["requests"])

    # Bad names are clear errors in the OpenAI shape.
    error = _admin(url, "GET", "/admin/dlq/abc", expect=400)["error"]
    assert "sequence number" in error["message"]
    assert _admin(url, "GET", "/admin/dlq/999999", expect=404)["error"]["code"] == (
        "dead_letter_not_found"
    )
    _admin(url, "PUT", "/admin/dlq", expect=405)
    _admin(url, "GET", "/admin/nothing-here", expect=404)

    # Replay: back on the work queue, and (still poison) back in the DLQ after max_deliver.
    replayed = _admin(url, "POST", f"/admin/dlq/{seq}/replay")
    assert replayed["replayed"] == seq and replayed["work_seq"] > 0

    def back():
        data = _admin(url, "GET", "/admin/dlq")["data"]
        return data if data and data[0]["replays"] == 1 else None

    data = wait_until(back, 60)
    assert len(data) == 1 and data[0]["seq"] != seq
    _admin(url, "POST", f"/admin/dlq/{seq}/replay", expect=404)  # it was moved

    assert _admin(url, "DELETE", f"/admin/dlq/{data[0]['seq']}") == {"purged": 1}
    _dead_letter_one(url, model, worker, "purge-all")
    assert _admin(url, "DELETE", "/admin/dlq") == {"purged": 1}
    assert _admin(url, "GET", "/admin/dlq")["data"] == []


def test_poison_first_in_its_envelope_the_rest_answered(nats_server, cluster) -> None:
    """The hardest order: the poison leads an envelope (one JetStream message) of eight.

    The envelope is published as a gateway would, so the poison certainly shares its
    message and its first batch with the others.
    """
    _, model, worker, _ = cluster
    texts = [f"{MARKER} first", *(f"bystander {i}" for i in range(7))]
    ids = [uuid.uuid4().hex for _ in texts]
    reply_to = f"shoal.reply.test-{uuid.uuid4().hex[:8]}"

    async def run(js):
        nc = js._nc
        results: dict[str, Result] = {}
        done = asyncio.Event()

        async def on_reply(msg) -> None:
            for result in decode_results(msg.data).results:
                results.setdefault(result.request_id, result)
            if len(results) == len(ids):
                done.set()

        await nc.subscribe(reply_to, cb=on_reply)
        deadline = now_ms() + int(TIMEOUT_S * 1000)
        requests = [
            WorkRequest(
                rid, "embeddings", deadline, 8, json.dumps({"model": model, "input": t}).encode()
            )
            for rid, t in zip(ids, texts, strict=True)
        ]
        envelope = WorkEnvelope(reply_to, now_ms(), requests)
        await js.publish(work_subject(model), encode_msgpack(envelope))
        await asyncio.wait_for(done.wait(), TIMEOUT_S)
        return results

    started = time.monotonic()
    results = _nats(nats_server.url, run)
    assert time.monotonic() - started < TIMEOUT_S - 5
    poison = results[ids[0]]
    assert poison.status == 502 and b"dead_lettered" in poison.body, poison.body
    for rid, text in zip(ids[1:], texts[1:], strict=True):
        assert results[rid].status == 200, results[rid].body
        vector = json.loads(results[rid].body)["data"][0]["embedding"]
        np.testing.assert_allclose(vector, pseudo_embedding(text, 384), atol=1e-6)
    assert len(worker.deaths) == MAX_DELIVER
    entries = _nats(nats_server.url, list_dead_letters)
    assert len(entries) == 1 and len(entries[0].requests) == len(texts)
    assert ids[0] in entries[0].last_error


def test_a_known_culprit_waits_for_suspects_still_being_looked_up(nats_server) -> None:
    """The batch scheduler alone (real NATS, simulated runtime): a redelivered culprit that
    comes in while another suspect message's attempt record is still being read runs after
    that message's request, not before it. Run first, a real culprit took the other down
    with the worker once more; with `max_deliver` reached, it was dead-lettered unanswered."""
    innocent = _suspect("innocent", culprit=False)
    asyncio.run(_culprit_after_a_late_arrival(nats_server.url, innocent))


def test_a_known_culprit_waits_for_the_open_pull_and_runs_after_what_it_brings(
    nats_server,
) -> None:
    """An item on its first delivery that the worker's open pull request brings in after the
    culprit runs before it too: whatever a worker holds when the culprit crashes it is
    delivered once more, and an innocent message on its last delivery is dead-lettered."""
    innocent = _suspect("innocent", culprit=False)
    innocent.deliveries = 1
    asyncio.run(_culprit_after_a_late_arrival(nats_server.url, innocent))


async def _culprit_after_a_late_arrival(url: str, innocent: WorkItem) -> None:
    async with _culprit_scheduler(url, batch_ms=1) as (scheduler, answered):
        scheduler.arrivals_expected(+1)  # a record being read, or a pull request open
        scheduler.accept(_suspect("culprit", culprit=True))
        await asyncio.sleep(0.3)  # a slow record read, or a pull that brings one late
        scheduler.accept(innocent)
        scheduler.arrivals_expected(-1)
        await wait_until_async(lambda: len(answered) == 2, 5)
        assert answered == ["innocent", "culprit"]


def test_a_worker_holding_a_known_culprit_pulls_nothing_until_it_has_run(nats_server) -> None:
    """Quarantine: from the culprit's arrival to its answer the fill loop is told to wait
    (`pull_after_s` > 0), so nothing new is held if the culprit crashes the worker; once it
    has returned, the worker pulls again at once."""

    async def run() -> None:
        async with _culprit_scheduler(nats_server.url, batch_ms=400) as (scheduler, answered):
            assert scheduler.pull_after_s() == 0.0
            scheduler.accept(_suspect("culprit", culprit=True))
            assert scheduler.pull_after_s() > 0  # held, not yet running
            await asyncio.sleep(0.2)
            assert scheduler.held() and scheduler.pull_after_s() > 0  # running
            await wait_until_async(lambda: answered == ["culprit"], 5)
            await wait_until_async(lambda: scheduler.pull_after_s() == 0.0, 5)

    asyncio.run(run())


@contextlib.asynccontextmanager
async def _culprit_scheduler(url: str, batch_ms: int):
    """A running batch scheduler on the simulated runtime, and the request ids it answered."""
    nc = await connect(url, name="culprit-order")
    answered: list[str] = []

    async def on_reply(msg) -> None:
        answered.extend(result.request_id for result in decode_results(msg.data).results)

    await nc.subscribe(_CULPRIT_REPLIES, cb=on_reply)
    ctx = scheduler_context(nc, WorkerSettings(nats_url=url, max_batch_items=64), "sim-culprit")
    runtime = SimEmbeddingRuntime("sim-culprit", {"batch_ms": batch_ms})
    scheduler = BatchScheduler(
        ctx, batch_handler(resolve_model("sim-embed"), runtime), Task.EMBEDDINGS
    )
    running = asyncio.create_task(scheduler.run())
    try:
        yield scheduler, answered
    finally:
        scheduler.stop_accepting()
        await asyncio.wait_for(running, 5)
        ctx.executor.shutdown()
        await nc.close()


_CULPRIT_REPLIES = "test.culprit-order.replies"


def _suspect(request_id: str, culprit: bool) -> WorkItem:
    sent = now_ms()
    body = b'{"model": "sim-culprit", "input": "%s"}' % request_id.encode()
    item = WorkItem(
        None, request_id, _CULPRIT_REPLIES, sent + 60_000, sent, 1, Endpoint.EMBEDDINGS, body
    )
    item.deliveries = MAX_DELIVER
    item.culprit = culprit
    return item


def test_an_innocent_message_on_its_last_delivery_is_answered_beside_a_known_culprit(
    nats_server, tmp_path
) -> None:
    """The state the CI failure reached, set up on purpose: the poison's message and an
    innocent one have each been delivered three times without an answer (as when both were
    held by every worker the poison crashed), and the attempt record names the poison. The
    next worker gets the poison's on its last delivery, and the innocent one comes in while
    the culprit would run (the test holds it until then; the culprit runs 1.5 s before it
    kills the worker). Quarantined, the culprit runs with nothing else held: the innocent
    message is answered (by this worker first, or by the next), never dead-lettered."""
    model = f"sim-quarantine-{uuid.uuid4().hex[:6]}"
    queue = QueueSettings(ack_wait_s=2.0, max_deliver=MAX_DELIVER)
    reply_to = f"shoal.reply.test-{uuid.uuid4().hex[:8]}"
    poison_id, innocent_ids = uuid.uuid4().hex, [uuid.uuid4().hex for _ in range(3)]
    results: dict[str, Result] = {}

    def envelope(ids: list[str], text: str) -> bytes:
        deadline = now_ms() + int(TIMEOUT_S * 1000)
        body = json.dumps({"model": model, "input": text}).encode()
        requests = [WorkRequest(rid, "embeddings", deadline, 8, body) for rid in ids]
        return encode_msgpack(WorkEnvelope(reply_to, now_ms(), requests))

    async def burn(js) -> Msg:
        """Both messages delivered `MAX_DELIVER - 1` times, the poison's culprit recorded;
        the poison's handed back, the innocent one still held (its last delivery)."""
        await ensure_work_stream(js, queue)
        consumer = await ensure_model_consumer(js, model, queue)
        poison = await js.publish(work_subject(model), envelope([poison_id], f"the {MARKER}"))
        await js.publish(work_subject(model), envelope(innocent_ids, "innocent"))
        pulled = await js.pull_subscribe_bind(consumer, WORK_STREAM)
        for delivery in range(1, MAX_DELIVER):
            messages = await pulled.fetch(2, timeout=5)
            assert sorted(m.metadata.num_delivered for m in messages) == [delivery] * 2
            if delivery < MAX_DELIVER - 1:
                for message in messages:
                    await message.nak()
        attempt = Attempt(poison_id, "an earlier worker", MAX_DELIVER - 1, now_ms())
        await mark_attempt(await ensure_attempts_kv(js), poison.seq, attempt)
        held = {m.metadata.sequence.stream: m for m in messages}
        await held.pop(poison.seq).nak()
        (innocent,) = held.values()
        return innocent

    async def collect(msg) -> None:
        for result in decode_results(msg.data).results:
            results.setdefault(result.request_id, result)

    async def run() -> RestartingWorker:
        nc = await connect(nats_server.url, name="test-quarantine")
        try:
            await nc.subscribe(reply_to, cb=collect)
            innocent = await burn(nc.jetstream())
            launcher = Launcher(
                tmp_path, env={"SHOAL_MAX_DELIVER": str(MAX_DELIVER), "SHOAL_ACK_WAIT": "2"}
            )
            worker = await asyncio.to_thread(
                RestartingWorker,
                launcher,
                nats_server.url,
                model,
                "--option",
                "crash_after_ms=1500",
            )
            try:
                await _held_until_ready(nats_server.url, worker, innocent)
                await asyncio.sleep(0.3)  # it pulled the poison's message: the culprit runs
                await innocent.nak()
                everyone = [poison_id, *innocent_ids]
                await wait_until_async(lambda: all(r in results for r in everyone), TIMEOUT_S)
            finally:
                await asyncio.to_thread(worker.stop)
                launcher.stop_all()
            return worker
        finally:
            await nc.close()

    worker = asyncio.run(run())
    for rid in innocent_ids:
        assert results[rid].status == 200, results[rid].body
        vector = json.loads(results[rid].body)["data"][0]["embedding"]
        np.testing.assert_allclose(vector, pseudo_embedding("innocent", 384), atol=1e-6)
    assert results[poison_id].status == 502 and b"dead_lettered" in results[poison_id].body
    assert len(worker.deaths) == 1  # the culprit's one, last, run


async def _held_until_ready(nats_url: str, worker: RestartingWorker, held: Msg) -> None:
    """Until the worker reports itself ready, `held` kept from redelivery (in-progress acks)."""
    pid = worker.current.pid
    while await asyncio.to_thread(worker_status, nats_url, pid, WorkerState.READY) is None:
        await held.in_progress()
        await asyncio.sleep(0.2)
