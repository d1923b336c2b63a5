"""Every error case gets its status and an OpenAI-shaped body; a bad item fails only itself."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import deploy_without_workers, wait_until, worker_status

from shoal.broker.embedded import EmbeddedNats
from shoal.config import QueueSettings
from shoal.process import free_port
from shoal.protocol import ModelSpec
from shoal.runtimes.sim import pseudo_embedding


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.fixture(scope="module")
def sim_model(nats_server, session_launcher) -> str:
    model = "sim-errors"
    session_launcher.worker(
        nats_server.url,
        model,
        "--runtime",
        "sim",
        "--option",
        "batch_ms=30",
        "--max-batch-items",
        "32",
    )
    return model


def test_unknown_model_is_404(gateway_url):
    response = httpx.post(f"{gateway_url}/v1/embeddings", json={"model": "nope", "input": "x"})
    error = assert_openai_error(response, 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"input": "x"}', "'model' is required"),
        (b'{"model": 5, "input": "x"}', "Expected `str`"),
    ],
)
def test_gateway_rejects_what_it_cannot_route(gateway_url, body, needle):
    response = httpx.post(f"{gateway_url}/v1/embeddings", content=body)
    assert needle in assert_openai_error(response, 400)["message"]


@pytest.mark.parametrize(
    ("body", "needle", "param"),
    [
        ({"input": 5}, "Expected `str | array`", "input"),
        ({"input": []}, "must not be empty", "input"),
        ({"input": ["ok", ""]}, "input[1]", "input"),
        ({"input": [[1, 2, 32000]]}, "outside this model's vocabulary", "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
        ({"input": "x", "dimensions": 12}, "'dimensions' must be 384", "dimensions"),
        ({}, "missing required field `input`", None),
    ],
)
def test_worker_validation_message_is_passed_through(gateway_url, sim_model, body, needle, param):
    response = httpx.post(f"{gateway_url}/v1/embeddings", json={"model": sim_model, **body})
    error = assert_openai_error(response, 400)
    assert needle in error["message"]
    assert error["param"] == param


def test_bad_item_does_not_fail_its_batch(nats_server, gateway_url, sim_model):
    good = [f"good {i}" for i in range(24)]

    async def send() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=gateway_url, timeout=30) as client:

            def post(body: dict):
                return client.post("/v1/embeddings", json={"model": sim_model, **body})

            goods = [post({"input": text}) for text in good]
            bads = [post({"input": ["fine", 7]}) for _ in range(8)]
            results = await asyncio.gather(*goods, *bads)
            return list(results[: len(good)]), list(results[len(good) :])

    before = worker_status(nats_server.url, _sim_worker_pid(nats_server.url, sim_model))
    goods, bads = asyncio.run(send())
    for text, response in zip(good, goods, strict=True):
        assert response.status_code == 200, response.text
        assert response.json()["data"][0]["embedding"] == pytest.approx(
            pseudo_embedding(text, 384).tolist(), abs=1e-6
        )
    for response in bads:
        assert "input[1]" in assert_openai_error(response, 400)["message"]
    # The good and bad items were in shared batches, not each alone.
    after = wait_until(
        lambda: (
            (s := worker_status(nats_server.url, before.pid))
            and s.items_done >= before.items_done + 32
            and s
        ),
        10,
    )
    assert after.largest_batch > 1


def _sim_worker_pid(nats_url: str, model: str) -> int:
    from conftest import worker_statuses

    return next(s.pid for s in worker_statuses(nats_url) if s.model == model)


def test_body_over_limit_is_413(gateway_url, sim_model):
    body = {"model": sim_model, "input": "x" * (300 * 1024)}
    assert_openai_error(httpx.post(f"{gateway_url}/v1/embeddings", json=body), 413)


def test_wrong_method_and_path(gateway_url):
    assert_openai_error(httpx.get(f"{gateway_url}/v1/embeddings"), 405)
    assert_openai_error(httpx.post(f"{gateway_url}/v1/nothing", json={}), 404)


def test_full_queue_is_429_then_deadlines_are_504(tmp_path, launcher):
    """A tiny queue with no worker: overflow gets 429 + Retry-After, the queued get 504,
    and a worker that starts later answers the expired items 504 without computing them."""
    with EmbeddedNats(store_dir=tmp_path / "nats") as nats:
        model = "sim-nobody"
        queue = QueueSettings(max_queued_per_model=3)
        deploy_without_workers(nats.url, ModelSpec(name=model, runtime="sim"), queue)
        _, url = launcher.gateway(nats.url, "--request-timeout", "1.5")

        async def flood() -> list[httpx.Response]:
            # The limit counts queued messages, and requests that reach a gateway together
            # share one (group commit): 50 ms apart, each request is a message of its own.
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                body = {"model": model, "input": "waiting"}
                sent = []
                for _ in range(8):
                    sent.append(asyncio.create_task(client.post("/v1/embeddings", json=body)))
                    await asyncio.sleep(0.05)
                return list(await asyncio.gather(*sent))

        responses = asyncio.run(flood())
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [429] * 5 + [504] * 3, statuses
        for response in responses:
            error = assert_openai_error(response, response.status_code)
            if response.status_code == 429:
                assert int(response.headers["retry-after"]) >= 1
                assert error["type"] == "rate_limit_error"

        worker = launcher.worker(nats.url, model, "--runtime", "sim")
        status = wait_until(
            lambda: (s := worker_status(nats.url, worker.pid)) and s.items_done == 3 and s, 10
        )
        assert status.batches == 0  # expired items were answered without compute
        metrics = httpx.get(status.metrics_url).text
        assert (
            'shoal_worker_items_total{model="sim-nobody",runtime="sim",status="504"} 3.0' in metrics
        )
        launcher.stop_all()


def test_no_nats_is_503(tmp_path, launcher):
    nats = EmbeddedNats(store_dir=tmp_path / "nats")
    nats.start()
    model = "sim-gone"
    deploy_without_workers(nats.url, ModelSpec(name=model, runtime="sim"))
    _, url = launcher.gateway(nats.url)
    nats.stop()
    wait_until(lambda: httpx.get(f"{url}/readyz").status_code == 503, 10)
    response = httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": "x"}, timeout=10)
    assert_openai_error(response, 503)
    assert "retry-after" in response.headers


def test_gateway_without_nats_starts_and_answers_503(launcher):
    _, url = launcher.gateway(f"nats://127.0.0.1:{free_port()}", ready=False)
    assert_openai_error(httpx.get(f"{url}/readyz"), 503)
    response = httpx.post(f"{url}/v1/embeddings", json={"model": "m", "input": "x"})
    # Without NATS the gateway cannot know which models exist: 503, not 404.
    assert_openai_error(response, 503)
    assert "retry-after" in response.headers
