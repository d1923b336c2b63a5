"""The gateway's view of which models are deployed, kept current by watching the KV bucket."""

from __future__ import annotations

import asyncio
import logging

from nats.js.kv import KeyValue

from shoal.protocol import ModelSpec, decode_model_spec

log = logging.getLogger(__name__)

_DELETE_OPS = {"DEL", "PURGE"}


class ModelDirectory:
    def __init__(self) -> None:
        self._models: dict[str, ModelSpec] = {}
        self._by_key: dict[str, str] = {}
        self.loaded = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def get(self, name: str) -> ModelSpec | None:
        return self._models.get(name)

    def all(self) -> list[ModelSpec]:
        return sorted(self._models.values(), key=lambda spec: spec.name)

    async def start(self, kv: KeyValue) -> None:
        watcher = await kv.watchall()
        self._task = asyncio.create_task(self._follow(watcher))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _follow(self, watcher) -> None:
        while True:
            try:
                entry = await watcher.updates(timeout=None)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.debug("model watch: %s", err)
                await asyncio.sleep(0.5)
                continue
            if entry is None:  # the initial values have all been seen
                self.loaded.set()
                continue
            if entry.operation in _DELETE_OPS or entry.value is None:
                name = self._by_key.pop(entry.key, None)
                if name is not None:
                    self._models.pop(name, None)
                continue
            try:
                spec = decode_model_spec(entry.value)
            except Exception as err:
                log.warning("ignoring unreadable deployment %s: %s", entry.key, err)
                continue
            self._by_key[entry.key] = spec.name
            self._models[spec.name] = spec
