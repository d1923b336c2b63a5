"""API keys on the inference routes (issue 14, part 1), against a real nats-server.

The unit-level tests drive `KeyDirectory` and `ApiKeyAuth` with keys made and revoked in a
real `shoal_keys` bucket, and the `shoal keys` subcommands as real processes. The end-to-end
tests start real gateways with keys required (and not) and a sim worker, and talk HTTP.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import timeit
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from conftest import TEST_ENV, Launcher, wait_until
from conftest import wait_until_async as until

from shoal.api.errors import ApiError
from shoal.broker.connection import connect
from shoal.broker.embedded import EmbeddedNats
from shoal.config import GatewaySettings
from shoal.gateway.app import Gateway
from shoal.gateway.auth import ApiKeyAuth, api_keys_required, is_loopback
from shoal.process import free_port
from shoal.runtimes.sim import pseudo_embedding
from shoal.state.keys import (
    ApiKeyError,
    KeyDirectory,
    create_key,
    ensure_keys_kv,
    key_id_of,
    list_keys,
    read_key,
    revoke_key,
)

T = TypeVar("T")


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory) -> Iterator[str]:
    """A private nats-server: these tests own its keys bucket."""
    server = EmbeddedNats(store_dir=tmp_path_factory.mktemp("keys-nats"))
    server.start()
    yield server.url
    server.stop()


def with_js(nats_url: str, body: Callable[..., Awaitable[T]]) -> T:
    """Run `body(js)` on a fresh connection."""

    async def run() -> T:
        nc = await connect(nats_url, name="test-keys")
        try:
            return await body(nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(run())


def bearer(secret: str) -> list[tuple[bytes, bytes]]:
    """ASGI headers as a real client sends them, the key among them."""
    return [
        (b"host", b"127.0.0.1:8000"),
        (b"content-type", b"application/json"),
        (b"authorization", f"Bearer {secret}".encode()),
    ]


def refused(auth: ApiKeyAuth, headers: list[tuple[bytes, bytes]], model: str) -> ApiError:
    with pytest.raises(ApiError) as caught:
        auth.check(headers, model)
    return caught.value


# -- the bucket --------------------------------------------------------------------------


def test_create_returns_the_secret_once_and_stores_only_its_hash(nats_url):
    async def body(js):
        record, secret = await create_key(js, "alice", ["m-a", "m-b", "m-a"])
        entry = await (await ensure_keys_kv(js)).get(record.id)
        return record, secret, entry.value, await read_key(js, record.id)

    record, secret, raw, stored = with_js(nats_url, body)
    assert secret.startswith(f"sk-shoal-{record.id}-") and key_id_of(secret) == record.id
    assert len(secret.removeprefix(f"sk-shoal-{record.id}-")) == 43  # 256 bits, base64url
    assert secret.encode() not in raw and secret.split("-", 3)[3].encode() not in raw
    assert stored is not None and stored.hash == hashlib.sha256(secret.encode()).hexdigest()
    assert stored.models == ("m-a", "m-b") and stored.name == "alice" and not stored.revoked


def test_create_refuses_bad_names_and_revoke_an_unknown_id(nats_url):
    async def body(js):
        for name, models in (("", []), ("x" * 129, []), ("ok", ["bad model!"])):
            with pytest.raises(ApiKeyError):
                await create_key(js, name, models)
        with pytest.raises(ApiKeyError, match="no API key"):
            await revoke_key(js, "0123456789ab")
        with pytest.raises(ApiKeyError, match="no API key"):
            await revoke_key(js, "../not-an-id")

    with_js(nats_url, body)


def test_revoke_keeps_the_record_and_list_shows_it(nats_url):
    async def body(js):
        record, _ = await create_key(js, "to-revoke")
        revoked = await revoke_key(js, record.id)
        again = await revoke_key(js, record.id)  # twice is not an error, and keeps the time
        return record, revoked, again, await list_keys(js)

    record, revoked, again, listed = with_js(nats_url, body)
    assert revoked.revoked and revoked.revoked_ms >= record.created_ms
    assert again.revoked_ms == revoked.revoked_ms
    assert next(k for k in listed if k.id == record.id).revoked


# -- the check -----------------------------------------------------------------------------


def test_check_none_wrong_revoked_right_and_another_model(nats_url):
    async def body(js):
        auth = ApiKeyAuth(KeyDirectory())
        await auth.start(js)
        try:
            everything, any_secret = await create_key(js, "any-model")
            limited, limited_secret = await create_key(js, "only-a", ["model-a"])
            await until(lambda: auth.directory.get(limited.id) is not None, 1)

            # Right: a key for every model, and a limited key on its own model.
            auth.check(bearer(any_secret), "model-a")
            auth.check(bearer(any_secret), "anything-else")
            auth.check(bearer(limited_secret), "model-a")
            assert auth.authenticate(bearer(limited_secret)) == limited.id

            # None: no header, another scheme, an empty bearer.
            for headers in (
                [(b"host", b"x")],
                [(b"authorization", b"Basic " + any_secret.encode())],
                [(b"authorization", b"Bearer ")],
            ):
                err = refused(auth, headers, "model-a")
                assert (err.status, err.code) == (401, "invalid_api_key")
                assert "didn't provide an API key" in err.message

            # Wrong: one character changed, an unknown id, not ours at all, far too long.
            tampered = any_secret[:-1] + ("A" if any_secret[-1] != "A" else "B")
            unknown = f"sk-shoal-000000000000-{any_secret.split('-', 3)[3]}"
            other_id = f"sk-shoal-{limited.id}-{any_secret.split('-', 3)[3]}"  # id swapped
            for secret in (tampered, unknown, other_id, "sk-proj-abc", "sk-shoal-" + "a" * 5000):
                err = refused(auth, bearer(secret), "model-a")
                assert (err.status, err.code) == (401, "invalid_api_key"), secret[:30]
                assert err.message == "Incorrect API key provided"

            # The scheme's case does not matter (RFC 7235); the secret's does.
            auth.check([(b"authorization", f"bearer {any_secret}".encode())], "model-a")

            # Another model than the allowlist: a 404, as OpenAI answers.
            err = refused(auth, bearer(limited_secret), "model-b")
            assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
            body = json.loads(err.body())
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert body["error"]["type"] == "invalid_request_error"

            # Revoked: refused from the next request on.
            await revoke_key(js, everything.id)
            await until(lambda: auth.directory.get(everything.id).revoked, 1)
            err = refused(auth, bearer(any_secret), "model-a")
            assert (err.status, err.code) == (401, "invalid_api_key")
            assert "revoked" in err.message
            auth.check(bearer(limited_secret), "model-a")  # other keys unaffected
        finally:
            await auth.stop()

    with_js(nats_url, body)


def test_the_401_body_is_openai_shaped(nats_url):
    async def body(js):
        auth = ApiKeyAuth()
        await auth.start(js)
        try:
            return refused(auth, [], "m")
        finally:
            await auth.stop()

    err = with_js(nats_url, body)
    assert json.loads(err.body()) == {
        "error": {
            "message": err.message,
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }


def test_before_the_keys_are_read_a_request_is_told_to_retry_not_refused():
    auth = ApiKeyAuth(KeyDirectory())  # never started: nothing is loaded
    err = refused(auth, bearer("sk-shoal-0123456789ab-x"), "m")
    assert err.status == 503 and err.retry_after


def test_an_unreadable_record_authorizes_nothing(nats_url):
    async def body(js):
        auth = ApiKeyAuth()
        await auth.start(js)
        try:
            record, secret = await create_key(js, "to-break")
            await until(lambda: auth.directory.get(record.id) is not None, 1)
            auth.check(bearer(secret), "m")
            await (await ensure_keys_kv(js)).put(record.id, b"{not json")
            await until(lambda: auth.directory.get(record.id) is None, 1)
            return refused(auth, bearer(secret), "m")
        finally:
            await auth.stop()

    assert with_js(nats_url, body).status == 401


def test_a_revoke_reaches_every_gateway_within_a_second(nats_url):
    """Three directories on three connections, as three gateways hold them."""

    async def body(js):
        connections = [await connect(nats_url, name=f"gw-{i}") for i in range(3)]
        auths = [ApiKeyAuth() for _ in connections]
        try:
            for auth, nc in zip(auths, connections, strict=True):
                await auth.start(nc.jetstream())
            record, secret = await create_key(js, "shared")
            for auth in auths:
                await until(lambda a=auth: a.directory.get(record.id) is not None, 1)
                auth.check(bearer(secret), "m")
            await revoke_key(js, record.id)
            waits = []
            for auth in auths:
                waits.append(await until(lambda a=auth: a.directory.get(record.id).revoked, 1))
                assert refused(auth, bearer(secret), "m").status == 401
            return waits
        finally:
            for auth in auths:
                await auth.stop()
            for nc in connections:
                await nc.close()

    waits = with_js(nats_url, body)
    assert max(waits) < 1.0


def test_a_gateway_started_after_the_keys_holds_them_before_serving(nats_url):
    async def body(js):
        _, secret = await create_key(js, "early")
        gone, gone_secret = await create_key(js, "early-revoked")
        await revoke_key(js, gone.id)
        auth = ApiKeyAuth()
        await auth.start(js)  # returns once the bucket's keys are held
        try:
            auth.check(bearer(secret), "m")  # no wait: already loaded
            assert refused(auth, bearer(gone_secret), "m").status == 401
            assert auth.directory.active_count() == len(
                [k for k in await list_keys(js) if not k.revoked]
            )
        finally:
            await auth.stop()

    with_js(nats_url, body)


def test_a_check_is_a_few_microseconds(nats_url):
    """No NATS round trip per request: the check is a lookup and one hash, in memory."""

    async def body(js):
        auth = ApiKeyAuth()
        await auth.start(js)
        try:
            for i in range(200):  # many keys: the cost does not grow with them
                await create_key(js, f"bulk-{i}")
            record, secret = await create_key(js, "timed", ["model-a"])
            await until(lambda: auth.directory.get(record.id) is not None, 2)
            headers = bearer(secret)
            n = 20_000
            return timeit.timeit(lambda: auth.check(headers, "model-a"), number=n) / n
        finally:
            await auth.stop()

    per_check = with_js(nats_url, body)
    print(f"ApiKeyAuth.check: {per_check * 1e6:.2f} us/request")
    assert per_check < 100e-6  # measured ~2 us; a NATS round trip alone is ~100 us


# -- the policy ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.53", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.1.2.3", False),
        ("gateway.internal", False),  # a name may resolve to any interface
    ],
)
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


def test_keys_are_required_off_loopback_unless_turned_off():
    assert api_keys_required("auto", "0.0.0.0") and api_keys_required("auto", "10.0.0.5")
    assert not api_keys_required("auto", "127.0.0.1")
    assert api_keys_required("required", "127.0.0.1")
    assert not api_keys_required("off", "0.0.0.0")
    with pytest.raises(ValueError):
        api_keys_required("maybe", "127.0.0.1")


# -- the CLI ---------------------------------------------------------------------------------

SHOAL = [sys.executable, "-m", "shoal"]


def keys_cli(nats_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`shoal keys ARGS --nats URL` as a real process."""
    return subprocess.run(
        [*SHOAL, "keys", *args, "--nats", nats_url], capture_output=True, text=True, timeout=60
    )


def test_cli_create_list_revoke(nats_url):
    made = keys_cli(nats_url, "create", "--name", "cli-user", "--model", "m1", "--model", "m2")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.split()[-1]
    key_id = key_id_of(secret)
    assert key_id is not None and f"created key {key_id} (cli-user)" in made.stdout
    assert "shown only once" in made.stderr

    listed = keys_cli(nats_url, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert secret not in listed.stdout and "hash" not in listed.stdout
    row = {k["id"]: k for k in json.loads(listed.stdout)}[key_id]
    assert row["name"] == "cli-user" and row["models"] == ["m1", "m2"] and not row["revoked"]
    table = keys_cli(nats_url, "list")
    assert any(line.startswith(key_id) and "active" in line for line in table.stdout.splitlines())

    revoked = keys_cli(nats_url, "revoke", key_id)
    assert revoked.returncode == 0 and f"revoked {key_id}" in revoked.stdout
    row = {k["id"]: k for k in json.loads(keys_cli(nats_url, "list", "--json").stdout)}[key_id]
    assert row["revoked"] and row["revoked_ms"] > 0

    missing = keys_cli(nats_url, "revoke", "0123456789ab")
    assert missing.returncode == 1 and "no API key" in missing.stderr
    as_json = json.loads(keys_cli(nats_url, "create", "--name", "j", "--json").stdout)
    assert key_id_of(as_json["secret"]) == as_json["id"] and "hash" not in as_json


# -- end to end: real gateways ---------------------------------------------------------------

SIM = ["--runtime", "sim", "--option", "batch_ms=1"]


@pytest.fixture(scope="module")
def cluster(nats_url, tmp_path_factory) -> Iterator[tuple[Launcher, str]]:
    """Two sim models served by one worker each, on the private NATS."""
    launcher = Launcher(tmp_path_factory.mktemp("keys-e2e"))
    try:
        launcher.worker(nats_url, "keys-a", *SIM)
        launcher.worker(nats_url, "keys-b", *SIM)
        yield launcher, nats_url
    finally:
        launcher.stop_all()


def embed(url: str, model: str, secret: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return httpx.post(
        f"{url}/v1/embeddings", json={"model": model, "input": "hi"}, headers=headers, timeout=30
    )


def create(nats_url: str, *args: str) -> str:
    made = keys_cli(nats_url, "create", *args, "--json")
    assert made.returncode == 0, made.stderr
    return json.loads(made.stdout)["secret"]


def test_a_gateway_that_requires_keys(cluster):
    launcher, nats_url = cluster
    gateway, url = launcher.gateway(nats_url, "--require-api-keys")
    any_model = create(nats_url, "--name", "e2e-any")
    only_a = create(nats_url, "--name", "e2e-only-a", "--model", "keys-a")

    # None and wrong: 401 in OpenAI's shape.
    for secret in (None, any_model[:-2] + "zz"):
        response = embed(url, "keys-a", secret)
        assert response.status_code == 401, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "invalid_api_key"

    # Right: the worker's answer.
    for secret, model in ((any_model, "keys-a"), (any_model, "keys-b"), (only_a, "keys-a")):
        response = embed(url, model, secret)
        assert response.status_code == 200, response.text
        vector = response.json()["data"][0]["embedding"]
        assert vector == pytest.approx(pseudo_embedding("hi", 384).tolist(), abs=1e-6)

    # Another model than the allowlist: 404, the same for a model that exists and one that
    # does not, so a key cannot probe what else is deployed.
    for model in ("keys-b", "no-such-model"):
        response = embed(url, model, only_a)
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "model_not_found"

    # Every inference route needs a key, whatever the body (checked on the headers alone).
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/rerank"):
        response = httpx.post(f"{url}{route}", json={"model": "keys-a"}, timeout=30)
        assert response.status_code == 401, (route, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
    # The allowlist holds on every route, before the route's own checks.
    response = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "keys-b", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {only_a}"},
        timeout=30,
    )
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"

    # /v1/models needs a key too, and lists what the key may use.
    assert httpx.get(f"{url}/v1/models").status_code == 401
    listed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {only_a}"})
    assert [m["id"] for m in listed.json()["data"]] == ["keys-a"]
    listed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {any_model}"})
    assert {"keys-a", "keys-b"} <= {m["id"] for m in listed.json()["data"]}

    # Probes and metrics stay open: orchestrators call them without keys.
    assert httpx.get(f"{url}/healthz").status_code == 200
    assert httpx.get(f"{url}/readyz").status_code == 200
    metrics = httpx.get(f"{url}/metrics")
    assert metrics.status_code == 200 and 'status="401"' in metrics.text

    # Revoked: refused within a second, by the running gateway, with no restart.
    key_id = key_id_of(any_model)
    revoked = keys_cli(nats_url, "revoke", key_id)
    assert revoked.returncode == 0, revoked.stderr
    began = time.monotonic()
    wait_until(lambda: embed(url, "keys-a", any_model).status_code == 401, 1.0, gateway)
    assert time.monotonic() - began < 1.0
    assert embed(url, "keys-a", only_a).status_code == 200

    # No secret on the gateway's command line: it reads none from flags.
    cmdline = Path(f"/proc/{gateway.pid}/cmdline").read_bytes()
    assert b"sk-shoal-" not in cmdline


# A host that is no loopback address literal, so the gateway treats it as reachable from
# elsewhere (it resolves no names), as it does 0.0.0.0; the server resolves it to 127.0.0.1,
# so the test listens on loopback only and exposes nothing on a shared machine.
NOT_A_LOOPBACK_LITERAL = "127.1"


def test_off_loopback_keys_are_required_unless_no_auth(cluster):
    launcher, nats_url = cluster
    _, open_url = launcher.gateway(nats_url)  # loopback, the default: no key needed
    _, exposed_url = launcher.gateway(nats_url, "--host", NOT_A_LOOPBACK_LITERAL)
    _, no_auth_url = launcher.gateway(nats_url, "--host", NOT_A_LOOPBACK_LITERAL, "--no-auth")
    secret = create(nats_url, "--name", "e2e-policy")

    # Keys existing does not switch checking on: loopback stays open unless asked.
    assert embed(open_url, "keys-a").status_code == 200
    assert embed(exposed_url, "keys-a").status_code == 401
    assert embed(exposed_url, "keys-a", secret).status_code == 200
    assert embed(no_auth_url, "keys-a").status_code == 200


@pytest.mark.parametrize(
    ("host", "mode", "checks"),
    [
        ("0.0.0.0", "auto", True),
        ("::", "auto", True),
        ("10.1.2.3", "auto", True),
        ("127.0.0.1", "auto", False),
        ("127.0.0.1", "required", True),
        ("0.0.0.0", "off", False),
    ],
)
def test_the_gateway_checks_keys_by_its_settings(host, mode, checks):
    """The settings as the gateway reads them, for addresses a test must not listen on."""
    gateway = Gateway(GatewaySettings(nats_url="nats://127.0.0.1:1", host=host, api_keys=mode))
    assert (gateway.auth is not None) is checks


def test_require_and_no_auth_cannot_be_combined():
    result = subprocess.run(
        [*SHOAL, "gateway", "--nats", "nats://127.0.0.1:1", "--require-api-keys", "--no-auth"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "not allowed with" in result.stderr


# -- secrets never in argv -------------------------------------------------------------------


def admin_models(url: str, token: str) -> int:
    response = httpx.get(
        f"{url}/admin/models", headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    return response.status_code


def test_the_admin_token_from_a_file_or_the_environment_not_argv(cluster, tmp_path):
    launcher, nats_url = cluster
    from_file = "file-token-" + "x" * 24
    token_file = tmp_path / "admin-token"
    token_file.write_text(from_file + "\n")  # a trailing newline, as editors write it
    token_file.chmod(0o600)
    by_file, file_url = launcher.gateway(nats_url, "--admin-token-file", str(token_file))
    from_env = "env-token-" + "y" * 24
    env_launcher = Launcher(tmp_path, env={"SHOAL_ADMIN_TOKEN": from_env})
    try:
        by_env, env_url = env_launcher.gateway(nats_url)

        assert admin_models(file_url, from_file) == 200
        assert admin_models(file_url, from_file + "z") == 401
        assert admin_models(env_url, from_env) == 200
        assert admin_models(env_url, from_file) == 401
        for process, token in ((by_file, from_file), (by_env, from_env)):
            assert token.encode() not in Path(f"/proc/{process.pid}/cmdline").read_bytes()
    finally:
        env_launcher.stop_all()


def test_an_unreadable_admin_token_file_is_a_clear_error(tmp_path):
    for path, expected in ((tmp_path / "missing", "cannot read"), (tmp_path / "empty", "empty")):
        if expected == "empty":
            path.write_text("\n")
        result = subprocess.run(
            [*SHOAL, "gateway", "--nats", "nats://127.0.0.1:1", "--admin-token-file", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1 and expected in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


# -- `shoal up` end to end -------------------------------------------------------------------


def test_shoal_up_passes_require_api_keys_and_keys_find_the_local_cluster(tmp_path):
    """`shoal up --require-api-keys`, then `shoal keys` with no --nats: the local cluster."""
    env = {**os.environ, **TEST_ENV, "SHOAL_STATE_DIR": str(tmp_path / "state")}
    env.pop("SHOAL_NATS", None)
    port = free_port()
    log_path = tmp_path / "up.log"
    with log_path.open("wb") as log:
        up = subprocess.Popen(
            [*SHOAL, "up", "--model", "sim-embed", "--port", str(port), "--require-api-keys"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"

    def shoal_keys(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*SHOAL, "keys", *args], env=env, capture_output=True, text=True, timeout=60
        )

    try:
        wait_until(lambda: "Ctrl-C" in log_path.read_text(errors="replace"), 120)
        assert embed(url, "sim-embed").status_code == 401  # on loopback, as asked
        made = shoal_keys("create", "--name", "up-user", "--model", "sim-embed", "--json")
        assert made.returncode == 0, made.stderr
        secret = json.loads(made.stdout)["secret"]
        response = embed(url, "sim-embed", secret)
        assert response.status_code == 200, response.text
        vector = response.json()["data"][0]["embedding"]
        assert vector == pytest.approx(pseudo_embedding("hi", 384).tolist(), abs=1e-6)
        listed = json.loads(shoal_keys("list", "--json").stdout)
        assert [k["name"] for k in listed] == ["up-user"]
        assert shoal_keys("revoke", listed[0]["id"]).returncode == 0
        wait_until(lambda: embed(url, "sim-embed", secret).status_code == 401, 5)
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
    assert up.returncode == 0, log_path.read_text(errors="replace")
