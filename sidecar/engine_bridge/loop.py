"""EngineLoop: the LLMEngine on its own thread, beside the asyncio gRPC server (used through
``sidecar.engine_bridge.client.EngineClient``, never directly).

The engine is not thread-safe, so one thread owns it. Between forward passes that thread runs the
commands the server sends (``call``: add a turn, abort, snapshot, load, fork, ...), then steps the
engine while any request is unfinished and hands every output to the sink registered for its
request id. Sinks run on the engine thread; the server's sinks pass outputs to the event loop with
``call_soon_threadsafe`` into an asyncio queue, so a slow client never stalls the engine. With
nothing to run it sleeps until the next command, or until a session in host memory falls due to be
prefetched onto the GPU before its agent's next turn (``LLMEngine.prefetch``).

If a step raises (a bug, or the device failing), every running request gets the error, the loop
is marked failed (health turns NOT_SERVING) and later calls raise ``EngineFailed``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import Any, Callable, Hashable

from engine.api import LLMEngine, RequestOutput

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput | BaseException], None]


class EngineFailed(RuntimeError):
    """The engine thread stopped after an error; the server cannot run turns any more."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_failure: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.on_failure = on_failure
        self._cv = threading.Condition()
        self._commands: deque = deque()
        self._sinks: dict[Hashable, Sink] = {}
        self._stop = False
        self.failed: BaseException | None = None
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="chainkv-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- lifecycle ----------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread.start()

    @property
    def running(self) -> bool:
        """The thread runs and takes commands (started, not stopped, not failed)."""
        return self._thread.is_alive() and not self._stop and self.failed is None

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- commands -----------------------------------------------------------------------------------
    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the engine thread between steps; its result or exception."""
        if self.failed is not None:
            raise EngineFailed(f"the engine stopped: {self.failed!r}")
        fut = self._loop.create_future()
        self._put((fn, args, kwargs, fut))
        return await fut

    def post(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run ``fn`` on the engine thread without waiting (safe from a cancelled task)."""
        self._put((fn, args, kwargs, None))

    def register(self, request_id: Hashable, sink: Sink) -> None:
        """Send ``request_id``'s outputs to ``sink`` (call on the engine thread, e.g. inside ``call``)."""
        self._sinks[request_id] = sink

    def unregister(self, request_id: Hashable) -> None:
        self._sinks.pop(request_id, None)

    def _put(self, item) -> None:
        with self._cv:
            self._commands.append(item)
            self._cv.notify()

    # --- the thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._steps()
        except BaseException as e:  # the thread itself broke: nothing may wait on it forever
            self._fail(e)
            with self._cv:
                commands = list(self._commands)
                self._commands.clear()
            for *_, fut in commands:
                self._resolve(fut, error=EngineFailed(f"the engine thread stopped: {e}"))

    def _steps(self) -> None:
        eng = self.engine
        if eng.device.type == "cuda":  # kernels and CUDA graphs launch on the engine's device from this thread
            import torch

            # "cuda" without an index means the current device; set_device needs an index
            torch.cuda.set_device(eng.device.index if eng.device.index is not None else torch.cuda.current_device())
        while True:
            with self._cv:
                while not self._commands and not self._stop and not (eng.has_unfinished() and self.failed is None):
                    wake_s = eng.next_prefetch_in() if self.failed is None else None
                    if not self._cv.wait(wake_s):  # a session in host memory falls due: prefetched below
                        break
                if self._stop:
                    commands = list(self._commands)
                    self._commands.clear()
                    for *_, fut in commands:
                        self._resolve(fut, error=EngineFailed("the engine is shutting down"))
                    return
                commands = list(self._commands)
                self._commands.clear()
            for fn, args, kwargs, fut in commands:
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # handed to the caller
                    if fut is None:
                        log.warning("engine command %s failed: %s", getattr(fn, "__name__", fn), e)
                    self._resolve(fut, error=e)
                else:
                    self._resolve(fut, result=result)
            if self.failed is None and eng.has_unfinished():
                try:
                    outputs = eng.step()
                except BaseException as e:
                    self._fail(e)
                    continue
                self.steps += 1
                for out in outputs:
                    sink = self._sinks.get(out.request_id)
                    if out.finished:
                        self._sinks.pop(out.request_id, None)
                    if sink is not None:
                        try:
                            sink(out)
                        except Exception:
                            log.exception("output sink for %r failed", out.request_id)
            if self.failed is None and not eng.has_unfinished():
                try:  # idle: sessions whose agents are due back come onto the GPU before their turns
                    eng.prefetch()
                except BaseException as e:
                    self._fail(e)

    def _resolve(self, fut: asyncio.Future | None, result: Any = None, error: BaseException | None = None) -> None:
        if fut is None:
            return

        def settle():
            if fut.cancelled():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the event loop is closed (shutdown)
            pass

    def _fail(self, error: BaseException) -> None:
        log.error("engine step failed; the engine stops serving turns", exc_info=error)
        self.failed = error
        for rid, sink in list(self._sinks.items()):
            try:
                sink(error)
            except Exception:
                pass
            try:
                self.engine.abort(rid)
            except Exception:
                pass
        self._sinks.clear()
        if self.on_failure is not None:
            self._loop.call_soon_threadsafe(self.on_failure, error)
