"""Deployments: the fleet's models, as keys of the `shoal_models` KV bucket.

`shoal deploy`, `shoal undeploy` and the gateway's admin API all go through `deploy` and
`undeploy` here, so a spec is checked the same way whoever writes it, and nothing invalid is
written. Gateways and workers follow the bucket with a `ModelDirectory` (a KV watch), so a
change takes effect everywhere within milliseconds, with no restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
from pathlib import Path

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from shoal.broker.jetstream import ensure_model_consumer, ensure_work_stream, purge_model_queue
from shoal.config import QueueSettings
from shoal.protocol import (
    ModelSpec,
    decode_model_spec,
    encode_json,
    is_valid_model_name,
    name_token,
)
from shoal.runtimes.registry import (
    RUNTIME_RECORDS,
    check_adapter_base,
    check_adapter_source,
    check_options,
    check_runtime,
)
from shoal.state.kv import ensure_bucket, follow, is_removal, read_all, read_value

log = logging.getLogger(__name__)

MODELS_BUCKET = "shoal_models"


class DeploymentError(ValueError):
    """A deployment that cannot be made: the message says why; nothing was written."""


def validate_spec(spec: ModelSpec) -> None:
    """Raise DeploymentError unless a worker could load this spec.

    A path source is checked where the deployment is made: on a cluster of several machines,
    use a path every worker has too (a shared volume), or a package.
    """
    if not is_valid_model_name(spec.name):
        raise DeploymentError(
            f"invalid model name {spec.name!r}: letters, digits and ._:/- , at most 128"
        )
    try:
        record = check_runtime(spec)
    except ValueError as err:
        raise DeploymentError(str(err)) from None
    if record.simulated:
        return  # a simulated model has no weights
    if not record.installed():
        raise DeploymentError(
            f"runtime {spec.runtime!r} is not installed here: pip install 'shoal[{record.extra}]'"
        )
    try:
        check_options(spec)  # e.g. an engine's command: found here, or refused now
    except ValueError as err:
        raise DeploymentError(str(err)) from None
    if not spec.source and not record.source_required:
        return
    if not spec.source:
        raise DeploymentError(f"runtime {spec.runtime!r} needs a source: a path or package:NAME")
    if spec.source.startswith("package:"):
        package = spec.source.removeprefix("package:")
        if not package or importlib.util.find_spec(package) is None:
            raise DeploymentError(f"model package {package!r} is not installed")
    elif not Path(spec.source).expanduser().exists():
        raise DeploymentError(f"model source {spec.source!r} does not exist")


def validate_adapter(spec: ModelSpec, base: ModelSpec | None) -> None:
    """Raise DeploymentError unless `spec` is a loadable adapter on an existing base.

    Which runtimes serve adapters on which tasks, and in which formats, is in their registry
    records (torch: PEFT directories; llama.cpp: GGUF LoRA files, or PEFT directories it
    converts once; an engine: PEFT directories, if its command has --enable-lora).
    """
    if base is None:
        raise DeploymentError(f"the base model {spec.base!r} is not deployed")
    if base.base:
        raise DeploymentError(f"{base.name!r} is itself an adapter: an adapter needs a base")
    record = RUNTIME_RECORDS.get(base.runtime)
    if record is None or not record.serves_adapters(base.task):
        served = ", ".join(
            f"{r.name} {task.value}" for r in RUNTIME_RECORDS.values() for task in r.adapter_tasks
        )
        raise DeploymentError(
            f"LoRA adapters are served on {served} models; {base.name!r} is "
            f"{base.runtime} {base.task.value}"
        )
    try:
        check_adapter_base(base)
    except ValueError as err:
        raise DeploymentError(f"{base.name!r} cannot take LoRA adapters: {err}") from None
    try:
        check_adapter_source(record, spec.adapter)
    except ValueError as err:
        raise DeploymentError(str(err)) from None


async def lora_spec(js: JetStreamContext, name: str, base: str, adapter: str) -> ModelSpec:
    """The deployment of a LoRA adapter on `base`: it serves what its base serves."""
    base_spec = await read_deployment(js, base)
    if base_spec is None:
        raise DeploymentError(f"the base model {base!r} is not deployed")
    path = str(Path(adapter).expanduser().resolve())
    return ModelSpec(
        name=name, runtime=base_spec.runtime, task=base_spec.task, base=base, adapter=path
    )


async def deploy(js: JetStreamContext, spec: ModelSpec, queue: QueueSettings) -> None:
    """Check the spec, then make it known: its queue, its consumer and its KV key."""
    if spec.base:
        if not is_valid_model_name(spec.name):
            raise DeploymentError(f"invalid model name {spec.name!r}")
        validate_adapter(spec, await read_deployment(js, spec.base))
    else:
        validate_spec(spec)
    await ensure_work_stream(js, queue)
    # The consumer exists before any worker does, so the backlog of a model nobody has
    # loaded yet can be read (placement by pulling reads it).
    await ensure_model_consumer(js, spec.name, queue)
    kv = await ensure_models_kv(js)
    await kv.put(name_token(spec.name), encode_json(spec))


async def undeploy(js: JetStreamContext, name: str) -> None:
    """Remove a deployment: gateways answer 404 for it, workers drain and unload it.

    Requests still queued for it are dropped from the queue (a worker that holds some answers
    them first); a client that waits for one gets 504 at its deadline. New requests get 404.
    """
    kv = await ensure_models_kv(js)
    if await read_deployment(js, name) is None:
        raise DeploymentError(f"no deployment named {name!r}")
    adapters = [s.name for s in await list_deployments(js) if s.base == name]
    if adapters:
        raise DeploymentError(
            f"{name!r} is the base of {', '.join(adapters)}: undeploy those adapters first"
        )
    await kv.delete(name_token(name))
    await purge_model_queue(js, name)


async def ensure_models_kv(js: JetStreamContext) -> KeyValue:
    """The deployments bucket: model name token -> ModelSpec (JSON)."""
    return await ensure_bucket(js, MODELS_BUCKET)


async def read_deployment(js: JetStreamContext, name: str) -> ModelSpec | None:
    """The deployment named `name`, or None (also for "": no KV key is empty)."""
    if not name:
        return None
    return await read_value(await ensure_models_kv(js), name_token(name), decode_model_spec)


async def list_deployments(js: JetStreamContext) -> list[ModelSpec]:
    specs = await read_all(await ensure_models_kv(js), decode_model_spec)
    return sorted(specs, key=lambda spec: spec.name)


async def register_model(js: JetStreamContext, spec: ModelSpec) -> None:
    """Make a model a worker was started with known to gateways, unless a deployment of that
    name exists already (a deployment made with `shoal deploy` is never overwritten)."""
    kv = await ensure_models_kv(js)
    with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):
        await kv.create(name_token(spec.name), encode_json(spec))


class ModelDirectory:
    """The deployed models, kept current by watching the KV bucket."""

    def __init__(self) -> None:
        self._models: dict[str, ModelSpec] = {}
        self._revisions: dict[str, int] = {}  # by name: the KV revision of its last deploy
        self._by_key: dict[str, str] = {}
        self.loaded = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def get(self, name: str) -> ModelSpec | None:
        return self._models.get(name)

    def revision(self, name: str) -> int:
        """The KV revision of the model's current deployment (each deploy makes a new one)."""
        return self._revisions.get(name, 0)

    def all(self) -> list[ModelSpec]:
        return sorted(self._models.values(), key=lambda spec: spec.name)

    async def start(self, js: JetStreamContext) -> None:
        watcher = await (await ensure_models_kv(js)).watchall()
        self._task = asyncio.create_task(follow(watcher, self._on_entry, "deployment"))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _on_entry(self, entry: KeyValue.Entry | None) -> None:
        if entry is None:  # the initial values have all been seen
            self.loaded.set()
            return
        if is_removal(entry):
            name = self._by_key.pop(entry.key, None)
            if name is not None:
                self._models.pop(name, None)
                self._revisions.pop(name, None)
            return
        try:
            spec = decode_model_spec(entry.value)
        except Exception as err:
            log.warning("ignoring unreadable deployment %s: %s", entry.key, err)
            return
        self._by_key[entry.key] = spec.name
        self._models[spec.name] = spec
        self._revisions[spec.name] = entry.revision or 0
