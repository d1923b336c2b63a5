"""Errors in the OpenAI error shape, shared by the gateway and the worker."""

from __future__ import annotations

import msgspec

from shoal.protocol import encode_json


class ErrorDetail(msgspec.Struct, omit_defaults=False):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class ApiError(Exception):
    """An error that becomes an HTTP response with an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> bytes:
        kind = _TYPE_BY_STATUS.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )
        return encode_json(ErrorBody(ErrorDetail(self.message, kind, self.param, self.code)))


def invalid_body(err: msgspec.ValidationError | msgspec.DecodeError) -> ApiError:
    """The 400 for a body msgspec could not decode, naming the parameter as OpenAI does."""
    if isinstance(err, msgspec.ValidationError):
        return ApiError(400, f"Invalid request: {err}", param=_param_of(err))
    return ApiError(400, f"Request body is not valid JSON: {err}")


def _param_of(err: msgspec.ValidationError) -> str | None:
    # msgspec says "... - at `$.field...`": the top-level field is the parameter.
    message = str(err)
    if "`$." in message:
        return message.split("`$.", 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0]
    return None
