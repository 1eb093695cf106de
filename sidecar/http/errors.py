"""OpenAI error JSON (``{"error": {"message", "type", "param", "code"}}``) with the right HTTP status.

Every exception the sidecar raises maps to the status its gRPC code stands for (``status_for``):
INVALID_ARGUMENT 400, UNAUTHENTICATED 401, NOT_FOUND 404, ABORTED / ALREADY_EXISTS 409,
FAILED_PRECONDITION 400, RESOURCE_EXHAUSTED 429 (quotas) or 400 (a turn the KV pool cannot hold),
UNAVAILABLE 503, DATA_LOSS and anything unexpected 500.
"""

from __future__ import annotations

import grpc
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.api import CapacityError
from sidecar.turns.limits import QuotaExceeded

_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled_error"),
    grpc.StatusCode.DATA_LOSS: (500, "server_error"),
}


class OpenAIError(Exception):
    """An error to answer with OpenAI's error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def from_exception(e: BaseException) -> OpenAIError:
    """The OpenAI error for an exception raised by the sidecar (or by this front)."""
    if isinstance(e, OpenAIError):
        return e
    from sidecar.grpc.errors import status_for  # the one mapping of exceptions to status codes

    code = status_for(e)
    message = str(e) or type(e).__name__
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and isinstance(e, CapacityError) and not isinstance(e, QuotaExceeded):
        return OpenAIError(400, message, "invalid_request_error", None, "context_length_exceeded")
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return OpenAIError(401, message, "invalid_request_error", None, "invalid_api_key")
    if code is grpc.StatusCode.INTERNAL:
        return OpenAIError(500, "internal error", "server_error")
    status, kind = _HTTP.get(code, (500, "server_error"))
    return OpenAIError(status, message, kind, None, code.name.lower())


def install(app) -> None:
    """Answer every error of ``app`` with OpenAI's error JSON."""

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, e: OpenAIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        first = (e.errors() or [{}])[0]
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return invalid(
            f"{loc}: {first.get('msg', 'invalid')}" if loc else str(first.get("msg", "invalid request")), loc or None
        ).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return OpenAIError(e.status_code, str(e.detail), kind).response()

    @app.exception_handler(Exception)
    async def _other(request: Request, e: Exception):
        err = from_exception(e)
        if err.status >= 500:
            import logging

            logging.getLogger(__name__).exception("HTTP request failed")
        return err.response()
