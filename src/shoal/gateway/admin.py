"""The admin API: deployments over HTTP, the same operations as `shoal deploy` and friends.

    GET    /admin/models          deployments, workers holding each, backlog, batch budget
    PUT    /admin/models/{name}   deploy: {"runtime", "source", "task", "options"} (a built-in
                                  name needs no fields); 200 with the spec written
    DELETE /admin/models/{name}   undeploy; 404 if there is no such deployment
    /admin/dlq...                 the dead-letter queue (gateway/admin_dlq.py)

Every call needs `Authorization: Bearer <admin token>` (`--admin-token` or
`SHOAL_ADMIN_TOKEN`). A gateway started without a token refuses every admin call (403): the
API is off unless someone turns it on. Errors come in the OpenAI error shape.
"""

from __future__ import annotations

import hmac
from urllib.parse import unquote

from nats.js import JetStreamContext

from shoal.api.admin import AdminList, Deleted, DeployRequest, parse_deploy_request
from shoal.api.errors import ApiError
from shoal.catalog import resolve_model
from shoal.config import QueueSettings
from shoal.gateway.admin_dlq import handle_dlq_admin, is_dlq_path
from shoal.gateway.auth import bearer_token
from shoal.protocol import ModelSpec, encode_json
from shoal.state.deployments import DeploymentError, deploy, lora_spec, undeploy
from shoal.state.fleet import model_views

PREFIX = "/admin"  # every admin route is under it (the gateway routes these here)
MODELS_PREFIX = "/admin/models"


def check_token(headers: list[tuple[bytes, bytes]], token: str) -> None:
    """Raise 403 when the admin API is off, 401 when the caller's token is not the token."""
    if not token:
        raise ApiError(
            403,
            "The admin API is off: start the gateway with --admin-token (or SHOAL_ADMIN_TOKEN)",
            code="admin_disabled",
        )
    if not hmac.compare_digest(bearer_token(headers), token.encode()):
        raise ApiError(401, "A valid admin token is required", code="invalid_admin_token")


async def handle_admin(
    method: str, path: str, body: bytes, js: JetStreamContext, queue: QueueSettings
) -> tuple[int, bytes]:
    """Run one admin call (the token was checked); returns (status, JSON body)."""
    if is_dlq_path(path):
        return await handle_dlq_admin(method, path, js)
    if path != MODELS_PREFIX and not path.startswith(MODELS_PREFIX + "/"):
        raise ApiError(404, f"Unknown path {path}")
    if path == MODELS_PREFIX:
        if method != "GET":
            raise ApiError(405, f"Method {method} is not allowed on {path}")
        views = await model_views(js)
        return 200, encode_json(AdminList(views))
    name = unquote(path.removeprefix(MODELS_PREFIX + "/"))
    if method == "PUT":
        request = parse_deploy_request(body)
        try:
            if request.base or request.lora:
                if not (request.base and request.lora):
                    raise DeploymentError("'base' and 'lora' go together")
                spec = await lora_spec(js, name, request.base, request.lora)
            else:
                spec = _spec_from(name, request)
            await deploy(js, spec, queue)
        except DeploymentError as err:
            raise ApiError(400, str(err), code="invalid_deployment") from None
        return 200, encode_json(spec)
    if method == "DELETE":
        try:
            await undeploy(js, name)
        except DeploymentError as err:
            raise ApiError(404, str(err), param="model", code="model_not_found") from None
        return 200, encode_json(Deleted(name))
    raise ApiError(405, f"Method {method} is not allowed on {path}")


def _spec_from(name: str, request: DeployRequest) -> ModelSpec:
    try:
        return resolve_model(
            name,
            runtime=request.runtime,
            source=request.source,
            task=request.task,
            options=request.options,
        )
    except ValueError as err:
        raise ApiError(400, str(err), code="invalid_deployment") from None
