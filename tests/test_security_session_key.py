"""SessionKey: the one join and parse of a session's stored key, and what it refuses.

A stored key names exactly one tenant's session; a hostile id (or a forged stored key) must never
parse into a key that reaches another tenant's data or a path outside the store.
"""

from __future__ import annotations

import pytest

from sidecar.session_ids import BadSessionId, SessionKey, scoped_key
from sidecar.store.transcript_index import StoredTranscripts

HOSTILE_IDS = [
    ("empty", ""),
    ("slash", "/"),
    ("slash inside", "a/b"),
    ("dot", "."),
    ("dot dot", ".."),
    ("dot dot path", "../b"),
    ("too long", "a" * 129),
    ("nul", "a\x00b"),
    ("nul alone", "\x00"),
    ("newline", "a\nb"),
    ("space", "a b"),
    ("unicode letter", "caf\u00e9"),
    ("unicode slash", "a\u2215b"),
    ("fullwidth dot dot", "\uff0e\uff0e"),
    ("right-to-left mark", "a\u200fb"),
    ("surrogate", "a\udc80"),
    ("hash tag brace", "{t}"),
    ("backslash", "a\\b"),
]


@pytest.mark.parametrize("what,sid", HOSTILE_IDS, ids=[w for w, _ in HOSTILE_IDS])
def test_a_hostile_id_makes_no_key(what, sid):
    with pytest.raises(BadSessionId):
        SessionKey.of("alpha", sid)
    with pytest.raises(BadSessionId):
        scoped_key("alpha", sid)
    with pytest.raises(BadSessionId):
        SessionKey.of("", sid)


HOSTILE_STORED = [
    ("empty", ""),
    ("slash", "/"),
    ("empty tenant", "/s"),
    ("empty id", "alpha/"),
    ("two slashes", "alpha/beta/s"),
    ("dot dot id", "alpha/.."),
    ("dot dot tenant", "../s"),
    ("dot dot both", "../.."),
    ("too long id", "alpha/" + "a" * 129),
    ("too long tenant", "a" * 129 + "/s"),
    ("nul in id", "alpha/s\x00"),
    ("nul in tenant", "al\x00pha/s"),
    ("unicode id", "alpha/s\u00e9"),
    ("unicode tenant", "\u00e9/s"),
    ("unicode slash", "alpha\u2215s"),
    ("hash tag", "alpha/{s}"),
]


@pytest.mark.parametrize("what,stored", HOSTILE_STORED, ids=[w for w, _ in HOSTILE_STORED])
def test_a_hostile_stored_key_does_not_parse(what, stored):
    with pytest.raises(BadSessionId):
        SessionKey.parse(stored)
    for tenant in ("", "alpha", "beta", "s"):  # the transcript index never takes it for anyone's
        assert not StoredTranscripts._ours(tenant, stored)


WELL_FORMED = [
    # (tenant, id, the stored form: byte-identical to what the store and Redis already hold)
    ("", "s", "s"),
    ("alpha", "s", "alpha/s"),
    ("alpha", "chat-0123abcd", "alpha/chat-0123abcd"),
    ("t.e-n_a:n@t", "a.b_c:d@e+f=g~h-i", "t.e-n_a:n@t/a.b_c:d@e+f=g~h-i"),
    ("alpha", "a" * 128, "alpha/" + "a" * 128),
    ("alpha", ".a", "alpha/.a"),
]


@pytest.mark.parametrize("tenant,sid,stored", WELL_FORMED)
def test_join_and_parse_round_trip_in_the_stored_form(tenant, sid, stored):
    key = SessionKey.of(tenant, sid)
    assert str(key) == stored == scoped_key(tenant, sid)
    assert SessionKey.parse(stored) == key
    assert (SessionKey.tenant_of(stored), SessionKey.id_of(stored)) == (tenant, sid)


def test_a_key_is_one_tenants_only():
    key = SessionKey.parse("alpha/s")
    assert key.tenant == "alpha" and key != SessionKey.of("beta", "s") and key != SessionKey.of("", "s")
    assert StoredTranscripts._ours("alpha", "alpha/s")
    assert not StoredTranscripts._ours("beta", "alpha/s")
    assert not StoredTranscripts._ours("", "alpha/s")
    assert not StoredTranscripts._ours("alpha", "s")
    with pytest.raises(AttributeError):  # frozen: a key cannot be moved to another tenant
        key.tenant = "beta"
