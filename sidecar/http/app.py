"""The FastAPI app of the OpenAI-compatible front, and its uvicorn server on the sidecar's event loop.

    http = HttpFront(sidecar_server, HttpOptions(port=8000))
    port = await http.start()      # after sidecar_server.start(): one process, one engine, one SessionManager
    ...
    await http.stop()

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``,
``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``, the cache control of
``/v1/prefix_cache/`` (``inspect``, ``match``, ``delete_subtree``, ``set_eviction_priority``, ``prune``
and ``GET prune/{prune_id}``; sidecar/http/cache_control.py), ``GET /health``. Every route but
``/health`` takes ``Authorization: Bearer <token>`` when auth is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse

from sidecar.grpc.ports import bind
from sidecar.http import errors
from sidecar.http.backend import SessionBackend
from sidecar.http.cache_control import CacheControl
from sidecar.http.chat_completions import ChatCompletions
from sidecar.http.errors import OpenAIError
from sidecar.http.requests import body_object
from sidecar.http.responses_api import Responses
from sidecar.store.errors import StoreUnavailable

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.grpc.sidecar_server import SidecarServer

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    """0 picks a free port (``start`` returns it)."""
    served_model_name: str | None = None
    """The model name clients send; unset: the model folder's name (as gRPC GetServerInfo reports)."""
    max_body_bytes: int = 4 * 2**20


def _openai_errors(route, store_failed: Callable[[BaseException, str], None]):
    """Any exception a route raises becomes its OpenAI error here (a handler for plain exceptions would
    run in Starlette's outermost middleware, which logs every 4xx as a server failure). 5xx are logged,
    but a store that does not answer goes to ``store_failed`` (one line a minute, no traceback)."""

    @functools.wraps(route)
    async def wrapped(*args, **kwargs):
        try:
            return await route(*args, **kwargs)
        except OpenAIError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped to its status; 5xx are logged
            err = errors.from_exception(e)
            if isinstance(e, StoreUnavailable):
                store_failed(e, "an HTTP request")
            elif err.status >= 500:
                log.exception("HTTP request failed")
            raise err from None

    return wrapped


def build_app(server: "SidecarServer", options: HttpOptions | None = None) -> FastAPI:
    o = options or HttpOptions()
    model = o.served_model_name or server.engine.model_dir.name
    backend = SessionBackend(server, model)
    chat = ChatCompletions(backend)
    responses = Responses(backend)
    cache = CacheControl(backend, chat)
    app = FastAPI(title="chainkv", docs_url=None, redoc_url=None, openapi_url=None)
    errors.install(app)
    guard = functools.partial(_openai_errors, store_failed=server.store_failed)
    app.state.backend, app.state.chat, app.state.responses = backend, chat, responses
    app.state.cache_control = cache
    created = int(time.time())

    async def body(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > o.max_body_bytes):
            raise OpenAIError(
                413, f"the request body is larger than {o.max_body_bytes} bytes", code="request_too_large"
            )
        raw = await request.body()
        if len(raw) > o.max_body_bytes:
            raise OpenAIError(
                413, f"the request body is larger than {o.max_body_bytes} bytes", code="request_too_large"
            )
        return body_object(raw)

    def model_card() -> dict:
        return {
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "chainkv",
            "max_model_len": server.engine.max_model_len,
        }

    @app.get("/health")
    async def health():
        if not server.serving:  # draining, the engine failed, or the store does not answer
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    @guard
    async def list_models(authorization: str | None = Header(None)):
        backend.tenant(authorization)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    @guard
    async def get_model(model_id: str, authorization: str | None = Header(None)):
        backend.tenant(authorization)
        if model_id != model:
            raise OpenAIError(
                404, f"The model {model_id[:200]!r} does not exist", param="model", code="model_not_found"
            )
        return model_card()

    @app.post("/v1/chat/completions")
    @guard
    async def chat_completions(
        request: Request, authorization: str | None = Header(None), x_session_id: str | None = Header(None)
    ):
        out = await chat.create(await body(request), authorization, x_session_id)
        if isinstance(out, dict):
            return out
        return StreamingResponse(out, media_type="text/event-stream", headers=SSE_HEADERS)

    @app.post("/v1/responses")
    @guard
    async def create_response(request: Request, authorization: str | None = Header(None)):
        out = await responses.create(await body(request), authorization)
        if isinstance(out, dict):
            return out
        return StreamingResponse(out, media_type="text/event-stream", headers=SSE_HEADERS)

    @app.get("/v1/responses/{response_id}")
    @guard
    async def get_response(response_id: str, authorization: str | None = Header(None)):
        return await responses.get(response_id, authorization)

    @app.delete("/v1/responses/{response_id}")
    @guard
    async def delete_response(response_id: str, authorization: str | None = Header(None)):
        return await responses.delete(response_id, authorization)

    @app.post("/v1/prefix_cache/{action}")
    @guard
    async def prefix_cache(action: str, request: Request, authorization: str | None = Header(None)):
        handler = {
            "inspect": cache.inspect,
            "match": cache.match,
            "delete_subtree": cache.delete_subtree,
            "set_eviction_priority": cache.set_eviction_priority,
        }.get(action)
        if action == "prune":
            return JSONResponse(await cache.prune(await body(request), authorization), status_code=202)
        if handler is None:
            backend.tenant(authorization)  # an unknown action is no hint to a caller without a token
            raise OpenAIError(404, f"no prefix_cache action {action[:100]!r}", "not_found_error")
        return await handler(await body(request), authorization)

    @app.get("/v1/prefix_cache/prune/{prune_id}")
    @guard
    async def prune_status(prune_id: str, authorization: str | None = Header(None)):
        return cache.prune_status(prune_id, authorization)

    return app


class HttpFront:
    """uvicorn serving ``build_app`` on the running event loop (the gRPC server's)."""

    def __init__(self, server: "SidecarServer", options: HttpOptions | None = None):
        self.options = options or HttpOptions()
        self.app = build_app(server, self.options)
        self.port: int | None = None
        self._server = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        import uvicorn

        o = self.options
        config = uvicorn.Config(
            self.app,
            host=o.host,
            port=o.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        self._server.capture_signals = contextlib.nullcontext  # the sidecar owns SIGINT / SIGTERM
        # bound here, so a port in use is one PortUnavailable (uvicorn would log it and exit the process)
        sock = bind(o.host, o.port, "--http-port")
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="chainkv-http")
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()  # raises why it could not start
                raise OSError(f"cannot serve HTTP on {o.host}:{o.port}")
            await asyncio.sleep(0.02)
        self.port = sock.getsockname()[1]
        log.info("chainkv OpenAI-compatible HTTP on %s:%d", o.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._task is not None:
                await asyncio.gather(self._task, return_exceptions=True)
            self._server = None
