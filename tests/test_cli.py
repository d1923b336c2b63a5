"""The `shoal` command line: JSON listings, load progress, `status --watch`, error messages.

Real processes on a real nats-server; the models run on the simulated runtime (`sim`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import TEST_ENV, Launcher, wait_until
from test_up import UpProcess

from shoal.broker.embedded import EmbeddedNats
from shoal.process import free_port


def shoal(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a `shoal` command to its end, its output captured."""
    environment = {**os.environ, **TEST_ENV, **(env or {})}
    environment.pop("SHOAL_NATS", None)
    return subprocess.run(
        [sys.executable, "-m", "shoal", *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )


def start(*args: str) -> subprocess.Popen[str]:
    """Start a `shoal` command whose output the test reads as it comes."""
    return subprocess.Popen(
        [sys.executable, "-m", "shoal", *args],
        env={**os.environ, **TEST_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_every_listing_has_json(nats_server: EmbeddedNats, launcher: Launcher):
    url = nats_server.url
    assert shoal("deploy", "cli-json", "--runtime", "sim", "--nats", url).returncode == 0
    worker = launcher.worker(url, "cli-json")

    def models() -> dict[str, dict]:
        listed = json.loads(shoal("models", "--json", "--nats", url).stdout)
        return {m["name"]: m for m in listed}

    # The worker is READY; the listing counts it once its report is read.
    view = wait_until(lambda: (m := models()["cli-json"])["workers_ready"] == 1 and m, 10)
    assert view["runtime"] == "sim" and view["simulated"] is True
    assert {"task", "backlog", "max_batch_items", "errors"} <= set(view)

    statuses = json.loads(shoal("status", "--json", "--nats", url).stdout)
    mine = [s for s in statuses if s["pid"] == worker.pid]
    assert [(s["model"], s["state"]) for s in mine] == [("cli-json", "ready")]
    assert {"worker_id", "runtime", "items_done", "max_batch_items", "busy_fraction"} <= set(
        mine[0]
    )

    runtimes = {r["name"]: r for r in json.loads(shoal("runtimes", "--json").stdout)}
    assert runtimes["sim"]["simulated"] is True and runtimes["sim"]["installed"] is True
    assert "embeddings" in runtimes["sim"]["tasks"]

    created = json.loads(
        shoal("keys", "create", "--name", "cli-key", "--json", "--nats", url).stdout
    )
    keys = json.loads(shoal("keys", "list", "--json", "--nats", url).stdout)
    listed = [k for k in keys if k["id"] == created["id"]]
    assert listed and listed[0]["name"] == "cli-key" and "secret" not in listed[0]

    assert isinstance(json.loads(shoal("dlq", "list", "--json", "--nats", url).stdout), list)


def test_deploy_wait_prints_the_load_and_returns_once_ready(
    nats_server: EmbeddedNats, launcher: Launcher
):
    url = nats_server.url
    deploy = start("deploy", "cli-wait", "--runtime", "sim", "--wait", "--nats", url)
    assert deploy.stdout is not None
    assert deploy.stdout.readline().startswith("deployed cli-wait")
    # The deployment exists now: a worker started for it loads it.
    launcher.spawn("worker", "--nats", url, "--model", "cli-wait")
    out, err = deploy.communicate(timeout=60)
    assert deploy.returncode == 0, out + err
    assert "cli-wait ready (budget" in out


def test_deploy_wait_fails_with_the_load_error(
    nats_server: EmbeddedNats, gateway_url: str, launcher: Launcher, tmp_path: Path
):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a model")
    url = nats_server.url
    args = ["--runtime", "llamacpp", "--task", "generate", "--source", str(broken)]
    deploy = start("deploy", "cli-broken", *args, "--wait", "--nats", url)
    assert deploy.stdout is not None
    assert deploy.stdout.readline().startswith("deployed cli-broken")
    # A fleet worker loads it once a request waits for it (a pinned worker that fails to
    # load exits instead of reporting FAILED).
    launcher.spawn("worker", "--nats", url, "--fleet")
    wait_until(lambda: _queue_request(gateway_url, "cli-broken"), 10)
    out, err = deploy.communicate(timeout=60)
    assert deploy.returncode == 1, out + err
    assert "cli-broken failed to load: cannot load cli-broken on llamacpp" in err


def _queue_request(gateway_url: str, model: str) -> bool:
    """Send a request and leave it queued; False while the gateway does not know the model."""
    body = {"model": model, "prompt": "x", "max_tokens": 1}
    try:
        response = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=1)
    except httpx.TimeoutException:
        return True  # accepted and waiting for a worker
    return response.status_code != 404


def test_deploy_wait_times_out_with_what_to_do(nats_server: EmbeddedNats):
    url = nats_server.url
    wait = ["--wait", "--timeout", "1"]
    done = shoal("deploy", "cli-idle", "--runtime", "sim", *wait, "--nats", url)
    assert done.returncode == 1
    assert "no worker reported cli-idle ready within 1 s" in done.stderr
    assert "shoal worker --model cli-idle" in done.stderr


def test_deploy_wait_ends_on_ctrl_c(nats_server: EmbeddedNats):
    deploy = start("deploy", "cli-ctrl-c", "--runtime", "sim", "--wait", "--nats", nats_server.url)
    assert deploy.stdout is not None
    assert deploy.stdout.readline().startswith("deployed cli-ctrl-c")  # now polling
    deploy.send_signal(signal.SIGINT)
    _, err = deploy.communicate(timeout=10)
    assert deploy.returncode == 130, err  # the shell's code for Ctrl-C, no traceback
    assert "Traceback" not in err


def test_status_watch_refreshes_until_ctrl_c(nats_server: EmbeddedNats):
    watch = start("status", "--watch", "--interval", "0.2", "--nats", nats_server.url)
    assert watch.stdout is not None
    # Two refreshes printed (the output is a pipe: nothing is cleared), then Ctrl-C.
    for _ in range(2):
        line = watch.stdout.readline()
        while line and not line.startswith("shoal status, every 0.2 s"):
            line = watch.stdout.readline()
        assert line, watch.stderr.read() if watch.stderr else ""
    watch.send_signal(signal.SIGINT)
    out, err = watch.communicate(timeout=10)
    assert watch.returncode == 0, err
    assert "\x1b[2J" not in out
    assert "Traceback" not in err


def test_messages_say_what_to_do(nats_server: EmbeddedNats, tmp_path: Path):
    alone = {"SHOAL_STATE_DIR": str(tmp_path / "no-cluster")}
    for command in (["status"], ["models"], ["keys", "list"], ["undeploy", "x"]):
        done = shoal(*command, env=alone)
        assert done.returncode == 1, command
        assert "no local cluster running" in done.stderr
        assert "`shoal up`" in done.stderr and "--nats URL" in done.stderr

    url = nats_server.url
    assert shoal("deploy", "cli-kept", "--runtime", "sim", "--nats", url).returncode == 0
    done = shoal("undeploy", "cli-nothing", "--nats", url)
    assert done.returncode == 1
    assert "no deployment named 'cli-nothing'" in done.stderr
    assert "deployed:" in done.stderr and "cli-kept" in done.stderr


def test_up_shows_each_worker_loading(tmp_path: Path):
    up = UpProcess(tmp_path, "--model", "sim-embed", "--port", str(free_port()))
    up.wait_for(r"worker 1: sim-embed ready \(budget \d+\) in \d+\.\d s", 60)
    up.wait_for("Shoal is up", 10)
    up.process.send_signal(signal.SIGINT)
    assert up.process.wait(40) == 0


@pytest.mark.parametrize(
    ("variable", "value", "choices"),
    [
        ("SHOAL_BATCH_WAIT", "eager", "adaptive, off"),
        ("SHOAL_HTTP_SERVER", "hypercorn", "uvicorn, granian"),
        ("SHOAL_API_KEYS", "sometimes", "auto, required, off"),
    ],
)
def test_an_environment_setting_outside_its_choices_stops_shoal_up_at_once(
    tmp_path: Path, variable: str, value: str, choices: str
):
    """Checked like the flag it defaults: before, `SHOAL_BATCH_WAIT=eager shoal up` started a
    cluster whose workers each exited on `--batch-wait eager`, again and again."""
    done = shoal(
        "up", "--model", "sim-embed", env={"SHOAL_STATE_DIR": str(tmp_path), variable: value}
    )
    assert done.returncode == 2  # argparse's, as for a refused flag
    assert f"{variable}={value!r} is not one of: {choices}" in done.stderr
    assert not (tmp_path / "cluster.json").exists()  # nothing was started


@pytest.mark.parametrize(
    ("variable", "child"),
    [("SHOAL_BATCH_LATENCY_TARGET", "worker 1"), ("SHOAL_HEADER_TIMEOUT", "gateway")],
)
def test_a_child_that_refuses_its_settings_stops_shoal_up_instead_of_restarting(
    tmp_path: Path, variable: str, child: str
):
    """Settings only a worker (or only the gateway) reads: `shoal up` starts the child, which
    refuses the setting. Before, the supervisor restarted it with backoff for as long as
    `shoal up` ran, and never served."""
    done = shoal(
        "up",
        "--model",
        "sim-embed",
        "--port",
        str(free_port()),
        env={"SHOAL_STATE_DIR": str(tmp_path), variable: "soon"},
    )
    assert done.returncode == 1
    assert f"{variable}='soon' is not a valid float" in done.stderr
    assert f"{child} (pid" not in done.stdout  # no "... exited ...; restarting in ..."
    assert f"shoal up: {child} exited with code 2: it refused" in done.stderr
    assert "restarted" not in done.stdout
    assert not (tmp_path / "cluster.json").exists()
