"""Structured logs: one JSON object per line (``--log-format json``), with the request's tenant and session.

    {"ts": "2026-12-03T11:52:07.310Z", "level": "INFO", "logger": "sidecar.grpc.metrics", "msg": "rpc",
     "rpc": "Turn", "code": "OK", "seconds": 0.412, "tenant": "alpha", "session_id": "s1"}

Each Sidecar call binds its tenant and session id (``bind_request``) in a context variable, so
every record logged while serving it carries them, whichever module logs. Fields passed as
``extra={"fields": {...}}`` are merged into the object. ``text`` keeps the plain format.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

_request: contextvars.ContextVar[dict | None] = contextvars.ContextVar("chainkv_request", default=None)

LOG_FORMATS = ("text", "json")


def bind_request(tenant: str, session_id: str) -> None:
    """Tag the records logged from here on in this task with the caller's tenant and session."""
    _request.set({"tenant": tenant, "session_id": session_id})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        out = {"ts": ts, "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        bound = _request.get()
        if bound:
            out.update(bound)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger: ``text`` (human) or ``json`` (one object per line on stderr)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {fmt!r}")
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
