"""Session snapshots under tensor parallelism: one snapshot per session, whatever the TP size.

Each rank's chain cache snapshots its own kv-heads. Rank 0 gathers them and :func:`merge` makes
the snapshot of the whole model: KV in the usual single-device layout (tokens layer by layer,
kv-head by kv-head, over all kv-heads), so any engine reads it, plus ``meta["tensor_parallel"]``,
the layout it was made with (``size``, ``kv_heads_per_rank``). Other per-rank tensors (a method's
state, keep_ratio's query window) cannot be merged without knowing their layout: they are kept
per rank, as ``tp<r>/<name>``.

:func:`for_rank` re-shards a snapshot for a rank of any TP size: the KV is cut by kv-heads. A
snapshot with per-rank state resumes only at the TP size it was made with; otherwise it is
refused with a :class:`~engine.cache.snapshot.SnapshotError` that names both sizes.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.cache.manager import KVSnapshot
from engine.cache.snapshot import SessionSnapshot, SnapshotError

_PREFIX = "tp{}/"


def _split_layers(kv: KVSnapshot) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(k, v, pos) of each layer (all of that layer's heads, in head order)."""
    per_layer = kv.lengths.long().sum(1).tolist()
    return list(zip(kv.k.split(per_layer), kv.v.split(per_layer), kv.pos.split(per_layer)))


def merge_kv(parts: list[KVSnapshot]) -> KVSnapshot:
    """Rank KV snapshots (kv-heads of rank r after those of rank r-1) -> one over all kv-heads."""
    layers = [_split_layers(p) for p in parts]
    L = parts[0].lengths.shape[0]
    order = [layers[r][layer] for layer in range(L) for r in range(len(parts))]
    return KVSnapshot(
        lengths=torch.cat([p.lengths for p in parts], dim=1),
        k=torch.cat([o[0] for o in order]),
        v=torch.cat([o[1] for o in order]),
        pos=torch.cat([o[2] for o in order]),
    )


def shard_kv(kv: KVSnapshot, heads: range) -> KVSnapshot:
    """The kv-heads ``heads`` of a whole-model KV snapshot."""
    lengths = kv.lengths.long()
    flat = lengths.reshape(-1).tolist()
    k, v, pos = kv.k.split(flat), kv.v.split(flat), kv.pos.split(flat)
    H = lengths.shape[1]
    pick = [layer * H + h for layer in range(lengths.shape[0]) for h in heads]
    return KVSnapshot(
        lengths=kv.lengths[:, heads.start : heads.stop].clone(),
        k=torch.cat([k[i] for i in pick]),
        v=torch.cat([v[i] for i in pick]),
        pos=torch.cat([pos[i] for i in pick]),
    )


def merge(parts: list[SessionSnapshot]) -> SessionSnapshot:
    """Every rank's snapshot of one session (rank order) -> the whole session's snapshot."""
    first = parts[0]
    meta = dict(first.meta)
    kv_heads = None if first.kv is None else int(first.kv.lengths.shape[1])
    meta["tensor_parallel"] = {"size": len(parts), "kv_heads_per_rank": kv_heads}
    if any((p.kv is None) != (first.kv is None) for p in parts):
        raise SnapshotError("ranks disagree on whether the session's KV is kept")
    kv = None if first.kv is None else merge_kv([p.kv for p in parts])
    tensors = (
        dict(first.tensors)
        if len(parts) == 1
        else {_PREFIX.format(r) + name: t for r, p in enumerate(parts) for name, t in p.tensors.items()}
    )
    return SessionSnapshot(meta=meta, kv=kv, tensors=tensors)


def for_rank(snap: SessionSnapshot, size: int, rank: int) -> SessionSnapshot:
    """The part of a (whole-model) snapshot that rank ``rank`` of ``size`` loads."""
    made = (snap.meta.get("tensor_parallel") or {}).get("size", 1)
    ranked = {n: t for n, t in snap.tensors.items() if n.startswith("tp") and "/" in n}
    plain = {n: t for n, t in snap.tensors.items() if n not in ranked}
    if made != size and (ranked or (size > 1 and plain)):
        names = sorted({n.split("/", 1)[-1] for n in (ranked or plain)})
        raise SnapshotError(
            f"session {snap.meta.get('session_id')!r} was saved at tensor_parallel_size {made} with per-head state "
            f"{names} that cannot be re-sharded; resume it on an engine with tensor_parallel_size {made}"
        )
    if size == 1 and made == 1:
        return snap
    mine = _PREFIX.format(rank)
    tensors = {n[len(mine) :]: t for n, t in ranked.items() if n.startswith(mine)} if made > 1 else plain
    kv = snap.kv
    if kv is not None:
        H = int(kv.lengths.shape[1])
        if H % size:
            raise SnapshotError(f"the snapshot has {H} kv-heads, which do not split over {size} ranks")
        per = H // size
        kv = shard_kv(kv, range(rank * per, (rank + 1) * per))
    return dataclasses.replace(snap, kv=kv, tensors=tensors)
