"""Sessions expire by ``session_ttl_s`` (ServerOptions, ``--session-ttl-s``, YAML ``session_ttl_s``):
a session left unused that long is ended on the replica, with or without a store, and its stored
snapshot expires by the store's TTL; a session in use is kept. On a tiny random model."""

from __future__ import annotations

import time

import grpc
import pytest

from agent_adapters.client import ChainKVClient, ChainKVError
from sidecar.grpc.options import ServerOptions
from tests.conftest import make_engine


@pytest.fixture(scope="module")
def engine(tiny_chat_dir):
    return make_engine(tiny_chat_dir, num_pages=2000, prefill_chunk_size=128, max_model_len=1024)


def _gone(c: ChainKVClient, sid: str, wait_s: float = 60.0) -> bool:
    """Poll GetSession until NOT_FOUND (the janitor runs every second at these TTLs)."""
    until = time.monotonic() + wait_s
    while time.monotonic() < until:
        try:
            c.get_session(sid)
        except ChainKVError as e:
            if e.code is grpc.StatusCode.NOT_FOUND:
                return True
            raise
        time.sleep(0.2)
    return False


def _server(engine, store=None, **kw):
    from sidecar.grpc.server import ServerThread

    server = ServerThread(engine, ServerOptions(port=0, **kw), store)
    return server, f"127.0.0.1:{server.start()}"


def test_an_unused_session_expires_without_a_store(engine):
    server, target = _server(engine, session_ttl_s=1.0)
    try:
        with ChainKVClient(target) as c:
            c.turn("ttl-1", [{"role": "user", "content": "hi"}], max_tokens=2)
            assert c.get_session("ttl-1").turn_index == 1
            assert _gone(c, "ttl-1")
            assert not any(k.endswith("ttl-1") for k in engine.chains.chains)
            again = c.turn("ttl-1", [{"role": "user", "content": "hi"}], max_tokens=2)  # a new session
            assert again.turn_index == 0
    finally:
        server.stop(grace=1)


def test_a_stored_snapshot_expires_by_the_same_ttl(engine, tmp_path):
    from sidecar.store import open_store

    store = open_store(str(tmp_path / "sessions"), ttl_s=1.5)
    server, target = _server(engine, store, session_ttl_s=1.5, durability="sync")  # written before the reply
    try:
        with ChainKVClient(target) as c:
            c.turn("ttl-2", [{"role": "user", "content": "hi"}], max_tokens=2)
            assert store.load("ttl-2", False) is not None
            assert _gone(c, "ttl-2")  # neither on the replica nor (expired) in the store
            assert store.load("ttl-2", False) is None
    finally:
        server.stop(grace=1)


def test_a_session_in_use_is_kept(engine):
    server, target = _server(engine, session_ttl_s=3.0)
    try:
        with ChainKVClient(target) as c:
            c.turn("ttl-3", [{"role": "user", "content": "hi"}], max_tokens=2)
            for i in range(4):  # a turn every second: never unused for 3 s
                time.sleep(1.0)
                assert c.turn("ttl-3", [{"role": "user", "content": "more"}], max_tokens=2).turn_index == i + 1
    finally:
        server.stop(grace=1)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_a_bad_ttl_is_refused(bad):
    with pytest.raises(ValueError, match="session_ttl_s"):
        ServerOptions(session_ttl_s=bad)


def test_the_cli_and_yaml_name(tmp_path):
    from sidecar.cli.main import build_parser
    from sidecar.cli.serve_config import load_serve_settings

    parser = build_parser()
    assert parser.parse_args(["serve", "--store-ttl", "5"]).session_ttl_s == 5.0
    cfg = tmp_path / "c.yaml"
    cfg.write_text("session_ttl_s: 42\n")
    _, options = load_serve_settings(parser.parse_args(["serve", "--config", str(cfg)]), environ={})
    assert options.session_ttl_s == 42.0
    _, options = load_serve_settings(parser.parse_args(["serve"]), environ={"CHAINKV_SESSION_TTL_S": "7"})
    assert options.session_ttl_s == 7.0
