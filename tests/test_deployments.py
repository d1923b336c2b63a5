"""Deploy, use and undeploy over the CLI and the admin HTTP API, on a running cluster.

A private nats-server, one gateway with an admin token, and one fleet worker that starts with
no model: every model it serves, it loaded because it was deployed and requested.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from conftest import Launcher, wait_until

from shoal.broker.embedded import EmbeddedNats
from shoal.runtimes.sim import pseudo_embedding

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("deployments")
    nats = EmbeddedNats(store_dir=tmp / "nats")
    nats.start()
    launcher = Launcher(tmp, env={"SHOAL_ADMIN_TOKEN": TOKEN})
    try:
        _, url = launcher.gateway(nats.url)
        launcher.spawn("worker", "--nats", nats.url, "--fleet", "--idle-unload", "0")
        yield nats.url, url
    finally:
        launcher.stop_all()
        nats.stop()


def shoal(nats_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoal", *args, "--nats", nats_url],
        capture_output=True,
        text=True,
        timeout=60,
    )


def embed(url: str, model: str, text: str, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": text}, timeout=timeout)


def models_json(nats_url: str) -> dict[str, dict]:
    result = shoal(nats_url, "models", "--json")
    assert result.returncode == 0, result.stderr
    return {view["name"]: view for view in json.loads(result.stdout)}


def test_deploy_use_undeploy_over_the_cli(cluster):
    nats_url, url = cluster
    result = shoal(nats_url, "deploy", "cli-model", "--runtime", "sim", "--option", "batch_ms=1")
    assert result.returncode == 0, result.stderr
    assert "deployed cli-model" in result.stdout

    # Nobody had it loaded: the fleet worker sees the backlog and loads it.
    response = embed(url, "cli-model", "hello fleet")
    assert response.status_code == 200, response.text
    vector = response.json()["data"][0]["embedding"]
    assert vector == pytest.approx(pseudo_embedding("hello fleet", 384).tolist(), abs=1e-6)

    view = wait_until(
        lambda: (v := models_json(nats_url).get("cli-model")) and v["workers_ready"] == 1 and v,
        10,
    )
    assert view["runtime"] == "sim" and view["simulated"] is True
    assert view["max_batch_items"] > 0  # profiled on first load: no batch flag was given
    assert view["backlog"] == 0

    result = shoal(nats_url, "undeploy", "cli-model")
    assert result.returncode == 0, result.stderr
    wait_until(lambda: embed(url, "cli-model", "x").status_code == 404, 5)
    wait_until(lambda: "cli-model" not in models_json(nats_url), 5)
    again = shoal(nats_url, "undeploy", "cli-model")
    assert again.returncode != 0 and "no deployment named 'cli-model'" in again.stderr


def test_deploy_use_undeploy_over_http(cluster):
    _, url = cluster
    body = {"runtime": "sim", "task": "embeddings", "options": {"batch_ms": 1}}
    created = httpx.put(f"{url}/admin/models/http-model", json=body, headers=AUTH)
    assert created.status_code == 200, created.text
    assert created.json()["name"] == "http-model"

    assert embed(url, "http-model", "over http").status_code == 200
    listed = httpx.get(f"{url}/admin/models", headers=AUTH).json()["data"]
    assert "http-model" in {view["name"] for view in listed}

    deleted = httpx.delete(f"{url}/admin/models/http-model", headers=AUTH)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    wait_until(lambda: embed(url, "http-model", "x").status_code == 404, 5)
    missing = httpx.delete(f"{url}/admin/models/http-model", headers=AUTH)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    # No name at all (found by tests/test_fuzz.py: it was a 503 from an empty KV key).
    nameless = httpx.delete(f"{url}/admin/models/", headers=AUTH)
    assert nameless.status_code == 404, nameless.text
    assert nameless.json()["error"]["code"] == "model_not_found"
    # An unknown model with an empty runtime (found by tests/test_fuzz.py: it was a 500).
    empty = httpx.put(f"{url}/admin/models/fuzzed", json={"runtime": ""}, headers=AUTH)
    assert empty.status_code == 400, empty.text
    assert empty.json()["error"]["code"] == "invalid_deployment"


def test_admin_api_needs_the_token(cluster, gateway_url):
    _, url = cluster
    assert httpx.get(f"{url}/admin/models").status_code == 401
    wrong = httpx.get(f"{url}/admin/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_admin_token"
    # The session's gateway was started without a token: its admin API is off.
    off = httpx.get(f"{gateway_url}/admin/models", headers=AUTH)
    assert off.status_code == 403
    assert "--admin-token" in off.json()["error"]["message"]


INVALID = [
    (["--runtime", "nope"], "unknown runtime 'nope'"),
    (["--runtime", "torch", "--source", "/does/not/exist"], "does not exist"),
    (["--runtime", "torch"], "needs a source"),
    (["--runtime", "llamacpp", "--source", "/tmp"], "serves generate, not embeddings"),
    (["--runtime", "torch", "--source", "package:no_such_weights_pkg"], "is not installed"),
]


@pytest.mark.parametrize(("flags", "message"), INVALID)
def test_invalid_specs_are_refused_and_nothing_is_written(cluster, flags, message):
    nats_url, url = cluster
    result = shoal(nats_url, "deploy", "bad-model", *flags)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr

    body = {"runtime": flags[1], **({"source": flags[3]} if len(flags) > 2 else {})}
    response = httpx.put(f"{url}/admin/models/bad-model", json=body, headers=AUTH)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert "bad-model" not in models_json(nats_url)
    assert embed(url, "bad-model", "x").status_code == 404


def test_invalid_names_and_fields_are_refused(cluster):
    nats_url, url = cluster
    result = shoal(nats_url, "deploy", "bad name!", "--runtime", "sim")
    assert result.returncode != 0 and "invalid model name" in result.stderr
    unknown_field = httpx.put(
        f"{url}/admin/models/x", json={"runtime": "sim", "colour": "red"}, headers=AUTH
    )
    assert unknown_field.status_code == 400
    bad_task = httpx.put(
        f"{url}/admin/models/x", json={"runtime": "sim", "task": "dance"}, headers=AUTH
    )
    assert bad_task.status_code == 400
    assert "x" not in models_json(nats_url)
