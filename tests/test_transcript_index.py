"""The store's transcript index (sidecar/store/transcript_index.py) on a real redis-server and a directory:
an entry is found only for its tenant and only while its session's stored front still records the
digest; a stale entry is ignored and deleted; entry names hold nothing of the request."""

from __future__ import annotations

import os
import time

import msgpack
import pytest

from sidecar.store import DirectoryStore, RedisStore, StoredSession
from sidecar.store.transcript_index import FOLDER, FORMAT, MAX_VERIFY, StoredTranscripts, sweep

FRONT = "chat_transcript"
TURN = "chat_transcript_turn"


@pytest.fixture(params=["redis", "directory"])
def store(request, tmp_path, redis_proc):
    if request.param == "redis":
        s = RedisStore(redis_proc.url, prefix=f"t{time.monotonic_ns()}", ttl_s=60)
    else:
        s = DirectoryStore(tmp_path / "store", ttl_s=60)
    yield s
    s.close()


def _commit(
    store, key: str, digest: bytes | None, expected: int | None = None, turn: int = 1, at: int | None = None
) -> StoredSession:
    """Commit a session at ``turn`` whose front records ``digest`` at turn ``at`` (default: ``turn``)."""
    record = {"session_id": key.rsplit("/", 1)[-1], "turn_index": turn, "generation": turn, "tokens": b"\1\0\0\0"}
    front = {FRONT: digest.hex(), TURN: turn if at is None else at} if digest else {}
    stored = StoredSession(record=record, app={"front": front})
    store.save(key, stored, expected)
    return stored


def _digest(i: int) -> bytes:
    return bytes([i]) * 32


def test_an_entry_is_found_for_its_tenant_only_and_longest_first(store):
    idx = StoredTranscripts(store, FRONT, TURN)
    for turn, d in ((1, _digest(1)), (2, _digest(2))):
        key = f"alpha/chat-{turn}"
        idx.put_committed(key, _commit(store, key, d))
    found = idx.find("alpha", [_digest(9), _digest(2), _digest(1)])
    assert found is not None and found.position == 1 and found.key == "alpha/chat-2" and found.turn_index == 1
    assert idx.find("beta", [_digest(2), _digest(1)]) is None
    assert idx.find("alpha", [_digest(7)]) is None and idx.find("alpha", []) is None


def test_a_session_that_moved_on_or_was_deleted_is_not_matched_and_its_entry_goes(store):
    idx = StoredTranscripts(store, FRONT, TURN)
    key = "alpha/chat-a"
    idx.put_committed(key, _commit(store, key, _digest(1)))
    idx.put_committed(key, _commit(store, key, _digest(2), expected=1, turn=2))
    assert idx.find("alpha", [_digest(1)]) is None  # the stored front is digest 2 now
    assert idx.entries.get_many("alpha", [_digest(1)]) == [None]  # the stale entry was deleted
    assert idx.find("alpha", [_digest(2)]).turn_index == 2
    store.delete(key)
    assert idx.find("alpha", [_digest(2)]) is None
    assert idx.entries.get_many("alpha", [_digest(2)]) == [None]


def test_an_entry_naming_another_tenants_session_is_refused(store):
    """A forged entry (written by someone with store access) cannot attach a request to another tenant."""
    idx = StoredTranscripts(store, FRONT, TURN)
    _commit(store, "beta/chat-b", _digest(3))
    idx.entries.put("alpha", _digest(3), "beta/chat-b")
    idx.entries.put("alpha", _digest(4), "chat-no-tenant")
    assert idx.find("alpha", [_digest(3), _digest(4)]) is None
    assert idx.entries.get_many("alpha", [_digest(3), _digest(4)]) == [None, None]


def test_a_session_without_a_transcript_is_not_indexed(store):
    idx = StoredTranscripts(store, FRONT, TURN)
    idx.put_committed("alpha/grpc-1", _commit(store, "alpha/grpc-1", None))
    assert idx.find("alpha", [bytes(32)]) is None


def test_lookups_check_a_bounded_number_of_entries(store):
    idx = StoredTranscripts(store, FRONT, TURN)
    digests = [_digest(20 + i) for i in range(MAX_VERIFY + 2)]
    for d in digests:  # every entry names a session that does not exist
        idx.entries.put("alpha", d, "alpha/chat-gone")
    assert idx.find("alpha", digests) is None
    left = idx.entries.get_many("alpha", digests)
    assert left[:MAX_VERIFY] == [None] * MAX_VERIFY and left[MAX_VERIFY:] == ["alpha/chat-gone"] * 2


def test_directory_entries_are_fixed_names_and_expired_ones_are_swept(tmp_path):
    store = DirectoryStore(tmp_path / "store", ttl_s=60)
    idx = StoredTranscripts(store, FRONT, TURN)
    idx.put_committed("alpha/chat-x", _commit(store, "alpha/chat-x", _digest(5)))
    idx.entries.put("../../etc", _digest(6), "../../etc/chat-y")
    names = sorted(os.listdir(store.root / FOLDER))
    assert len(names) == 2 and all(len(n) == 54 and n.startswith("t-") for n in names)
    assert sweep(store) == 0
    old = msgpack.packb([FORMAT, "alpha/chat-z", _digest(7).hex(), time.time() - 1])
    store.atomic_write(idx.entries.path("alpha", _digest(7)), old)
    assert idx.entries.get_many("alpha", [_digest(7)]) == [None]  # expired: ignored (and deleted)
    store.atomic_write(idx.entries.path("alpha", _digest(7)), old)
    assert sweep(store) == 1
    assert len(os.listdir(store.root / FOLDER)) == 2
    assert store.sweep() == 0  # the session sweep leaves the index folder alone
    assert idx.find("alpha", [_digest(5)]).key == "alpha/chat-x"


def test_redis_entries_expire_with_the_store_ttl(redis_proc):
    store = RedisStore(redis_proc.url, prefix="ttl", ttl_s=120)
    idx = StoredTranscripts(store, FRONT, TURN)
    idx.put_committed("alpha/chat-t", _commit(store, "alpha/chat-t", _digest(8)))
    name = idx.entries.name("alpha", _digest(8))
    assert name.startswith("ttl:tx:{") and "alpha" not in name
    assert 0 < redis_proc.client().ttl(name) <= 120


def test_a_digest_recorded_at_another_turn_is_not_the_sessions_transcript(store):
    """A turn that ran without recording its transcript (its digest is of an earlier turn) matches nothing."""
    idx = StoredTranscripts(store, FRONT, TURN)
    idx.put_committed("alpha/chat-l", _commit(store, "alpha/chat-l", _digest(11), turn=3, at=2))
    assert idx.entries.get_many("alpha", [_digest(11)]) == [None]  # not indexed
    idx.entries.put("alpha", _digest(11), "alpha/chat-l")
    assert idx.find("alpha", [_digest(11)]) is None


def _entry_count(store) -> int:
    if isinstance(store, RedisStore):
        return sum(1 for _ in store.client.scan_iter(f"{store.prefix}:tx:*"))
    return len(os.listdir(store.root / FOLDER))


def test_a_session_keeps_one_entry_its_latest(store):
    """The same bound as a replica's own index: one entry per session, however many turns it ran."""
    idx = StoredTranscripts(store, FRONT, TURN)
    key, other = "alpha/chat-long", "alpha/chat-other"
    idx.put_committed(other, _commit(store, other, _digest(40)))
    for turn in range(1, 6):
        idx.put_committed(key, _commit(store, key, _digest(40 + turn), expected=turn - 1 or None, turn=turn))
    assert _entry_count(store) == 2
    assert idx.entries.get_many("alpha", [_digest(41), _digest(44)]) == [None, None]
    assert idx.entries.get_many("alpha", [_digest(45), _digest(40)]) == [key, other]
    assert idx.find("alpha", [_digest(45)]).turn_index == 5
    # an entry the session's pointer names but that another session rewrote since is not deleted
    idx.entries.put("alpha", _digest(45), other)
    idx.put_committed(key, _commit(store, key, _digest(46), expected=5, turn=6))
    assert idx.entries.get_many("alpha", [_digest(45), _digest(46)]) == [other, key]


def test_expired_directory_pointers_are_swept(tmp_path):
    store = DirectoryStore(tmp_path / "store", ttl_s=60)
    idx = StoredTranscripts(store, FRONT, TURN)
    idx.put_committed("alpha/chat-p", _commit(store, "alpha/chat-p", _digest(50)))
    pointer = idx.entries.pointer("alpha/chat-p")
    assert pointer.is_file() and sweep(store) == 0 and pointer.is_file()
    name = msgpack.unpackb(pointer.read_bytes(), raw=False)[1]
    store.atomic_write(pointer, msgpack.packb([FORMAT, name, time.time() - 1]))
    sweep(store)
    assert not pointer.exists() and idx.find("alpha", [_digest(50)]).key == "alpha/chat-p"
