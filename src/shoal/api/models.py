"""`GET /v1/models`: the deployed models in OpenAI's list shape (plus Shoal's task, runtime)."""

from __future__ import annotations

import msgspec

from shoal.protocol import ModelSpec, encode_json


class ModelCard(msgspec.Struct):
    id: str
    task: str
    runtime: str
    object: str = "model"
    created: int = 0
    owned_by: str = "shoal"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


def encode_model_list(specs: list[ModelSpec]) -> bytes:
    cards = [ModelCard(spec.name, spec.task.value, spec.runtime) for spec in specs]
    return encode_json(ModelList(cards))
