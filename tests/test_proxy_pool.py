"""A pool of three replicas behind the real HAProxy, with the pool overlay's config
(deploy/k8s/overlays/pool/haproxy.cfg; tests/haproxy_proc.py), one Redis, SmolLM2 on the CPU,
``--durability sync`` and the HTTP front on. Agent sessions run through the proxy over gRPC (the
``agent_adapters`` client, which sends ``x-session-id`` metadata) and over HTTP (Chat Completions,
the proxy hashing on ``prompt_cache_key`` in the body). Shown:

- every turn after the first runs on the session's replica: its KV is still in that replica's
  memory (gRPC: source tier ``gpu``, the engine's memory; HTTP: the proxy's ``x-chainkv-replica``
  header) and its history is reused (cached tokens > 0);
- after one replica is SIGKILLed (and HAProxy's gRPC health check marks it DOWN), its sessions
  continue on another replica from Redis with the same greedy tokens as an uninterrupted run and
  the whole acknowledged history reused; the other sessions stay where they were;
- a Chat Completions conversation without ``prompt_cache_key`` (routed round robin) continues on
  another replica with cached tokens, found through the transcript index in the store.

Skipped only when haproxy is not installed (.ci/run installs it)."""

from __future__ import annotations

import httpx
import pytest

from haproxy_proc import HAProxy, Replica, haproxy_binary
from sidecar_proc import Sidecar, wait_for

pytestmark = pytest.mark.slow

TOKEN = "tok-alpha"
AUTH = [("authorization", f"Bearer {TOKEN}")]
REPLICA_HEADER = "x-chainkv-replica"
SYSTEM = "You are a terse assistant. Answer in a few words."
QUESTIONS = ["Name a color.", "Name a fruit.", "Name a city."]
SAMPLING = {"max_tokens": 5, "temperature": 0.0}


@pytest.fixture(scope="module")
def pool(redis_proc, tmp_path_factory):
    if haproxy_binary() is None:
        pytest.skip("haproxy is not installed (.ci/run installs the Debian package)")
    sidecars = [
        Sidecar(redis_proc.url, "--durability", "sync", "--http-port", "0", "--num-pages", "1500") for _ in "abc"
    ]
    try:
        for s in sidecars:
            s.start()
        for s in sidecars:
            s.wait_ready()
            wait_for(lambda: s.http_port, what="the HTTP front")
        replicas = [Replica(f"replica{i + 1}", s.port, s.http_port) for i, s in enumerate(sidecars)]
        proxy = HAProxy(tmp_path_factory.mktemp("haproxy"), replicas).start()
        try:
            wait_for(lambda: all(proxy.servers_are(r.name, "UP") for r in replicas), 120, "every replica UP")
            yield sidecars, replicas, proxy
        finally:
            proxy.stop()
    finally:
        for s in sidecars:
            s.stop()


def _grpc_replica_of(proxy: HAProxy, session_id: str) -> str:
    """The replica the proxy routes ``session_id``'s gRPC calls to (a GetServerInfo carrying it)."""
    import grpc

    from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
    from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc

    with grpc.insecure_channel(proxy.grpc_target) as channel:
        _, call = sidecar_pb2_grpc.SidecarStub(channel).GetServerInfo.with_call(
            pb.GetServerInfoRequest(), metadata=AUTH + [("x-session-id", session_id)], timeout=30
        )
        return dict(call.initial_metadata())[REPLICA_HEADER]


def _http_replica_of(proxy: HAProxy, key: str) -> str:
    r = httpx.get(f"{proxy.http_url}/v1/models", headers={"authorization": f"Bearer {TOKEN}", "x-session-id": key})
    r.raise_for_status()
    return r.headers[REPLICA_HEADER]


def _pick(candidates: list[str], where, victim: str) -> tuple[str, str]:
    """One candidate id routed to ``victim`` and one routed elsewhere."""
    on = {c: where(c) for c in candidates}
    return next(c for c, r in on.items() if r == victim), next(c for c, r in on.items() if r != victim)


class Chat:
    """A Chat Completions conversation over HTTP (the whole transcript sent each turn, as clients do)."""

    def __init__(self, url: str, model: str, key: str | None, system: str = SYSTEM):
        self.url, self.model, self.key = url, model, key
        self.messages = [{"role": "system", "content": system}]

    def turn(self, question: str, url: str | None = None) -> tuple[str, dict, str | None]:
        """(reply, usage, the replica header) of one turn; ``url``: send it there instead."""
        self.messages.append({"role": "user", "content": question})
        body = {"model": self.model, "messages": self.messages, **SAMPLING}
        if self.key is not None:
            body["prompt_cache_key"] = self.key  # no header: the proxy hashes on the body's key
        r = httpx.post(
            f"{url or self.url}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {TOKEN}"},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        out = r.json()
        reply = out["choices"][0]["message"]["content"]
        self.messages.append({"role": "assistant", "content": reply})
        return reply, out["usage"], r.headers.get(REPLICA_HEADER)


def _grpc_turn(client, session_id: str, i: int):
    msgs = ([{"role": "system", "content": SYSTEM}] if i == 0 else []) + [{"role": "user", "content": QUESTIONS[i]}]
    return client.turn(session_id, msgs, **SAMPLING)


def test_sessions_stay_on_their_replica_and_move_losing_nothing_when_it_dies(pool):
    from agent_adapters.client import ChainKVClient

    sidecars, replicas, proxy = pool
    model = httpx.get(f"{proxy.http_url}/v1/models", headers={"authorization": f"Bearer {TOKEN}"}).json()["data"][0][
        "id"
    ]

    # a conversation without prompt_cache_key: round robin; the replica it lands on is the one to die
    keyless = Chat(proxy.http_url, model, None, system="You are a terse assistant who names things.")
    _, keyless_u1, victim = keyless.turn(QUESTIONS[0])
    assert victim in {r.name for r in replicas}
    dead = next(s for s, r in zip(sidecars, replicas) if r.name == victim)
    survivor = next(s for s, r in zip(sidecars, replicas) if r.name != victim)

    # sessions whose ids the proxy's ring puts on the victim, and one elsewhere, for each protocol
    g_moved, g_stays = _pick([f"pool-g{i}" for i in range(24)], lambda c: _grpc_replica_of(proxy, c), victim)
    h_moved, h_stays = _pick([f"pool-h{i}" for i in range(24)], lambda c: _http_replica_of(proxy, c), victim)
    h_home = {h_moved: victim, h_stays: _http_replica_of(proxy, h_stays)}

    client = ChainKVClient(proxy.grpc_target, token=TOKEN)
    chats = {k: Chat(proxy.http_url, model, k) for k in (h_moved, h_stays)}
    grpc_turns: dict[str, list] = {g_moved: [], g_stays: []}
    http_turns: dict[str, list] = {h_moved: [], h_stays: []}
    for i in range(2):
        for sid in grpc_turns:
            grpc_turns[sid].append(_grpc_turn(client, sid, i))
        for key, chat in chats.items():
            reply, usage, served_by = chat.turn(QUESTIONS[i])
            http_turns[key].append((reply, usage))
            assert served_by == h_home[key]  # the body's prompt_cache_key routes like the header
    for sid, turns in grpc_turns.items():
        second = turns[1].usage
        assert second.source_tier == "gpu" and second.reused_tokens > 0, (sid, second)  # its replica's memory
    for key, turns in http_turns.items():
        assert turns[1][1]["prompt_tokens_details"]["cached_tokens"] > 0, key

    # the victim dies; HAProxy's gRPC health check takes it out of both backends
    dead.kill()
    wait_for(lambda: proxy.servers_are(victim, "DOWN"), 120, f"{victim} DOWN in HAProxy")
    assert all(proxy.servers_are(r.name, r"UP( \d+/\d+)?") for r in replicas if r.name != victim)  # still up

    for sid in grpc_turns:
        grpc_turns[sid].append(_grpc_turn(client, sid, 2))
    for key, chat in chats.items():
        reply, usage, served_by = chat.turn(QUESTIONS[2])
        http_turns[key].append((reply, usage))
        assert served_by != victim and (served_by == h_home[key] or key == h_moved)

    # uninterrupted runs of the same scripts, straight to a surviving replica
    direct = ChainKVClient(f"127.0.0.1:{survivor.port}", token=TOKEN)
    ref_grpc = [_grpc_turn(direct, "pool-ref-g", i) for i in range(3)]
    ref_chat = Chat(f"http://127.0.0.1:{survivor.http_port}", model, "pool-ref-h")
    ref_http = [ref_chat.turn(q)[:2] for q in QUESTIONS]

    moved = grpc_turns[g_moved][2]
    assert moved.usage.source_tier == "store"  # resumed from Redis on another replica
    assert moved.turn_index == 2  # both acknowledged turns are there
    assert moved.usage.reused_tokens == ref_grpc[2].usage.reused_tokens  # the whole history, reused
    assert grpc_turns[g_stays][2].usage.source_tier == "gpu"  # a session of a live replica did not move
    for sid, turns in grpc_turns.items():
        assert [t.token_ids for t in turns] == [t.token_ids for t in ref_grpc], sid
    for key, turns in http_turns.items():
        assert [reply for reply, _ in turns] == [reply for reply, _ in ref_http], key
        cached = turns[2][1]["prompt_tokens_details"]["cached_tokens"]
        assert cached == ref_http[2][1]["prompt_tokens_details"]["cached_tokens"], key

    # the keyless conversation continues on another replica, from its transcript in the store
    _, keyless_u2, served_by = keyless.turn(QUESTIONS[1])
    assert served_by != victim
    first_context = keyless_u1["prompt_tokens"] + keyless_u1["completion_tokens"]
    assert keyless_u2["prompt_tokens_details"]["cached_tokens"] >= first_context - 1
    client.close()
    direct.close()
