"""The OpenAI-compatible HTTP front on two replicas sharing a real Redis (tests/redis_server.py): a
3-turn chat with a tool round trip whose turns alternate between the replicas, by Chat Completions
(``prompt_cache_key`` names the session) and by the Responses API (``previous_response_id``), with
the official ``openai`` client. Each replica has its own engine (tiny random model with SmolLM2's
tokenizer); a turn served by the other replica picks the session up from its Redis snapshot, so
its context is reused, not prefilled again."""

from __future__ import annotations

import json

import jsonschema
import pytest

from test_http_front import FORCE, TOOLS, WEATHER, Live, _complete, _respond

from tests.conftest import make_engine


@pytest.fixture(scope="module")
def replicas(tiny_chat_dir, redis_proc):
    from sidecar.store import RedisStore

    def replica():
        engine = make_engine(tiny_chat_dir, num_pages=6000, prefill_chunk_size=128, max_model_len=4096)
        return Live(engine, RedisStore(redis_proc.url))

    a, b = replica(), replica()
    yield a, b
    a.stop()
    b.stop()


def _flush(live: Live) -> None:
    """Wait for the replica's snapshots to be in Redis (written behind the turn by default)."""
    assert live.thread.run(live.thread.server.writer.flush(30))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_turns_alternate_between_replicas(replicas, stream):
    a, b = replicas
    key = f"replicas-chat-{stream}"
    msgs = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Oslo?"}]
    reply, u1 = _complete(
        a.client(), a.model, msgs, stream, tools=TOOLS, tool_choice=FORCE, max_tokens=96, prompt_cache_key=key
    )
    call = reply["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    _flush(a)
    msgs += [reply, {"role": "tool", "tool_call_id": call["id"], "content": '{"celsius": 4}'}]
    reply, u2 = _complete(b.client(), b.model, msgs, stream, tools=TOOLS, max_tokens=12, prompt_cache_key=key)
    _flush(b)
    msgs += [reply, {"role": "user", "content": "And tomorrow?"}]
    _, u3 = _complete(a.client(), a.model, msgs, stream, tools=TOOLS, max_tokens=12, prompt_cache_key=key)
    for before, u in ((u1, u2), (u2, u3)):
        # the other replica's snapshot held everything but this turn's new messages
        assert u.prompt_tokens > before.prompt_tokens
        assert u.prompt_tokens_details.cached_tokens >= before.prompt_tokens + before.completion_tokens - 1


@pytest.mark.parametrize("stream", [False, True])
def test_responses_previous_response_id_resolves_on_the_other_replica(replicas, stream):
    a, b = replicas
    kw = dict(tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}], max_output_tokens=96)
    first = _respond(
        a.client(),
        stream,
        model=a.model,
        input="Weather in Rome?",
        tool_choice={"type": "function", "name": "get_weather"},
        **kw,
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    _flush(a)
    second = _respond(
        b.client(),
        stream,
        model=b.model,
        previous_response_id=first.id,
        **kw,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"celsius": 20}'}],
    )
    _flush(b)
    third = _respond(a.client(), stream, model=a.model, previous_response_id=second.id, input="Thanks!", **kw)
    for before, r in ((first, second), (second, third)):
        assert r.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens + before.usage.output_tokens - 1
    _flush(a)
    assert b.client().responses.retrieve(third.id).output_text == third.output_text
    with pytest.raises(Exception) as e:  # another tenant sees none of it, on either replica
        b.client("tok-beta").responses.retrieve(third.id)
    assert getattr(e.value, "status_code", None) == 404


def _chat_keys(live: Live, tenant: str = "alpha") -> dict[str, int]:
    """The Chat Completions sessions this replica holds: key -> turn index."""
    from sidecar.http.conversations import FRONT_KEY

    def keys():
        return {
            s.key: s.turn_index
            for s in live.thread.server.sessions.all()
            if s.in_engine and FRONT_KEY in s.front and s.key.startswith(tenant + "/")
        }

    return live.thread.call(keys)


def _reused_all(before, u) -> bool:
    """``u``'s turn reused everything of the turn ``before`` (the history but this turn's messages)."""
    return u.prompt_tokens_details.cached_tokens >= before.prompt_tokens + before.completion_tokens - 1


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_without_a_cache_key_resume_on_the_other_replica(replicas, stream):
    """No prompt_cache_key: the session is found by its transcript in the store's index, on any replica."""
    a, b = replicas
    msgs = [{"role": "user", "content": f"Tell me a story about {'rivers' if stream else 'hills'}."}]
    had = _chat_keys(a)
    reply, u1 = _complete(a.client(), a.model, msgs, stream, max_tokens=12)
    (key,) = set(_chat_keys(a)) - set(had)
    _flush(a)
    turn2 = msgs + [reply, {"role": "user", "content": "Go on."}]

    # another tenant sending the same conversation gets a session of its own
    _, ub = _complete(b.client("tok-beta"), b.model, turn2, stream, max_tokens=4)
    assert not _reused_all(u1, ub) and key not in _chat_keys(b, "beta")
    # an edited history (the reply, or the question before it) does not continue the session
    edited_reply = msgs + [dict(reply, content=reply["content"] + " (edited)"), turn2[-1]]
    edited_question = [{"role": "user", "content": msgs[0]["content"] + "!"}] + turn2[1:]
    for edited in (edited_reply, edited_question):
        _, ue = _complete(b.client(), b.model, edited, stream, max_tokens=4)
        assert not _reused_all(u1, ue) and key not in _chat_keys(b)

    reply2, u2 = _complete(b.client(), b.model, turn2, stream, max_tokens=12)
    assert _reused_all(u1, u2) and u2.prompt_tokens > u1.prompt_tokens
    assert _chat_keys(b)[key] == 2  # the same session, resumed from A's snapshot
    _flush(b)
    turn3 = turn2 + [reply2, {"role": "user", "content": "The end?"}]
    _, u3 = _complete(a.client(), a.model, turn3, stream, max_tokens=12)
    assert _reused_all(u2, u3) and u3.prompt_tokens > u2.prompt_tokens
    assert _chat_keys(a)[key] == 3  # back on A: its older copy gave way to B's snapshot


def _live_on_a_folder(tiny_chat_dir, folder, store=None, **options) -> Live:
    """A replica with its own engine (tiny chat model) on the directory store ``folder`` (or ``store``):
    a restarted server, or a second replica sharing the folder."""
    from sidecar.store import open_store

    engine = make_engine(tiny_chat_dir, num_pages=2000, prefill_chunk_size=128, max_model_len=4096)
    return Live(engine, store if store is not None else open_store(str(folder)), **options)


@pytest.mark.parametrize("durability", ["async", "sync"])
def test_chat_completions_without_a_cache_key_resume_after_a_restart(tiny_chat_dir, tmp_path, durability):
    """The directory store: a restarted server (a fresh engine on the same folder) finds the session;
    with durability sync too (the turn's snapshot is written before its reply is sent, and carries
    the reply's transcript digest)."""

    def server():
        return _live_on_a_folder(tiny_chat_dir, tmp_path / "sessions", durability=durability)

    first = server()
    try:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
        reply, u1 = _complete(first.client(), first.model, msgs, False, max_tokens=12)
        (key,) = _chat_keys(first)
        _flush(first)
    finally:
        first.stop()
    second = server()
    try:
        turn2 = msgs + [reply, {"role": "user", "content": "Another."}]
        _, u2 = _complete(second.client(), second.model, turn2, False, max_tokens=12)
        assert _reused_all(u1, u2)
        assert _chat_keys(second) == {key: 2}
    finally:
        second.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_responses_with_durability_sync_resolve_after_the_replica_stops_writing(tiny_chat_dir, tmp_path, stream):
    """Durability sync: a response the client got is in the store with its turn, before the reply is sent.
    Right after each response the replica's store stops taking writes (as if it had died there), and a
    second replica on the same store retrieves that response and continues from it."""
    from sidecar.store import DirectoryStore
    from sidecar.store.errors import StoreUnavailable

    class DiesAfterTheReply(DirectoryStore):
        frozen = False

        def save(self, key, stored, expected_generation):
            if self.frozen:
                raise StoreUnavailable("this replica is gone")
            return super().save(key, stored, expected_generation)

    folder = tmp_path / "sessions"
    dying = DiesAfterTheReply(folder)
    first = _live_on_a_folder(
        tiny_chat_dir, folder, store=dying, durability="sync", flush_timeout_s=0.5, snapshot_retry_max_s=0.1
    )
    second = None
    try:
        r1 = _respond(first.client(), stream, model=first.model, input="Name a colour.", max_output_tokens=8)
        dying.frozen = True
        second = _live_on_a_folder(tiny_chat_dir, folder, durability="sync")
        c = second.client()
        assert c.responses.retrieve(r1.id).output_text == r1.output_text
        r2 = _respond(c, stream, model=second.model, input="Another.", previous_response_id=r1.id, max_output_tokens=8)
        assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens + r1.usage.output_tokens - 1
    finally:
        first.stop()
        if second is not None:
            second.stop()


@pytest.mark.parametrize("durability", ["async", "sync"])
def test_a_deleted_response_is_gone_from_the_store_too(tiny_chat_dir, tmp_path, durability):
    """``DELETE /v1/responses/{id}`` changes only the session's front metadata, not its KV: the snapshot
    is written at the same generation (durability sync: before the DELETE is answered), so a restarted
    replica on the same store does not find the response either."""
    import openai

    def server():
        return _live_on_a_folder(tiny_chat_dir, tmp_path / "sessions", durability=durability)

    first = server()
    try:
        c = first.client()
        kept = c.responses.create(model=first.model, input="Name a colour.", max_output_tokens=8)
        gone = c.responses.create(
            model=first.model, input="Another.", previous_response_id=kept.id, max_output_tokens=8
        )
        _flush(first)
        c.responses.delete(gone.id)
        if durability == "async":
            _flush(first)
        second = server()
    finally:
        first.stop()
    try:
        c = second.client()
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(gone.id)
        assert c.responses.retrieve(kept.id).output_text == kept.output_text
    finally:
        second.stop()
