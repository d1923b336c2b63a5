"""The gateway's OpenAPI 3.1 document (`GET /openapi.json`), built from the API's types.

The document is static: `python -m shoal.gateway.openapi` builds it from the request and
response types in `shoal.api` (msgspec writes their JSON schemas) and writes it to
`openapi.json` beside this module, which the gateway serves as it is. It is built ahead
because those types' modules import numpy and the runtimes' base, which the gateway process
must not load; tests/test_hostile.py fails when the file is not what the types build now, or
when a route of the gateway is missing from it.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec

import shoal

DOCUMENT_FILE = "openapi.json"
_REF = "#/components/schemas/{name}"


def load_document() -> bytes:
    """The document as the gateway serves it (read once, at the gateway's start)."""
    return resources.files(__package__).joinpath(DOCUMENT_FILE).read_bytes()


def build_document() -> dict[str, Any]:
    """The document from the API's types as they are now (imports numpy: not in the gateway)."""
    from shoal.api import admin, embeddings, generation, models, rerank
    from shoal.api.errors import ErrorBody
    from shoal.gateway.dashboard import DashboardSnapshot
    from shoal.protocol import ModelSpec
    from shoal.state.fleet import ModelView

    # Documentation-only shapes, built with real types (this module's annotations are strings
    # and these types are local). msgspec cannot express "a list of one kind or the other".
    float_response = msgspec.defstruct(
        "EmbeddingsFloatResponse",
        [
            ("data", list[embeddings.EmbeddingFloat]),
            ("model", str),
            ("usage", embeddings.Usage),
            ("object", str, "list"),
        ],
    )
    base64_response = msgspec.defstruct(
        "EmbeddingsBase64Response",
        [
            ("data", list[embeddings.EmbeddingBase64]),
            ("model", str),
            ("usage", embeddings.Usage),
            ("object", str, "list"),
        ],
    )
    admin_models = msgspec.defstruct(
        "AdminModels", [("data", list[ModelView]), ("object", str, "list")]
    )
    health = msgspec.defstruct("Health", [("status", str)])

    named = {
        "EmbeddingsRequest": embeddings.EmbeddingsRequest,
        "EmbeddingsFloatResponse": float_response,
        "EmbeddingsBase64Response": base64_response,
        "CompletionsRequest": generation.CompletionsRequest,
        "CompletionBody": generation.CompletionBody,
        "ChatRequest": generation.ChatRequest,
        "ChatBody": generation.ChatBody,
        "ChatChunkBody": generation.ChatChunkBody,
        "RerankRequest": rerank.RerankRequest,
        "RerankResponse": rerank.RerankResponse,
        "ModelList": models.ModelList,
        "ModelCard": models.ModelCard,
        "DeployRequest": admin.DeployRequest,
        "ModelSpec": ModelSpec,
        "Deleted": admin.Deleted,
        "AdminModels": admin_models,
        "Health": health,
        "ErrorBody": ErrorBody,
        "DashboardSnapshot": DashboardSnapshot,
    }
    _, schemas = msgspec.json.schema_components(named.values(), ref_template=_REF)
    missing = set(named) - set(schemas)
    if missing:  # two types share a name: msgspec named them apart, and the refs would miss
        raise RuntimeError(f"schema names not found: {sorted(missing)}")
    schemas["EmbeddingsResponse"] = {
        "oneOf": [_ref("EmbeddingsFloatResponse"), _ref("EmbeddingsBase64Response")]
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Shoal gateway",
            "version": shoal.__version__,
            "description": "OpenAI-compatible inference (embeddings, completions, chat, "
            "rerank) over a pulling cluster, and its admin API. Every error has OpenAI's "
            'shape, `{"error": {"message", "type", "param", "code"}}`.',
        },
        "paths": _paths(),
        "components": {
            "schemas": dict(sorted(schemas.items())),
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "`shoal keys`"},
                "adminToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the gateway's admin token (`SHOAL_ADMIN_TOKEN`)",
                },
            },
        },
    }


def _paths() -> dict[str, Any]:
    inference = {"security": [{"apiKey": []}, {}]}  # keys are off on loopback by default
    admin = {"security": [{"adminToken": []}]}
    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "/v1/embeddings": {
            "post": _operation(
                "createEmbeddings",
                "Embed one text or a list of up to 2048",
                "EmbeddingsRequest",
                _json(_ref("EmbeddingsResponse")),
                (400, 401, 403, 404, 408, 413, 429, 503, 504),
                **inference,
            )
        },
        "/v1/completions": {
            "post": _operation(
                "createCompletion",
                "Complete a prompt; with `stream`, server-sent events of CompletionBody chunks",
                "CompletionsRequest",
                {**_json(_ref("CompletionBody")), **_event_stream("CompletionBody")},
                (400, 401, 403, 404, 408, 413, 429, 503, 504),
                **inference,
            )
        },
        "/v1/chat/completions": {
            "post": _operation(
                "createChatCompletion",
                "Answer a chat; with `stream`, server-sent events of ChatChunkBody chunks",
                "ChatRequest",
                {**_json(_ref("ChatBody")), **_event_stream("ChatChunkBody")},
                (400, 401, 403, 404, 408, 413, 429, 503, 504),
                **inference,
            )
        },
        "/v1/rerank": {
            "post": _operation(
                "rerank",
                "Order documents by relevance to a query",
                "RerankRequest",
                _json(_ref("RerankResponse")),
                (400, 401, 403, 404, 408, 413, 429, 503, 504),
                **inference,
            )
        },
        "/v1/models": {
            "get": _operation("listModels", "The deployed models", None, _json(_ref("ModelList")))
        },
        "/v1/models/{model}": {
            "get": _operation(
                "retrieveModel",
                "One deployed model (404 for one that is not, or that the key may not use)",
                None,
                _json(_ref("ModelCard")),
                (401, 404, 503),
                parameters=[
                    {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                **inference,
            )
        },
        "/healthz": {
            "get": _operation("healthz", "The process is up", None, _json(_ref("Health")))
        },
        "/readyz": {
            "get": _operation(
                "readyz", "Connected to the queue (NATS)", None, _json(_ref("Health")), (503,)
            )
        },
        "/metrics": {
            "get": _operation(
                "metrics",
                "Prometheus metrics",
                None,
                {"text/plain": {"schema": {"type": "string"}}},
            )
        },
        "/openapi.json": {
            "get": _operation(
                "openapi", "This document", None, {"application/json": {"schema": {}}}
            )
        },
        "/dashboard": {
            "get": _operation(
                "dashboard",
                "The fleet dashboard: a page that polls /dashboard/data (no data of its own)",
                None,
                {"text/html": {"schema": {"type": "string"}}},
            )
        },
        "/dashboard/data": {
            "get": _operation(
                "dashboardData",
                "The fleet now: workers, backlog, rates and latency over the last seconds "
                "(the admin token when the gateway has one)",
                None,
                _json(_ref("DashboardSnapshot")),
                (401, 503),
                security=[{"adminToken": []}, {}],
            )
        },
        "/admin/models": {
            "get": _operation(
                "adminListModels",
                "Deployments, the workers holding each, backlog and batch budget",
                None,
                _json(_ref("AdminModels")),
                (401, 403, 503),
                **admin,
            )
        },
        "/admin/models/{name}": {
            "put": _operation(
                "adminDeploy",
                "Deploy a model (a built-in name needs no fields)",
                "DeployRequest",
                _json(_ref("ModelSpec")),
                (400, 401, 403, 408, 413, 503),
                parameters=[name],
                **admin,
            ),
            "delete": _operation(
                "adminUndeploy",
                "Undeploy a model",
                None,
                _json(_ref("Deleted")),
                (401, 403, 404, 503),
                parameters=[name],
                **admin,
            ),
        },
    }


def _operation(
    operation_id: str,
    summary: str,
    request: str | None,
    content: dict[str, Any],
    errors: tuple[int, ...] = (),
    **extra: Any,
) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    for status in errors:
        responses[str(status)] = {
            "description": _ERROR_MEANING[status],
            "content": _json(_ref("ErrorBody")),
        }
    operation: dict[str, Any] = {"operationId": operation_id, "summary": summary, **extra}
    if request is not None:
        operation["requestBody"] = {"required": True, "content": _json(_ref(request))}
    operation["responses"] = responses
    return operation


_ERROR_MEANING = {
    400: "Invalid request (the body, a parameter, or JSON nested too deep)",
    401: "No valid API key or admin token",
    403: "The key may not use this model, or the admin API is off",
    404: "No such model or deployment",
    408: "The body did not arrive within the body timeout",
    413: "The body is larger than the gateway's limit",
    429: "The model's queue is full; retry after Retry-After",
    503: "The queue (NATS) is not reachable; retry after Retry-After",
    504: "No result within the request timeout",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _event_stream(chunk: str) -> dict[str, Any]:
    return {
        "text/event-stream": {
            "schema": {
                "type": "string",
                "description": f"`data: <{chunk}>` events, then `data: [DONE]`",
            }
        }
    }


def encode_document(document: dict[str, Any]) -> str:
    """The file's text: stable key order and indentation, so that a diff shows a change."""
    return json.dumps(document, indent=1, ensure_ascii=False) + "\n"


def main() -> None:
    """Write the document built from the types now to the file the gateway serves."""
    path = Path(__file__).with_name(DOCUMENT_FILE)
    path.write_text(encode_document(build_document()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
