"""SparseEngine's chain protocol on /v1/chat/completions (sidecar/http/chain_protocol.py), driven as
its client drives it: the whole conversation every time, ``chain_id`` null first, then the id the
server gave with ``chain_append_start`` at the first message the chain does not hold; a 410 retried
once with the whole prompt and ``chain_id`` null."""

from __future__ import annotations

import json

import pytest
from http_fixtures import call, chat, live_server, reply_of

SYSTEM = {"role": "system", "content": "You answer briefly."}


@pytest.fixture(scope="module")
def live(tiny_chat_dir, tmp_path_factory):
    yield from live_server(tiny_chat_dir, tmp_path_factory)


def _start(live, text: str = "count to three", token: str = "tok-alpha"):
    """A new chain: (its id, the messages with the reply, the first response)."""
    msgs = [SYSTEM, {"role": "user", "content": text}]
    r = chat(live, msgs, token, chain_id=None)
    assert r.status_code == 200, r.text
    return r.json()["chain_id"], msgs + [reply_of(r)], r.json()


def _inspect(live, chain_id: str, token: str = "tok-alpha") -> dict:
    r = call(live, "/prefix_cache/inspect", {"session_id": chain_id}, token)
    assert r.status_code == 200, r.text
    return r.json()


def test_created_then_resumed_reports_the_reused_history(live):
    chain_id, msgs, first = _start(live)
    assert first["chain_status"] == "created" and chain_id.startswith("chain-")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < first["usage"]["prompt_tokens"]
    start = len(msgs)
    msgs.append({"role": "user", "content": "and on to five"})
    r = chat(live, msgs, chain_id=chain_id, chain_append_start=start)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["chain_id"] == chain_id and body["chain_status"] == "resumed"
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1
    # without chain_append_start the chain resumes from the longest prefix it holds
    msgs += [reply_of(r), {"role": "user", "content": "and six"}]
    r = chat(live, msgs, chain_id=chain_id)
    assert r.json()["chain_status"] == "resumed"
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > cached
    assert _inspect(live, chain_id)["turn_index"] == 3


def test_the_openai_client_streams_the_chain_fields(live):
    c = live.client()
    msgs = [SYSTEM, {"role": "user", "content": "hello"}]
    chunks = list(
        c.chat.completions.create(
            model=live.model, messages=msgs, max_tokens=5, stream=True, extra_body={"chain_id": None}
        )
    )
    fields = {(ch.model_extra["chain_id"], ch.model_extra["chain_status"]) for ch in chunks}
    assert len(fields) == 1 and next(iter(fields))[1] == "created"
    chain_id = next(iter(fields))[0]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}]
    r = c.chat.completions.create(
        model=live.model, messages=msgs, max_tokens=5, extra_body={"chain_id": chain_id, "chain_append_start": 3}
    )
    assert r.model_extra["chain_status"] == "resumed" and r.usage.prompt_tokens_details.cached_tokens > 0


def test_an_edited_prefix_is_a_409_and_the_chain_stays_as_it_was(live):
    chain_id, msgs, _ = _start(live)
    before = _inspect(live, chain_id)
    edited = [SYSTEM, {"role": "user", "content": "count to four"}, msgs[2], {"role": "user", "content": "go on"}]
    for extra in ({"chain_append_start": 3}, {}):
        r = chat(live, edited, chain_id=chain_id, **extra)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "chain_prefix_mismatch"
    assert _inspect(live, chain_id) == before
    r = chat(live, msgs + [{"role": "user", "content": "go on"}], chain_id=chain_id, chain_append_start=3)
    assert r.json()["chain_status"] == "resumed"
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_gone_chain_is_410_and_the_clients_full_prompt_retry_succeeds(live):
    chain_id, msgs, _ = _start(live)
    r = call(live, "/prefix_cache/delete_subtree", {"chain_id": chain_id})
    assert r.status_code == 200, r.text
    msgs.append({"role": "user", "content": "still there?"})
    r = chat(live, msgs, chain_id=chain_id, chain_append_start=3)
    assert r.status_code == 410, r.text
    assert r.json()["error"]["code"] == "chain_gone" and "chain_gone" in r.text
    retry = chat(live, msgs, chain_id=None)  # what SparseEngine's client sends after a 410
    assert retry.status_code == 200, retry.text
    assert retry.json()["chain_status"] == "created" and retry.json()["chain_id"] != chain_id


def test_an_unknown_chain_and_another_tenants_chain_are_the_same_404(live):
    chain_id, msgs, _ = _start(live, token="tok-beta")
    msgs.append({"role": "user", "content": "next"})
    theirs = chat(live, msgs, chain_id=chain_id, chain_append_start=3)
    unknown_id = "chain-" + "x" * len(chain_id[6:])
    unknown = chat(live, msgs, chain_id=unknown_id, chain_append_start=3)
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json()["error"]["code"] == "chain_not_found"
    assert theirs.json()["error"]["message"].replace(chain_id, "ID") == unknown.json()["error"]["message"].replace(
        unknown_id, "ID"
    )
    assert chat(live, msgs, "tok-beta", chain_id=chain_id, chain_append_start=3).status_code == 200


HOSTILE_STARTS = [-1, 0, 2, 4, 5, 10**30, -(10**30), "3", 3.0, 2.5, True, False, [3], {"i": 3}]


@pytest.mark.parametrize("start", HOSTILE_STARTS, ids=[json.dumps(s) for s in HOSTILE_STARTS])
def test_a_hostile_chain_append_start_is_a_400_and_leaves_the_chain_as_it_was(live, start):
    chain_id, msgs, _ = _start(live)
    msgs.append({"role": "user", "content": "next"})  # 4 messages: 3 is the only valid start (2 is a user's)
    before = _inspect(live, chain_id)
    r = chat(live, msgs, chain_id=chain_id, chain_append_start=start)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chain_append_start"
    assert _inspect(live, chain_id) == before
    r = chat(live, msgs, chain_id=chain_id, chain_append_start=3)
    assert r.json()["chain_status"] == "resumed"


@pytest.mark.parametrize(
    "fields",
    [
        {"chain_id": "c" * 129},
        {"chain_id": "a/b"},
        {"chain_id": "{tag}"},
        {"chain_id": "..."},
        {"chain_id": ""},
        {"chain_id": "ok\n"},
        {"chain_id": 7},
        {"chain_id": ["chain-1"]},
        {"chain_id": "chain-1", "prompt_cache_key": "thread"},
        {"chain_append_start": 1},
        {"chain_id": None, "chain_append_start": 1},
    ],
)
def test_hostile_chain_ids_are_400(live, fields):
    msgs = [SYSTEM, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]
    r = chat(live, msgs, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("chain_id", "chain_append_start")
    assert "Traceback" not in r.text


def test_a_chain_ended_by_grpc_end_session_is_gone_too(live):
    import grpc

    from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
    from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc as pbg

    chain_id, msgs, _ = _start(live)
    with grpc.insecure_channel(f"127.0.0.1:{live.thread.server.port}") as channel:
        pbg.SidecarStub(channel).EndSession(
            pb.EndSessionRequest(session_id=chain_id), metadata=[("authorization", "Bearer tok-alpha")]
        )
    r = chat(live, msgs + [{"role": "user", "content": "hello?"}], chain_id=chain_id, chain_append_start=3)
    assert r.status_code == 410 and r.json()["error"]["code"] == "chain_gone"
