"""NATS credentials and permissions (issue 14): a real nats-server with the roles `shoal up`
gives it, real connections doing each role's job, and each refused what it must not do.

A refused publish or subscription does not raise in the client: the server drops it and says
so on the connection (`Permissions Violation`). So each "refused" check looks at what happened
(nothing delivered, nothing stored, nothing changed) and at the server's word for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path

import httpx
import nats
import nats.errors
import numpy as np
import pytest
from conftest import TEST_ENV, wait_until
from nats.aio.client import Client
from nats.js.api import ConsumerConfig

from shoal.broker.connection import auth_options
from shoal.broker.dlq import DLQ_STREAM, dead_letter
from shoal.broker.embedded import EmbeddedNats
from shoal.broker.jetstream import ensure_model_consumer, ensure_work_stream, read_backlog
from shoal.broker.publish import publish_work
from shoal.broker.puller import Puller
from shoal.cluster_auth import (
    ADMIN,
    GATEWAY,
    ROLES,
    WORKER,
    ClusterCredentials,
    create_cluster_credentials,
)
from shoal.config import NatsAuth, QueueSettings
from shoal.process import free_port
from shoal.protocol import (
    WORK_STREAM,
    ModelSpec,
    Task,
    cancel_subject,
    consumer_name,
    encode_json,
    name_token,
    reply_subject,
    work_subject,
)
from shoal.runtimes.sim import pseudo_embedding
from shoal.state.attempts import ensure_attempts_kv
from shoal.state.deployments import (
    MODELS_BUCKET,
    DeploymentError,
    ModelDirectory,
    deploy,
    read_deployment,
)
from shoal.state.keys import KEYS_BUCKET, KeyDirectory, ensure_keys_kv
from shoal.state.profiles import ensure_profiles_kv
from shoal.state.workers import ensure_workers_kv

MODEL = ModelSpec(name="secure-sim", runtime="sim", task=Task.EMBEDDINGS, source="sim")
# A refused JetStream request gets no answer: how long to wait for the one that never comes.
REFUSED_TIMEOUT_S = 2.0
# A delivered message's callback runs within this, once its connection has read it.
DELIVERY_WAIT_S = 0.2
DELIVERY_PATIENCE_S = 2.0


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ClusterCredentials]]:
    """A nats-server with `shoal up`'s users, the work stream, a deployment and every bucket."""
    base = tmp_path_factory.mktemp("secured")
    credentials = create_cluster_credentials(base / "nats-auth")
    server = EmbeddedNats(store_dir=base / "store", config_file=credentials.config_file)
    url = server.start()

    async def prepare() -> None:
        nc = await _connect(url, credentials.auth(ADMIN))
        js = nc.jetstream()
        await deploy(js, MODEL, QueueSettings())
        for ensure in (ensure_workers_kv, ensure_keys_kv, ensure_profiles_kv, ensure_attempts_kv):
            await ensure(js)
        await nc.close()

    asyncio.run(prepare())
    yield url, credentials
    server.stop()


class Errors(list[str]):
    """The asynchronous errors the server sent one connection."""

    def violations(self) -> list[str]:
        return [e for e in self if "permissions violation" in e.lower()]


async def _connect(url: str, auth: NatsAuth | None, errors: Errors | None = None) -> Client:
    """One attempt, no reconnects: a refused connection raises here."""

    async def on_error(err: Exception) -> None:
        if errors is not None:
            errors.append(str(err))

    return await nats.connect(
        url,
        name="test",
        allow_reconnect=False,
        connect_timeout=2,
        error_cb=on_error,
        **auth_options(url, auth or NatsAuth()),
    )


async def _as(url: str, credentials: ClusterCredentials, role: str) -> tuple[Client, Errors]:
    errors = Errors()
    return await _connect(url, credentials.auth(role), errors), errors


async def _handled(nc: Client) -> None:
    """Return once the server has handled every command `nc` was given so far.

    nats.py's `flush()` alone does not promise that: it writes its PING straight to the
    socket, while a SUB or PUB given just before still waits in the buffer its flusher task
    writes, so the PONG can come before the server has seen them (nats.py 2.16, `_send_ping`).
    Then a subscription could still be unknown to the server when another connection
    publishes, and the message went nowhere (core NATS keeps nothing for a subject without
    subscribers): about one in eight of the worker's first answers in the test below. Once
    the flusher has emptied the buffer the PING goes behind those commands, and a server
    answers one connection's commands in order.
    """
    deadline = asyncio.get_running_loop().time() + DELIVERY_PATIENCE_S
    while nc.pending_data_size and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0)  # the flusher task runs
    await nc.flush()


async def _received(
    receiver: Client, subject: str, sender: Client, data: bytes, publish_to: str = ""
) -> list[bytes]:
    """What `receiver`, subscribed to `subject`, gets when `sender` publishes `data` (to
    `publish_to`, default the same subject).

    Deterministic, not a guess at a delay: the subscription is known to the server before the
    publish, the publish has been handled (and any delivery queued) before the receiver's
    round trip, and that delivery has been read once the round trip is back, since a server
    writes to a connection in order.
    """
    got: list[bytes] = []

    async def on_msg(msg) -> None:
        got.append(msg.data)

    sub = await receiver.subscribe(subject, cb=on_msg)
    await _handled(receiver)
    await sender.publish(publish_to or subject, data)
    await _handled(sender)
    await _handled(receiver)
    # For the subscription's callback to run: at least DELIVERY_WAIT_S (a refused message
    # must have had its chance), longer while nothing came (a loaded machine).
    waited = 0.0
    while waited < DELIVERY_WAIT_S or (not got and waited < DELIVERY_PATIENCE_S):
        await asyncio.sleep(0.05)
        waited += 0.05
    await sub.unsubscribe()
    return got


async def _refused(call: Awaitable[object]) -> None:
    """A JetStream request the server drops: no answer comes."""
    with pytest.raises((nats.errors.Error, TimeoutError)):
        await call


def _assert_refused_by_server(errors: Errors, *expected: str) -> None:
    """The server said it refused each of these (nats.py lower-cases its messages)."""
    said = "\n".join(errors.violations())
    for words in expected:
        assert words in said, f"{words!r} not refused; the server said:\n{said}"


async def _put(js, bucket: str, key: str, value: bytes) -> None:
    await (await js.key_value(bucket)).put(key, value)


def _run(coroutine: Awaitable[object]) -> None:
    asyncio.run(coroutine)  # type: ignore[arg-type]


def test_credentials_are_files_only_this_user_reads(secured):
    _, credentials = secured
    assert stat.S_IMODE(credentials.directory.stat().st_mode) == 0o700
    for path in [credentials.config_file, *(credentials.password_file(r) for r in ROLES)]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    passwords = {credentials.auth(role).password for role in ROLES}
    assert len(passwords) == len(ROLES) and all(len(p) >= 40 for p in passwords)


def test_without_credentials_nothing_connects(secured):
    """No anonymous user: sniffing, forging a reply, injecting work or writing a deployment
    all need a connection, and none is let in without a role's password."""
    url, credentials = secured

    async def check() -> None:
        for auth in (
            None,
            NatsAuth(user=WORKER, password="not-the-password"),
            NatsAuth(user="intruder", password=credentials.auth(ADMIN).password),
        ):
            with pytest.raises(nats.errors.Error):
                await _connect(url, auth)
        # The right password gets in: the refusals above are about the credentials.
        nc = await _connect(url, credentials.auth(GATEWAY))
        await nc.close()

    _run(check())


def test_gateway_publishes_work_and_reads_results_but_cannot_pull(secured):
    url, credentials = secured

    async def check() -> None:
        gateway, gateway_errors = await _as(url, credentials, GATEWAY)
        worker, _ = await _as(url, credentials, WORKER)
        admin, _ = await _as(url, credentials, ADMIN)
        gjs = gateway.jetstream()
        # Requests that get no answer: wait less for them than for those that do.
        gjs_refused = gateway.jetstream(timeout=REFUSED_TIMEOUT_S)
        admin_js = admin.jetstream()

        # Its job: the queue, the deployments, the keys, the worker reports, publishing work,
        # cancels to workers, results from workers.
        await ensure_work_stream(gjs, QueueSettings())
        directory, keys = ModelDirectory(), KeyDirectory()
        await directory.start(gjs)
        await keys.start(gjs)
        await asyncio.wait_for(directory.loaded.wait(), 5)
        await asyncio.wait_for(keys.loaded.wait(), 5)
        assert directory.get(MODEL.name) == MODEL
        await (await ensure_workers_kv(gjs)).watchall()
        before = await read_backlog(gjs, MODEL.name)
        await publish_work(gjs, work_subject(MODEL.name), b"work", {"Nats-Msg-Id": "gw-1"})
        assert await read_backlog(gjs, MODEL.name) == (before or 0) + 1
        cancels = await _received(worker, cancel_subject(MODEL.name), gateway, b"request-1")
        assert cancels == [b"request-1"]
        results = await _received(gateway, reply_subject("gw"), worker, b"result")
        assert results == [b"result"]
        assert gateway_errors.violations() == []

        # No more: it cannot take work off the queue, by pulling or by reading it.
        pulled: list = []
        puller = Puller(gateway, WORK_STREAM, consumer_name(MODEL.name), pulled.append)
        await puller.start()
        await puller.pull(1, 0.3)
        await puller.stop()
        assert pulled == []
        assert await read_backlog(admin_js, MODEL.name) == (before or 0) + 1
        info = await admin_js.stream_info(WORK_STREAM)
        await _refused(gjs_refused.get_msg(WORK_STREAM, info.state.last_seq))
        # Nor make a consumer of its own (a push consumer would deliver work to it).
        await _refused(gjs_refused.add_consumer(WORK_STREAM, ConsumerConfig(name="steal")))
        # Nor read the inbox a worker pulls work into.
        sniffed = await _received(gateway, "_INBOX.worker.>", admin, b"work", "_INBOX.worker.x")
        assert sniffed == []
        # Nor forge a result, nor write a deployment or a key.
        forged = await _received(admin, reply_subject("other"), gateway, b"forged")
        assert forged == []
        models = await gjs_refused.key_value(MODELS_BUCKET)
        await _refused(models.put(name_token("evil"), encode_json(MODEL)))
        await _refused(_put(gjs_refused, KEYS_BUCKET, "abc", b"{}"))
        assert await read_deployment(admin_js, "evil") is None
        _assert_refused_by_server(
            gateway_errors,
            'publish to "$js.api.consumer.msg.next.shoal_work.',
            'publish to "$js.api.stream.msg.get.shoal_work"',
            'publish to "$js.api.consumer.create.shoal_work.',
            'subscription to "_inbox.worker.>"',
            'publish to "shoal.reply.other"',
            'publish to "$kv.shoal_models.evil"',
        )
        await directory.stop()
        await keys.stop()
        for nc in (gateway, worker, admin):
            await nc.close()

    _run(check())


def test_worker_pulls_answers_and_reports_but_cannot_deploy_or_inject(secured):
    url, credentials = secured

    async def check() -> None:
        worker, worker_errors = await _as(url, credentials, WORKER)
        gateway, _ = await _as(url, credentials, GATEWAY)
        admin, _ = await _as(url, credentials, ADMIN)
        wjs = worker.jetstream()
        wjs_refused = worker.jetstream(timeout=REFUSED_TIMEOUT_S)
        admin_js = admin.jetstream()
        await publish_work(
            gateway.jetstream(), work_subject(MODEL.name), b"job", {"Nats-Msg-Id": "wk-1"}
        )

        # Its job: pull and ack work, answer the gateway, write its reports, profiles and
        # attempts, read deployments, move a poison message to the dead-letter stream.
        await ensure_model_consumer(wjs, MODEL.name, QueueSettings())
        assert await read_deployment(wjs, MODEL.name) == MODEL
        pulled: list = []
        puller = Puller(worker, WORK_STREAM, consumer_name(MODEL.name), pulled.append)
        await puller.start()
        while await read_backlog(admin_js, MODEL.name):
            await puller.pull(10, 0.5)
        await puller.stop()
        assert b"job" in [m.data for m in pulled]
        for msg in pulled:
            await msg.ack()
        answered = await _received(gateway, reply_subject("gw"), worker, b"answer")
        assert answered == [b"answer"]
        for bucket in (
            await ensure_workers_kv(wjs),
            await ensure_profiles_kv(wjs),
            await ensure_attempts_kv(wjs),
        ):
            await bucket.put("w1", b"{}")
            assert (await bucket.get("w1")).value == b"{}"
        ack = await gateway.jetstream().publish(
            work_subject(MODEL.name), b"poison", headers={"Nats-Msg-Id": "wk-poison"}
        )
        moved = await dead_letter(wjs, ack.seq, model=MODEL.name, deliveries=5, last_error="x")
        assert moved is not None
        assert (await admin_js.get_msg(DLQ_STREAM, moved[0])).data == b"poison"
        assert worker_errors.violations() == []

        # No more: no deployment (not even through `deploy`), no key, no injected work.
        models = await wjs_refused.key_value(MODELS_BUCKET)
        await _refused(models.put(name_token(MODEL.name), b'{"name": "hijacked"}'))
        other = ModelSpec(name="worker-made", runtime="sim", task=Task.EMBEDDINGS, source="sim")
        with pytest.raises((nats.errors.Error, TimeoutError, DeploymentError)):
            await deploy(wjs_refused, other, QueueSettings())
        assert await read_deployment(admin_js, MODEL.name) == MODEL
        assert await read_deployment(admin_js, other.name) is None
        # The keys bucket it cannot even look up.
        await _refused(_put(wjs_refused, KEYS_BUCKET, "abc", b"{}"))
        stored = (await admin_js.stream_info(WORK_STREAM)).state.messages
        await _refused(wjs_refused.publish(work_subject(MODEL.name), b"injected"))
        await _refused(wjs_refused.purge_stream(WORK_STREAM))
        assert (await admin_js.stream_info(WORK_STREAM)).state.messages == stored
        # Nor read results meant for gateways, nor a gateway's inbox.
        for subject in (reply_subject("gw"), "_INBOX.gateway.x"):
            sniffed = await _received(worker, subject, admin, b"result")
            assert sniffed == []
        _assert_refused_by_server(
            worker_errors,
            'publish to "$kv.shoal_models.secure-sim"',
            'publish to "$kv.shoal_models.worker-made"',
            'publish to "shoal.work.secure-sim"',
            'publish to "$js.api.stream.purge.shoal_work"',
            'subscription to "shoal.reply.gw"',
            'subscription to "_inbox.gateway.x"',
        )
        for nc in (gateway, worker, admin):
            await nc.close()

    _run(check())


def _descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat_file.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def _proc_bytes(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def test_shoal_up_serves_with_credentials_that_no_argv_shows(tmp_path):
    env = {**os.environ, **TEST_ENV, "SHOAL_STATE_DIR": str(tmp_path / "state")}
    for name in ("SHOAL_NATS", "SHOAL_NATS_USER", "SHOAL_NATS_PASSWORD", "SHOAL_NATS_CREDS"):
        env.pop(name, None)
    port = free_port()
    log_path = tmp_path / "up.log"
    with log_path.open("wb") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "shoal", "up", "--model", "sim-embed", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(lambda: b"Ctrl-C" in log_path.read_bytes() or up.poll() is not None, 90)
        output = log_path.read_text()
        assert up.poll() is None, output
        credentials = ClusterCredentials(tmp_path / "state" / "nats-auth")
        nats_url = output.split("nats ", 1)[1].split()[0]

        # It serves, end to end, over the secured NATS.
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/embeddings",
            json={"model": "sim-embed", "input": ["secure"]},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        vector = response.json()["data"][0]["embedding"]
        np.testing.assert_allclose(vector, pseudo_embedding("secure", 384), atol=1e-6)

        # A body too large for a work message goes through the object store (the gateway
        # stores it, the worker reads and deletes it), and an Idempotency-Key's answer is
        # kept by the worker for the retry: both roles may do that much.
        texts = [f"{i} " + "x" * 1000 for i in range(300)]
        large = httpx.post(
            f"http://127.0.0.1:{port}/v1/embeddings",
            json={"model": "sim-embed", "input": texts},
            timeout=60,
        )
        assert large.status_code == 200, large.text
        assert len(large.json()["data"]) == len(texts)
        np.testing.assert_allclose(
            large.json()["data"][-1]["embedding"], pseudo_embedding(texts[-1], 384), atol=1e-6
        )
        answers = [
            httpx.post(
                f"http://127.0.0.1:{port}/v1/embeddings",
                json={"model": "sim-embed", "input": ["once"]},
                headers={"Idempotency-Key": "secure-1"},
                timeout=30,
            )
            for _ in range(2)
        ]
        assert [a.status_code for a in answers] == [200, 200], answers[0].text
        assert answers[1].headers.get("idempotent-replayed") == "true"
        assert answers[1].content == answers[0].content

        # Serving needed nothing the roles may not do: the server refused nothing.
        nats_server = next(
            pid for pid in _descendants(up.pid) if b"nats-server" in _proc_bytes(pid, "cmdline")
        )
        argv = _proc_bytes(nats_server, "cmdline").split(b"\0")
        run_dir = Path(argv[argv.index(b"--ports_file_dir") + 1].decode()).parent
        assert "Violation" not in (run_dir / "nats-server.log").read_text()

        # Its NATS lets no one in without credentials.
        async def anonymous() -> None:
            with pytest.raises(nats.errors.Error):
                await _connect(nats_url, None)

        _run(anonymous())

        # Commands on this machine find the admin credentials through the state directory.
        def shoal(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "shoal", *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )

        deployed = shoal("deploy", "sim-zero")
        assert deployed.returncode == 0, deployed.stderr
        assert "sim-zero" in shoal("models").stdout

        # No password on any command line; children get a password file, not the password.
        passwords = [credentials.auth(role).password.encode() for role in ROLES]
        children = _descendants(up.pid)
        assert len(children) >= 3  # nats-server, gateway, worker
        for pid in {up.pid, *children}:
            cmdline = _proc_bytes(pid, "cmdline")
            assert not any(p in cmdline for p in passwords), cmdline
        for pid in children:
            environ = _proc_bytes(pid, "environ")
            assert not any(p in environ for p in passwords), pid
        users = {
            line.split(b"=", 1)[1]
            for pid in children
            for line in _proc_bytes(pid, "environ").split(b"\0")
            if line.startswith(b"SHOAL_NATS_USER=")
        }
        assert users == {GATEWAY.encode(), WORKER.encode()}
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            assert up.wait(60) == 0, log_path.read_text()
        finally:
            if up.poll() is None:
                up.kill()
    deadline = time.monotonic() + 10
    while (tmp_path / "state" / "cluster.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(folder: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, signed by the CA."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=folder)  # fmt: skip
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=folder)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "1", "-extfile", "san.ext",
                 "-out", f"{name}.pem", cwd=folder)  # fmt: skip


@pytest.mark.skipif(not shutil.which("openssl"), reason="needs the openssl command")
def test_tls_with_client_certificates_for_a_server_off_this_machine(tmp_path):
    """What `--nats-tls-ca`, `--nats-tls-cert` and `--nats-tls-key` are for: a server that
    requires TLS and a client certificate, on top of the roles' passwords."""
    _certificates(tmp_path)
    credentials = create_cluster_credentials(tmp_path / "nats-auth")
    config = json.loads(credentials.config_file.read_text())
    config["tls"] = {
        "cert_file": str(tmp_path / "server.pem"),
        "key_file": str(tmp_path / "server.key"),
        "ca_file": str(tmp_path / "ca.pem"),
        "verify": True,
    }
    config_file = tmp_path / "tls.conf"
    config_file.write_text(json.dumps(config))
    server = EmbeddedNats(store_dir=tmp_path / "store", config_file=config_file)
    url = server.start().replace("nats://", "tls://")
    tls = {
        "tls_ca": str(tmp_path / "ca.pem"),
        "tls_cert": str(tmp_path / "client.pem"),
        "tls_key": str(tmp_path / "client.key"),
    }

    async def check() -> None:
        worker = dataclasses.replace(credentials.auth(WORKER), **tls)
        gateway = dataclasses.replace(credentials.auth(GATEWAY), **tls)
        sender, receiver = await _connect(url, worker), await _connect(url, gateway)
        assert await _received(receiver, reply_subject("gw"), sender, b"over tls") == [b"over tls"]
        await sender.close()
        await receiver.close()
        plain = url.replace("tls://", "nats://")
        no_client_certificate = dataclasses.replace(worker, tls_cert="", tls_key="")
        for target, auth in ((plain, credentials.auth(WORKER)), (url, no_client_certificate)):
            with pytest.raises((nats.errors.Error, OSError, TimeoutError)):
                await _connect(target, auth)

    try:
        _run(check())
    finally:
        server.stop()


def test_shoal_up_on_a_secured_external_nats_hands_its_credentials_on(tmp_path):
    """`shoal up --nats URL --nats-user U --nats-password-file F`: every child connects as U,
    told the file's path through its environment, never the password."""
    credentials = create_cluster_credentials(tmp_path / "nats-auth")
    server = EmbeddedNats(store_dir=tmp_path / "store", config_file=credentials.config_file)
    nats_url = server.start()
    env = {**os.environ, **TEST_ENV, "SHOAL_STATE_DIR": str(tmp_path / "state")}
    for name in [v for v in env if v.startswith("SHOAL_NATS")]:
        env.pop(name)
    port = free_port()
    log_path = tmp_path / "up.log"
    password_file = credentials.password_file(ADMIN)
    with log_path.open("wb") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "shoal", "up", "--model", "sim-zero", "--port", str(port),
             "--nats", nats_url, "--nats-user", ADMIN, "--nats-password-file", str(password_file)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until(lambda: b"Ctrl-C" in log_path.read_bytes() or up.poll() is not None, 90)
        assert up.poll() is None, log_path.read_text()
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/embeddings",
            json={"model": "sim-zero", "input": ["external"]},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        password = credentials.auth(ADMIN).password.encode()
        children = _descendants(up.pid)
        assert len(children) >= 2  # gateway, worker (no nats-server of its own)
        for pid in children:
            assert password not in _proc_bytes(pid, "cmdline")
            environ = _proc_bytes(pid, "environ").split(b"\0")
            assert password not in b"\0".join(environ)
            assert f"SHOAL_NATS_PASSWORD_FILE={password_file}".encode() in environ
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            assert up.wait(60) == 0, log_path.read_text()
        finally:
            if up.poll() is None:
                up.kill()
            server.stop()


def test_auth_is_read_from_flags_else_the_environment_and_handed_on(tmp_path, monkeypatch):
    secret = tmp_path / "password"
    secret.write_text("from-the-file\nignored\n")
    monkeypatch.setenv("SHOAL_NATS_USER", "env-user")
    monkeypatch.setenv("SHOAL_NATS_PASSWORD", "from-the-environment")
    monkeypatch.setenv("SHOAL_NATS_TLS_CA", "/env/ca.pem")
    from_env = NatsAuth.read()
    assert (from_env.user, from_env.password, from_env.tls_ca) == (
        "env-user",
        "from-the-environment",
        "/env/ca.pem",
    )
    flagged = NatsAuth.read(user="flag-user", password_file=str(secret))
    assert (flagged.user, flagged.password) == ("flag-user", "from-the-file")
    assert "from-the-file" not in repr(flagged)
    # A child given these variables reads the same auth, its password from the file.
    for name, value in flagged.environment().items():
        monkeypatch.setenv(name, value)
    assert NatsAuth.read() == flagged
    assert flagged.environment()["SHOAL_NATS_PASSWORD"] == ""
    secret.write_text("")
    with pytest.raises(SystemExit, match="empty"):
        NatsAuth.read(password_file=str(secret))
