"""Helpers of the chain-protocol and cache-control tests: a live sidecar with its HTTP front on the
tiny chat model and a directory store (``Live`` of test_http_front; each module's ``live`` fixture
yields from ``live_server``), and raw JSON calls to it."""

from __future__ import annotations

import httpx
from test_http_front import Live

from tests.conftest import make_engine


def live_server(tiny_chat_dir, tmp_path_factory, **engine_settings):
    """``engine_settings``: more ``EngineConfig`` fields."""
    from sidecar.store import open_store

    engine = make_engine(tiny_chat_dir, num_pages=4000, prefill_chunk_size=128, max_model_len=4096, **engine_settings)
    server = Live(engine, open_store(str(tmp_path_factory.mktemp("chain-store"))))
    yield server
    server.stop()


def call(live, path: str, body: dict | None = None, token: str = "tok-alpha") -> httpx.Response:
    """POST ``body`` (GET without one) to ``/v1<path>``."""
    headers = {"Authorization": f"Bearer {token}"}
    url = live.url + path
    if body is None:
        return httpx.get(url, headers=headers, timeout=120)
    return httpx.post(url, json=body, headers=headers, timeout=120)


def chat(live, messages: list, token: str = "tok-alpha", **fields) -> httpx.Response:
    body = {"model": live.model, "messages": messages, "max_tokens": 6, **fields}
    return call(live, "/chat/completions", body, token)


def reply_of(r: httpx.Response) -> dict:
    """The assistant message of a completion, as a client echoes it back."""
    assert r.status_code == 200, r.text
    m = r.json()["choices"][0]["message"]
    return {"role": "assistant", "content": m["content"] or ""}
