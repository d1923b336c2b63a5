"""`GET /v1/models` and `GET /v1/models/{id}`: deployed models in OpenAI's model shape.

OpenAI's model object is `{id, object: "model", created, owned_by}`; Shoal adds the model's
task and runtime, which OpenAI's clients keep as extra fields.
"""

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


def model_card(spec: ModelSpec) -> ModelCard:
    """One deployment as OpenAI's model object."""
    return ModelCard(spec.name, spec.task.value, spec.runtime)


def encode_model_list(specs: list[ModelSpec]) -> bytes:
    """The `GET /v1/models` body."""
    return encode_json(ModelList([model_card(spec) for spec in specs]))


def encode_model(spec: ModelSpec) -> bytes:
    """The `GET /v1/models/{id}` body."""
    return encode_json(model_card(spec))
