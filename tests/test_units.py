"""Unit tests where the unit is the point: pure functions and small classes."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from pathlib import Path

import msgspec
import numpy as np
import pytest

from shoal import process
from shoal.api.errors import ApiError
from shoal.catalog import resolve_model
from shoal.gateway.committer import GroupCommitter
from shoal.observability.metrics import BusyMeter
from shoal.process import FIRST_CHILD_PORT, free_port, free_ports
from shoal.protocol import (
    Endpoint,
    UniqueIds,
    WorkRequest,
    is_valid_model_name,
    name_token,
    work_subject,
)
from shoal.runtimes.base import EmbedOutput
from shoal.runtimes.sim import SimEmbeddingRuntime, pseudo_embedding, pseudo_token_embedding
from shoal.worker.items import WorkItem, take_batch
from shoal.worker.tasks.embed import EmbeddingsHandler


@pytest.mark.parametrize(
    "name", ["all-MiniLM-L6-v2", "Qwen2.5-0.5B", "org/model:v1", "a_b", "a_5fb"]
)
def test_name_token_is_a_safe_one_to_one_subject_token(name):
    token = name_token(name)
    assert all(c.isalnum() or c in "-_" for c in token)
    assert work_subject(name).count(".") == 2
    others = ["all-MiniLM-L6-v2", "Qwen2.5-0.5B", "org/model:v1", "a_b", "a_5fb", "a.b"]
    assert [o for o in others if name_token(o) == token] == [name]


def test_model_names_are_validated():
    assert is_valid_model_name("gemma-3-270m")
    assert not is_valid_model_name("has space")
    assert not is_valid_model_name("wild*card")
    assert not is_valid_model_name("")


def _item(cost: int) -> WorkItem:
    return WorkItem(
        message=None,
        request_id="r",
        reply_to="x",
        deadline_ms=0,
        sent_ms=0,
        cost=cost,
        endpoint=Endpoint.EMBEDDINGS,
    )  # type: ignore[arg-type]


def test_take_batch_respects_item_and_token_budgets():
    pending = deque(_item(c) for c in [10, 10, 10, 10, 10])
    assert len(take_batch(pending, max_items=3, max_tokens=1000)) == 3
    assert len(take_batch(pending, max_items=10, max_tokens=15)) == 1
    assert len(pending) == 1


def test_take_batch_runs_an_oversized_item_alone():
    pending = deque([_item(5000), _item(1)])
    batch = take_batch(pending, max_items=10, max_tokens=100)
    assert [i.cost for i in batch] == [5000]
    assert [i.cost for i in pending] == [1]


def test_take_batch_runs_a_known_culprit_after_everything_else_held():
    culprit, suspect, fresh = _item(1), _item(2), _item(3)
    culprit.deliveries, culprit.culprit = 4, True
    suspect.deliveries = 4
    pending = deque([culprit, fresh, suspect])
    batches = [take_batch(pending, max_items=10, max_tokens=100) for _ in range(3)]
    # The first-delivery item too: anything held when the culprit crashes is redelivered.
    assert [[i.cost for i in batch] for batch in batches] == [[3], [2], [1]]


def test_busy_meter_measures_the_share_of_the_window():
    now = [100.0]
    meter = BusyMeter(window_s=10, clock=lambda: now[0])
    now[0] = 110.0
    meter.start()
    now[0] = 112.5
    assert meter.stop() == pytest.approx(2.5)
    assert meter.fraction() == pytest.approx(0.25)
    meter.start()
    now[0] = 117.5  # 5 s more, still running
    assert meter.fraction() == pytest.approx(0.75)  # window 107.5-117.5: 2.5 + 5 of 10 s
    now[0] = 130.0
    meter.stop()
    assert meter.fraction() == pytest.approx(1.0)


def test_sim_runtime_follows_its_cost_model_and_is_deterministic():
    runtime = SimEmbeddingRuntime("s", {"batch_ms": 30, "token_us": 1000, "dimensions": 16})
    started = time.perf_counter()
    output = runtime.embed(["abcd", "abcdefgh"])  # 3 + 4 tokens
    elapsed = time.perf_counter() - started
    assert output.token_counts == [3, 4]
    assert elapsed >= 0.030 + 0.007
    assert runtime.batch_cost_seconds([3, 4]) == pytest.approx(0.037)
    np.testing.assert_array_equal(output.vectors[0], pseudo_embedding("abcd", 16))
    assert np.linalg.norm(output.vectors[1]) == pytest.approx(1.0, abs=1e-6)


class _RuntimeThatRejectsPoison:
    """A runtime whose model cannot take one particular text (as a real one may fail)."""

    simulated = True
    dimensions = 4
    name = "poison"

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def embed(self, texts: list[str]) -> EmbedOutput:
        self.calls.append(texts)
        if "poison" in texts:
            raise ValueError("cannot embed poison")
        return EmbedOutput(np.ones((len(texts), 4), dtype=np.float32), [1] * len(texts))

    def close(self) -> None:
        pass


def _body(value: object) -> bytes:
    return msgspec.json.encode({"model": "m", "input": value})


def test_handler_isolates_a_failing_item_and_invalid_items():
    runtime = _RuntimeThatRejectsPoison()
    outcome = EmbeddingsHandler(runtime, "m").handle(
        [_body("good"), _body("poison"), _body(["a", "b"]), b"{bad json", _body(3)]
    )
    assert [r.status for r in outcome.replies] == [200, 400, 200, 400, 400]
    assert runtime.calls[0] == ["good", "poison", "a", "b"]  # one batch first
    good = msgspec.json.decode(outcome.replies[2].body)
    assert [d["index"] for d in good["data"]] == [0, 1]
    assert good["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    assert "poison" in msgspec.json.decode(outcome.replies[1].body)["error"]["message"]


def test_api_error_body_is_openai_shaped():
    body = msgspec.json.decode(ApiError(429, "slow down", code="queue_full").body())
    assert body == {
        "error": {
            "message": "slow down",
            "type": "rate_limit_error",
            "param": None,
            "code": "queue_full",
        }
    }


def test_resolve_model_needs_a_runtime_for_unknown_names():
    with pytest.raises(ValueError, match="give --runtime"):
        resolve_model("my-model")
    # An empty runtime (a deploy request's `"runtime": ""`) is none, not an AttributeError.
    with pytest.raises(ValueError, match="give --runtime"):
        resolve_model("my-model", runtime="")
    spec = resolve_model("sim-embed", options={"batch_ms": 7})
    assert spec.runtime == "sim" and spec.options["batch_ms"] == 7


def test_nesting_guard_counts_structure_not_strings():
    from shoal.gateway.routing import MAX_NESTING, nesting_exceeds

    deep = b"[" * (MAX_NESTING + 1) + b"]" * (MAX_NESTING + 1)
    assert nesting_exceeds(deep, MAX_NESTING)
    assert not nesting_exceeds(b"[" * MAX_NESTING + b"]" * MAX_NESTING, MAX_NESTING)
    # Brackets inside strings, with escaped quotes before them, are text.
    in_string = b'{"input": "\\"' + b"[" * 1000 + b'\\" {{"}'
    assert not nesting_exceeds(in_string, MAX_NESTING)
    # Many brackets side by side are not deep.
    wide = b"[" + b"[1]," * 1000 + b"[1]]"
    assert not nesting_exceeds(wide, MAX_NESTING)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"ignored": ' + b"{" * 50_000 + b'"model": "m", "input": "x"}',  # not even valid
        b'{"model": "m", "x": ' + b'{"a":' * 200 + b"1" + b"}" * 200 + b"}",
    ],
)
def test_deep_nesting_is_a_400_not_a_recursion_error(body):
    from shoal.gateway.routing import read_routing_fields

    with pytest.raises(ApiError) as caught:
        read_routing_fields(body)
    assert caught.value.status == 400


# -- embeddings: token-id inputs and `dimensions` (issue 15 part 5) ------------------------


def _replies(handler: EmbeddingsHandler, *bodies: bytes) -> list[tuple[int, dict]]:
    outcome = handler.handle(list(bodies))
    return [(r.status, msgspec.json.decode(r.body)) for r in outcome.replies]


def test_token_id_inputs_in_every_form_openai_takes():
    runtime = SimEmbeddingRuntime("s", {"batch_ms": 0, "token_us": 0, "dimensions": 8})
    handler = EmbeddingsHandler(runtime, "s")
    replies = _replies(
        handler,
        _body([5, 6, 7]),  # one token-id input
        _body([[5, 6, 7], [9]]),  # a list of them
        _body(["a text", [9]]),  # texts and ids, each its own vector
        _body("a text"),
    )
    assert [status for status, _ in replies] == [200, 200, 200, 200]
    vectors = [[np.array(d["embedding"], np.float32) for d in r["data"]] for _, r in replies]
    np.testing.assert_array_equal(vectors[0][0], pseudo_token_embedding([5, 6, 7], 8))
    np.testing.assert_array_equal(vectors[1][0], vectors[0][0])
    np.testing.assert_array_equal(vectors[1][1], pseudo_token_embedding([9], 8))
    np.testing.assert_array_equal(vectors[2][0], pseudo_embedding("a text", 8))
    np.testing.assert_array_equal(vectors[2][1], vectors[1][1])
    np.testing.assert_array_equal(vectors[3][0], vectors[2][0])
    # One token per id: usage counts them.
    assert replies[1][1]["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ([32_000], "outside this model's vocabulary (0 to 31999)"),
        ([[1, 2], [-1]], "token id -1"),
        ([[]], "must not be an empty list"),
        ([1, "a"], "'input[0]' must be a string or a list of token ids"),
        ([[1, 2.5]], "'input[0]' must be a string or a list of token ids"),
        ([True, False], "'input[0]' must be a string or a list of token ids"),
        ([["a"]], "'input[0]' must be a string or a list of token ids"),
    ],
)
def test_bad_token_ids_are_openai_400s_on_input(value, words):
    runtime = SimEmbeddingRuntime("s", {"batch_ms": 0, "token_us": 0, "dimensions": 8})
    [(status, body)] = _replies(EmbeddingsHandler(runtime, "s"), _body(value))
    assert status == 400
    assert body["error"]["param"] == "input" and body["error"]["type"] == "invalid_request_error"
    assert words in body["error"]["message"]


def test_token_ids_on_a_runtime_without_them_are_a_clear_400():
    [(status, body)] = _replies(EmbeddingsHandler(_RuntimeThatRejectsPoison(), "m"), _body([1]))
    assert status == 400 and body["error"]["code"] == "token_ids_not_supported"
    assert body["error"]["param"] == "input" and "send 'input' as text" in body["error"]["message"]


def _dimensions_body(dimensions: int) -> bytes:
    return msgspec.json.encode({"model": "m", "input": ["x", "y"], "dimensions": dimensions})


def test_dimensions_shorten_only_declared_matryoshka_sizes():
    runtime = SimEmbeddingRuntime("s", {"batch_ms": 0, "token_us": 0, "dimensions": 16})
    handler = EmbeddingsHandler(runtime, "s", {"matryoshka_dimensions": [8, 4]})
    [(ok, body), (full, _), (bad, error)] = _replies(
        handler, _dimensions_body(4), _dimensions_body(16), _dimensions_body(6)
    )
    assert (ok, full, bad) == (200, 200, 400)
    got = np.array(body["data"][0]["embedding"], np.float32)
    prefix = pseudo_embedding("x", 16)[:4]
    np.testing.assert_allclose(got, prefix / np.linalg.norm(prefix), rtol=1e-6)
    assert error["error"]["param"] == "dimensions"
    assert "one of 16, 8, 4" in error["error"]["message"]
    # The option as `--option matryoshka_dimensions=8,4` gives it.
    assert EmbeddingsHandler(runtime, "s", {"matryoshka_dimensions": "8,4"}).shorter_dimensions == (
        8,
        4,
    )


def test_dimensions_on_a_model_not_trained_for_it_is_a_400():
    runtime = SimEmbeddingRuntime("s", {"batch_ms": 0, "token_us": 0, "dimensions": 16})
    [(status, body)] = _replies(EmbeddingsHandler(runtime, "s"), _dimensions_body(8))
    assert status == 400 and body["error"]["param"] == "dimensions"
    assert "not trained to be shortened" in body["error"]["message"]


def test_matryoshka_sizes_are_read_from_a_sentence_transformers_card(tmp_path):
    from shoal.runtimes.torch_st import card_matryoshka_dimensions

    assert card_matryoshka_dimensions(tmp_path) == ()  # no card
    (tmp_path / "README.md").write_text("# all-MiniLM-L6-v2\nMultipleNegativesRankingLoss\n")
    assert card_matryoshka_dimensions(tmp_path) == ()
    (tmp_path / "README.md").write_text(
        '### Loss\n[`MatryoshkaLoss`]\n```json\n{\n    "loss": "MultipleNegativesRankingLoss",'
        '\n    "matryoshka_dims": [\n        768,\n        512,\n        64\n    ],\n}\n```\n'
    )
    assert card_matryoshka_dimensions(tmp_path) == (768, 512, 64)


def test_unique_ids_differ_within_and_across_sources():
    first, second = UniqueIds(), UniqueIds()  # two gateway processes, or one restarted
    ids = [first.new() for _ in range(1000)] + [second.new() for _ in range(1000)]
    assert len(set(ids)) == len(ids)
    assert all(len(id_) == 32 and int(id_, 16) >= 0 for id_ in ids)  # 32 hex, as a uuid4's
    assert ids[0][:16] != ids[1000][:16]  # each source its own random prefix


def test_a_request_that_waits_only_for_its_reply_hears_a_refusal_and_nothing_else():
    """GroupCommitter.submit_nowait: a refused envelope's error lands on each request's reply
    future; a stored one leaves the futures to their replies; a dropped future is skipped."""
    refuse = {"envelope": True}
    published: list[bytes] = []

    async def publish(subject: str, payload: bytes, envelope_id: str) -> None:
        published.append(payload)
        await asyncio.sleep(0)
        if refuse["envelope"]:
            raise ApiError(429, "The queue for this model is full")

    async def run() -> None:
        loop = asyncio.get_running_loop()
        committer = GroupCommitter("_INBOX.gw", publish, lambda model: None)
        refused = [loop.create_future() for _ in range(3)]
        refused[2].cancel()  # its client left before the publish came back
        for i, future in enumerate(refused):
            committer.submit_nowait("m", _work_request(f"r{i}"), future)
        await asyncio.sleep(0.01)
        assert [f.exception().status for f in refused[:2]] == [429, 429]
        assert refused[2].cancelled()

        refuse["envelope"] = False
        stored = loop.create_future()
        committer.submit_nowait("m", _work_request("r3"), stored)
        await committer.submit("m", _work_request("r4"))  # the waiting kind: returns
        assert not stored.done()  # nothing but its reply may answer it

    asyncio.run(run())
    assert len(published) == 2  # the three refused went together, then r3 with r4


def _work_request(request_id: str) -> WorkRequest:
    return WorkRequest(request_id, Endpoint.EMBEDDINGS.value, 0, 1, b"{}")


def test_a_port_for_a_child_is_free_and_outside_the_ephemeral_range():
    """Outgoing connections take their local ports from the ephemeral range: a port handed
    to a child from below it cannot be taken by one before the child binds."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(FIRST_CHILD_PORT <= port < low for port in ports), ports
    for port in ports:  # each is free, as promised
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_ports_chosen_together_are_all_different(monkeypatch):
    """Each probe is held until all are chosen: even a picker that draws the same port
    every time hands it out once (picked one at a time, all three would be that port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        same = sock.getsockname()[1]  # a port known to be free once this closes
    monkeypatch.setattr(process.random, "randrange", lambda start, stop: same)
    ports = free_ports(3)
    assert ports[0] == same and len(set(ports)) == 3, ports
