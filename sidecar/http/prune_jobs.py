"""Asynchronous prunings (``POST /v1/prefix_cache/prune`` answers 202 and a ``prune_id``; ``GET
/v1/prefix_cache/prune/{prune_id}`` reports it).

A job is queued, then running (it holds its session as a turn would), then ``completed`` with its
result or ``failed`` with its error (the session was busy, or ended meanwhile, or the engine's rule
refused a span). Jobs are kept on the replica that ran them, per tenant: another tenant's id is not
found, as an unknown one is. At most ``capacity`` are kept; the oldest finished ones are forgotten
first, and a new job is refused (429) while ``capacity`` are still unfinished.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from sidecar.http.errors import OpenAIError, from_exception

log = logging.getLogger(__name__)

QUEUED, RUNNING, COMPLETED, FAILED = "queued", "running", "completed", "failed"
DEFAULT_CAPACITY = 1024


@dataclass
class PruneJob:
    prune_id: str
    tenant: str
    session_id: str
    request: dict[str, Any]
    """What was asked (ranges, keep_tokens, policy, scope), echoed in the status."""
    status: str = QUEUED
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.status in (COMPLETED, FAILED)

    def body(self) -> dict[str, Any]:
        return {
            "object": "prefix_cache.prune",
            "prune_id": self.prune_id,
            "session_id": self.session_id,
            "status": self.status,
            **self.request,
            "result": self.result,
            "error": self.error,
            "created_at": self.created_at,
            "finished_at": self.finished_at,
        }


class PruneJobs:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._jobs: OrderedDict[str, PruneJob] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()

    def submit(
        self,
        tenant: str,
        session_id: str,
        request: dict[str, Any],
        work: Callable[[], Awaitable[dict[str, Any]]],
    ) -> PruneJob:
        """Queue ``work`` (its result dict becomes the job's); returns the queued job."""
        self._forget_finished()
        if len(self._jobs) >= self.capacity:
            raise OpenAIError(
                429, "too many prunings are running; retry later", "rate_limit_error", None, "too_many_prunes"
            )
        job = PruneJob("prune-" + secrets.token_urlsafe(18), tenant, session_id, request)
        self._jobs[job.prune_id] = job
        task = asyncio.ensure_future(self._run(job, work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    def get(self, tenant: str, prune_id: str) -> PruneJob | None:
        job = self._jobs.get(prune_id)
        return job if job is not None and job.tenant == tenant else None

    async def wait_all(self) -> None:
        """Wait for every job to finish (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _run(self, job: PruneJob, work: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        job.status = RUNNING
        try:
            job.result = await work()
            job.status = COMPLETED
        except Exception as e:  # noqa: BLE001 - the job reports it
            err = from_exception(e)
            if err.status >= 500:
                log.exception("prune %s failed", job.prune_id)
            job.error = err.body()["error"]
            job.status = FAILED
        finally:
            job.finished_at = time.time()

    def _forget_finished(self) -> None:
        """Drop the oldest finished jobs while the registry is full."""
        if len(self._jobs) < self.capacity:
            return
        for pid in [p for p, j in self._jobs.items() if j.finished]:
            if len(self._jobs) < self.capacity:
                break
            del self._jobs[pid]
