"""The request bodies of the cache-control endpoints (``/v1/prefix_cache/...``), checked as hostile
input: a session id, an eviction priority, and a pruning order (ranges of history positions, the
tokens to keep of each, the policy). Anything malformed is a 400 naming the field, raised before
the session is looked up, so a bad request leaves the session as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sidecar.http.errors import invalid
from sidecar.session_ids import BadSessionId, check_id

MAX_RANGES = 64
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
POLICY_ALIASES = {"drop": ("drop", None), "keep_ratio": ("keep_ratio", None), "snapkv_global": ("keep_ratio", "global")}
"""Pruning policies a request may name -> the engine's policy and scope (``snapkv_global``, a
SparseEngine name, is chainkv's attention-ranked ``keep_ratio`` across kv-heads)."""
SCOPES = ("global", "per_head")
_MAX_POSITION = 2**40


@dataclass(frozen=True)
class PruneOrder:
    session_id: str
    ranges: tuple[tuple[int, int], ...]
    """History positions [start, end), sorted, not overlapping."""
    keep_tokens: int
    """Tokens of each range whose KV is kept (0: the range's KV is dropped)."""
    policy: str
    scope: str | None

    def keep_ratio(self, start: int, end: int) -> float | None:
        return None if self.policy == "drop" else self.keep_tokens / (end - start)


def session_id_of(body: dict[str, Any]) -> str:
    """``session_id`` (or ``chain_id``, its name in the chain protocol)."""
    sid, cid = body.get("session_id"), body.get("chain_id")
    if sid is not None and cid is not None and sid != cid:
        raise invalid("session_id and chain_id name different sessions; send one", "session_id")
    value = sid if sid is not None else cid
    if not isinstance(value, str):
        raise invalid("session_id must be a string", "session_id")
    try:
        return check_id(value)
    except BadSessionId as e:
        raise invalid(str(e)[:300], "session_id") from None


def integer(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer", name)
    if not lo <= value <= hi:
        raise invalid(f"{name} must be between {lo} and {hi}", name)
    return value


def priority_of(body: dict[str, Any]) -> int:
    """The eviction priority: an integer in [-1000, 1000]; idle sessions of a lower one leave the GPU first."""
    if "priority" not in body:
        raise invalid("priority is required", "priority")
    return integer(body["priority"], "priority", MIN_PRIORITY, MAX_PRIORITY)


def prune_order(body: dict[str, Any]) -> PruneOrder:
    """``ranges`` (``[[start, end], ...]`` or ``[{"start", "end"}, ...]``; or SparseEngine's one
    ``range_start`` / ``range_end``), ``keep_tokens`` (default 0) and ``policy`` (``drop``,
    ``keep_ratio`` or ``snapkv_global``; default ``keep_ratio`` when tokens are kept, else ``drop``),
    ``scope`` (``global`` or ``per_head``)."""
    sid = session_id_of(body)
    ranges = _ranges(body)
    keep = integer(body.get("keep_tokens", 0), "keep_tokens", 0, _MAX_POSITION)
    narrowest = min(b - a for a, b in ranges)
    if keep >= narrowest:
        raise invalid(
            f"keep_tokens must be less than every range's width (the narrowest is {narrowest})", "keep_tokens"
        )
    name = body.get("policy")
    if name is None:
        name = "keep_ratio" if keep else "drop"
    if not isinstance(name, str) or name not in POLICY_ALIASES:
        raise invalid(f"policy must be one of {', '.join(POLICY_ALIASES)}", "policy")
    policy, scope = POLICY_ALIASES[name]
    if policy == "drop" and keep:
        raise invalid("policy drop keeps no tokens; use keep_ratio with keep_tokens", "policy")
    if policy == "keep_ratio" and not keep:
        raise invalid("policy keep_ratio needs keep_tokens > 0", "keep_tokens")
    if body.get("scope") is not None:
        if body["scope"] not in SCOPES:
            raise invalid("scope must be global or per_head", "scope")
        if scope is not None and body["scope"] != scope:
            raise invalid(f"policy {name} implies scope {scope!r}, not {body['scope']!r}", "scope")
        scope = body["scope"]
    return PruneOrder(sid, ranges, keep, policy, scope)


def _ranges(body: dict[str, Any]) -> tuple[tuple[int, int], ...]:
    raw = body.get("ranges")
    if raw is None and ("range_start" in body or "range_end" in body):
        raw = [[body.get("range_start"), body.get("range_end")]]
    if not isinstance(raw, list) or not raw:
        raise invalid("ranges must be a non-empty list of [start, end] pairs", "ranges")
    if len(raw) > MAX_RANGES:
        raise invalid(f"at most {MAX_RANGES} ranges", "ranges")
    out = []
    for i, r in enumerate(raw):
        if isinstance(r, dict):
            r = [r.get("start"), r.get("end")]
        if not isinstance(r, list) or len(r) != 2:
            raise invalid(f"ranges[{i}] must be [start, end]", "ranges")
        a = integer(r[0], f"ranges[{i}].start", 0, _MAX_POSITION)
        b = integer(r[1], f"ranges[{i}].end", 0, _MAX_POSITION)
        if not a < b:
            raise invalid(f"ranges[{i}] needs start < end, not [{a}, {b}]", "ranges")
        out.append((a, b))
    out.sort()
    for (_, b), (a2, _) in zip(out, out[1:]):
        if a2 < b:
            raise invalid("ranges overlap", "ranges")
    return tuple(out)


def check_within(order: PruneOrder, history_tokens: int) -> None:
    """400 when a range reaches past the session's history."""
    end = order.ranges[-1][1]
    if end > history_tokens:
        raise invalid(f"a range ends at {end}, past the session's {history_tokens}-token history", "ranges")
