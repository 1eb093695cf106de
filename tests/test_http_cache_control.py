"""Cache control over HTTP (sidecar/http/cache_control.py): /v1/prefix_cache/{inspect, match,
delete_subtree, set_eviction_priority, prune} and GET prune/{prune_id}, on sessions of the caller's
tenant; malformed orders are 400s that leave the session as it was."""

from __future__ import annotations

import json

import pytest
from http_fixtures import call, chat, live_server, reply_of

from sidecar.sessions.janitor import evict_idle

SYSTEM = {"role": "system", "content": "You answer briefly."}


@pytest.fixture(scope="module")
def live(tiny_chat_dir, tmp_path_factory):
    yield from live_server(tiny_chat_dir, tmp_path_factory)


def _session(live, key: str, token: str = "tok-alpha", turns: int = 2):
    """A session named by ``prompt_cache_key``: (its session id, its messages so far)."""
    msgs = [SYSTEM]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"tell me about {key}, part {i}"})
        r = chat(live, msgs, token, prompt_cache_key=key)
        msgs.append(reply_of(r))
    return "pck-" + key, msgs


def _ok(r, status: int = 200) -> dict:
    assert r.status_code == status, r.text
    return r.json()


def _inspect(live, sid: str, token: str = "tok-alpha") -> dict:
    return _ok(call(live, "/prefix_cache/inspect", {"session_id": sid}, token))


def _same_404(a, b, id_a: str, id_b: str) -> None:
    """Two 404s whose bodies differ only in the id each names."""
    assert a.status_code == b.status_code == 404
    assert a.json()["error"]["code"] in ("session_not_found", "prune_not_found")
    assert a.text.replace(id_a, "ID") == b.text.replace(id_b, "ID")


def _wait(live, prune_id: str, token: str = "tok-alpha") -> dict:
    live.thread.run(live.http.app.state.cache_control.jobs.wait_all())
    return _ok(call(live, f"/prefix_cache/prune/{prune_id}", None, token))


def test_inspect_reports_tier_spans_and_method(live):
    sid, _ = _session(live, "inspected")
    info = _inspect(live, sid)
    assert info["tier"] == "gpu" and info["state"] == "idle" and info["turn_index"] == 2
    assert info["history_tokens"] > 0 and info["kv_tokens"] > 0 and info["kept_tokens_source"] == "gpu"
    assert info["method"]["method"] and info["eviction_priority"] == 0
    spans = info["spans"]
    assert spans and {s["role"] for s in spans} >= {"user", "assistant"}
    *earlier, last = sorted(spans, key=lambda s: s["start"])
    for s in earlier:  # full attention: every token of every span keeps its KV
        assert s["kept_tokens"] == s["end"] - s["start"] and not s["pruned"]
    assert last["kept_tokens"] == last["end"] - last["start"] - 1  # the reply's last token is not fed yet


def test_a_session_only_in_the_store_inspects_as_stored(live):
    sid, _ = _session(live, "stored-only", turns=1)
    server = live.thread.server
    live.thread.run(server.sessions.write_now("alpha/" + sid))  # tenant alpha's key
    assert live.thread.run(evict_idle(server.sessions, 0)) >= 1
    info = _inspect(live, sid)
    assert info["tier"] == "store" and info["turn_index"] == 1 and info["history_tokens"] > 0
    assert all(s["kept_tokens"] == s["end"] - s["start"] for s in info["spans"])


def test_another_tenants_session_is_the_same_404_as_a_missing_one(live):
    sid, msgs = _session(live, "betas", token="tok-beta", turns=1)
    missing = "pck-nobody-has-it"
    for path, extra in [
        ("/prefix_cache/inspect", {}),
        ("/prefix_cache/match", {"messages": msgs}),
        ("/prefix_cache/delete_subtree", {}),
        ("/prefix_cache/set_eviction_priority", {"priority": 3}),
        ("/prefix_cache/prune", {"ranges": [[0, 1]]}),
    ]:
        theirs = call(live, path, {"session_id": sid, **extra})
        none = call(live, path, {"session_id": missing, **extra})
        _same_404(theirs, none, sid, missing)
    info = _inspect(live, sid, "tok-beta")  # untouched by alpha's calls
    assert info["eviction_priority"] == 0 and info["pruned_kv_tokens"] == 0


def test_match_counts_what_the_session_holds(live):
    sid, msgs = _session(live, "matched")
    info = _inspect(live, sid)
    ask = msgs + [{"role": "user", "content": "one more"}]
    m = _ok(call(live, "/prefix_cache/match", {"session_id": sid, "messages": ask}))
    assert m["matched_messages"] == len(msgs) and m["total_messages"] == len(ask)
    assert m["matched_tokens"] == info["history_tokens"] and m["resident_kv_tokens"] == info["kv_tokens"]
    # SparseEngine's shape (the chat request under "chat"), and no session named: this replica's index finds it
    found = _ok(call(live, "/prefix_cache/match", {"chat": {"model": live.model, "messages": ask}}))
    assert found["session_id"] == sid and found["matched_tokens"] == m["matched_tokens"]
    edited = [SYSTEM, {"role": "user", "content": "something else"}] + msgs[2:]
    m = _ok(call(live, "/prefix_cache/match", {"session_id": sid, "messages": edited}))
    assert m["matched_messages"] == 0 and m["matched_tokens"] == 0
    assert _ok(call(live, "/prefix_cache/match", {"messages": edited}))["session_id"] is None


def test_delete_subtree_ends_the_session(live):
    sid, msgs = _session(live, "deleted", turns=1)
    out = _ok(call(live, "/prefix_cache/delete_subtree", {"session_id": sid}))
    assert out["deleted"] and out["ended_here"]
    assert call(live, "/prefix_cache/inspect", {"session_id": sid}).status_code == 404
    assert call(live, "/prefix_cache/delete_subtree", {"session_id": sid}).status_code == 404
    r = chat(live, msgs + [{"role": "user", "content": "again"}], prompt_cache_key="deleted")
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] < r.json()["usage"]["prompt_tokens"] // 2


def test_set_eviction_priority_reaches_the_engine_and_the_snapshot(live):
    sid, msgs = _session(live, "prioritized", turns=1)
    out = _ok(call(live, "/prefix_cache/set_eviction_priority", {"session_id": sid, "priority": 7}))
    assert out["eviction_priority"] == 7 and _inspect(live, sid)["eviction_priority"] == 7
    server = live.thread.server
    key = "alpha/" + sid  # tenant alpha's session key
    assert server.engine.chains.chains[key].eviction_priority == 7
    live.thread.run(server.sessions.write_now(key))
    live.thread.run(evict_idle(server.sessions, 0))
    assert _inspect(live, sid)["eviction_priority"] == 7  # from the store's copy
    assert key not in server.engine.chains.chains
    chat(live, msgs + [{"role": "user", "content": "next"}], prompt_cache_key="prioritized")  # loads it
    assert server.engine.chains.chains[key].eviction_priority == 7
    _ok(call(live, "/prefix_cache/set_eviction_priority", {"session_id": sid, "priority": -2}))
    assert server.engine.chains.chains[key].eviction_priority == -2


@pytest.mark.parametrize("priority", [True, 1.5, "3", None, 10**9, -1001, [1]])
def test_hostile_priorities_are_400(live, priority):
    sid, _ = _session(live, "prio-hostile", turns=1)
    r = call(live, "/prefix_cache/set_eviction_priority", {"session_id": sid, "priority": priority})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text


def _user_span(info: dict) -> dict:
    """A user span of the session past its shared prefix (pruning never touches that)."""
    return next(s for s in info["spans"] if s["role"] == "user" and s["start"] >= info["shared_prefix_tokens"])


def test_prune_is_asynchronous_and_drops_the_range(live):
    sid, msgs = _session(live, "pruned")
    before = _inspect(live, sid)
    span = _user_span(before)
    queued = _ok(call(live, "/prefix_cache/prune", {"session_id": sid, "ranges": [[span["start"], span["end"]]]}), 202)
    assert queued["prune_id"].startswith("prune-") and queued["status"] in ("queued", "running")
    assert queued["policy"] == "drop" and queued["ranges"] == [[span["start"], span["end"]]]
    done = _wait(live, queued["prune_id"])
    assert done["status"] == "completed" and done["error"] is None
    assert done["result"]["pruned_tokens"] == span["end"] - span["start"] and done["result"]["removed_kv_entries"] > 0
    after = _inspect(live, sid)
    pruned = next(s for s in after["spans"] if s["start"] == span["start"])
    assert pruned["pruned"] and pruned["kept_tokens"] == 0 and after["kv_tokens"] < before["kv_tokens"]
    assert after["history_tokens"] == before["history_tokens"] and after["generation"] == before["generation"] + 1
    r = chat(live, msgs + [{"role": "user", "content": "go on"}], prompt_cache_key="pruned")  # still continues
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # another tenant cannot read the job
    _same_404(
        call(live, f"/prefix_cache/prune/{queued['prune_id']}", None, "tok-beta"),
        call(live, "/prefix_cache/prune/prune-unknown", None, "tok-beta"),
        queued["prune_id"],
        "prune-unknown",
    )


def test_a_prune_the_engine_refuses_fails_and_leaves_the_session(live):
    sid, _ = _session(live, "prune-refused")
    before = _inspect(live, sid)
    span = _user_span(before)
    body = {"session_id": sid, "range_start": span["start"], "range_end": span["end"], "keep_tokens": 1}
    queued = _ok(call(live, "/prefix_cache/prune", {**body, "policy": "snapkv_global"}), 202)
    done = _wait(live, queued["prune_id"])  # keep_ratio ranks by recent queries, which this engine does not record
    assert done["status"] == "failed" and done["error"]["code"] == "invalid_argument" and done["result"] is None
    assert _inspect(live, sid) == before


def test_keep_tokens_keeps_that_many_of_each_range(tiny_chat_dir, tmp_path_factory):
    """On an engine that records recent queries (prune_policy keep_ratio), ``keep_tokens`` of each
    range keep their KV: the measured ``kept_tokens`` of a pruned span is exactly that many."""
    server = live_server(tiny_chat_dir, tmp_path_factory, prune_policy="keep_ratio")
    live = next(server)
    try:
        sid, _ = _session(live, "kept", turns=2)
        spans = [s for s in _inspect(live, sid)["spans"] if s["role"] == "user" and s["end"] - s["start"] > 4]
        spans = [s for s in spans if s["start"] >= _inspect(live, sid)["shared_prefix_tokens"]]
        assert len(spans) == 2  # the two user turns
        order = {"session_id": sid, "ranges": [[s["start"], s["end"]] for s in spans], "keep_tokens": 3}
        done = _wait(live, _ok(call(live, "/prefix_cache/prune", order), 202)["prune_id"])
        assert done["status"] == "completed" and done["policy"] == "keep_ratio", done
        after = {s["start"]: s for s in _inspect(live, sid)["spans"]}
        assert all(after[s["start"]]["kept_tokens"] == 3 and after[s["start"]]["pruned"] for s in spans)
    finally:
        next(server, None)


MALFORMED = [
    {"ranges": [[-1, 3]]},
    {"ranges": [[5, 2]]},
    {"ranges": [[3, 3]]},
    {"ranges": [[0, 10**7]]},
    {"ranges": [[0, 2**63]]},
    {"ranges": [["0", 2]]},
    {"ranges": [[0.0, 2]]},
    {"ranges": [[True, 2]]},
    {"ranges": [[0, 2, 4]]},
    {"ranges": [0, 2]},
    {"ranges": [{"start": 0}]},
    {"ranges": []},
    {"ranges": "0-2"},
    {"ranges": [[0, 4], [2, 6]]},
    {"ranges": [[i, i + 1] for i in range(65)]},
    {"range_start": 2},
    {},
    {"ranges": [[0, 4]], "keep_tokens": 4},
    {"ranges": [[0, 4]], "keep_tokens": -1},
    {"ranges": [[0, 4]], "keep_tokens": 1.5},
    {"ranges": [[0, 4]], "keep_tokens": 1, "policy": "drop"},
    {"ranges": [[0, 4]], "policy": "keep_ratio"},
    {"ranges": [[0, 4]], "policy": "kvzip_global"},
    {"ranges": [[0, 4]], "policy": 3},
    {"ranges": [[0, 4]], "scope": "everywhere"},
    {"ranges": [[0, 4]], "session_id": "a/b"},
    {"ranges": [[0, 4]], "session_id": 12},
]


@pytest.mark.parametrize("order", MALFORMED, ids=[json.dumps(m)[:60] for m in MALFORMED])
def test_malformed_prune_orders_are_400_and_leave_the_session(live, order):
    sid, _ = _session(live, "prune-hostile", turns=1)
    before = _inspect(live, sid)
    jobs = live.http.app.state.cache_control.jobs
    known = len(jobs._jobs)
    r = call(live, "/prefix_cache/prune", {"session_id": sid, **order})
    assert r.status_code == 400, r.text
    assert "Traceback" not in r.text and r.json()["error"]["type"] == "invalid_request_error"
    assert len(jobs._jobs) == known and _inspect(live, sid) == before


def test_every_endpoint_needs_a_token_and_unknown_actions_are_404(live):
    for path in ("inspect", "match", "delete_subtree", "set_eviction_priority", "prune"):
        assert call(live, f"/prefix_cache/{path}", {"session_id": "x"}, token="nope").status_code == 401
    assert call(live, "/prefix_cache/prune/prune-x", None, token="nope").status_code == 401
    assert call(live, "/prefix_cache/flush", {"session_id": "x"}).status_code == 404
    assert call(live, "/prefix_cache/inspect", {"session_id": "x" * 129}).status_code == 400
