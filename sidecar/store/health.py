"""StoreHealth: whether the session store answers, watched while the sidecar runs.

A replica whose store is down cannot load, resume or commit sessions, so it should not be sent
work: ``SidecarServer`` reports gRPC health NOT_SERVING (and the HTTP front's ``/health`` 503)
while ``up`` is False, and SERVING again once the store answers. ``watch`` pings the store every
``interval_s`` (``SessionStore.ping``, off the event loop) and calls ``on_change(up)`` when the
answer changes, with one log line each way; a snapshot committed meanwhile (``answered``) counts as
an answer too, so health is SERVING again by the time a pending snapshot is seen committed.

While the store is down every request that needs it fails (gRPC UNAVAILABLE, HTTP 503), and so
does every snapshot the writer retries. ``failed`` is where those failures are logged: one
warning line (no traceback) at most every ``log_every_s``, counting the failures since the last.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from sidecar.store.base import SessionStore
from sidecar.store.errors import StoreError

log = logging.getLogger(__name__)


class StoreHealth:
    def __init__(
        self,
        store: SessionStore,
        *,
        interval_s: float = 2.0,
        log_every_s: float = 60.0,
        on_change: Callable[[bool], None] | None = None,
    ):
        self.store = store
        self.interval_s = interval_s
        self.log_every_s = log_every_s
        self.on_change = on_change
        self.up = True
        self.last_error: str | None = None
        self._logged_at: float | None = None
        self._unlogged = 0

    async def check(self) -> bool:
        """Ping the store once; update ``up`` (calling ``on_change`` when it changes). Returns ``up``."""
        try:
            await asyncio.to_thread(self.store.ping)
        except StoreError as e:
            self._set(False, str(e))
        else:
            self._set(True, None)
        return self.up

    async def watch(self) -> None:
        """``check`` every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check()

    def answered(self) -> None:
        """A store operation just succeeded (a snapshot committed): the store is up, whatever the last ping said."""
        self._set(True, None)

    def failed(self, error: BaseException, what: str = "a request") -> None:
        """``what`` failed because the store could not be reached: logged at most every ``log_every_s``."""
        self.last_error = str(error)
        now = time.monotonic()
        if self._logged_at is not None and now - self._logged_at < self.log_every_s:
            self._unlogged += 1
            return
        since = f" ({self._unlogged} more failure(s) since the last report)" if self._unlogged else ""
        log.warning("%s failed: the session store is unavailable: %s%s", what, error, since)
        self._logged_at, self._unlogged = now, 0

    def _set(self, up: bool, error: str | None) -> None:
        changed = up != self.up
        self.up = up
        if not changed:
            return
        if up:
            log.warning("the session store %s answers again: serving", self.store.describe())
            self._logged_at, self._unlogged = None, 0
        else:
            self.last_error = error
            log.warning(
                "the session store %s is unavailable (%s): not serving until it answers", self.store.describe(), error
            )
        if self.on_change is not None:
            self.on_change(up)
