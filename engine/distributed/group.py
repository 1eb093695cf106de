"""The tensor-parallel process group of this process and the collectives the engine uses.

``init_tensor_parallel`` joins the group (the usual torch.distributed environment: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``), picks NCCL when the engine runs
on CUDA and gloo otherwise, and binds a GPU rank to its own device. At TP=1 nothing is joined and
every helper below is the identity, so single-device code paths pay nothing.

Collectives are blocking and must be called by every rank in the same order: the engine only calls
them from code that all ranks run in lockstep (the same scheduler decisions on the same requests).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist


class TensorParallelError(RuntimeError):
    """The TP group cannot be set up, or the ranks disagree (a rank died or diverged)."""


_GROUP: dict[str, Any] = {"size": 1, "rank": 0, "backend": None}


def size() -> int:
    return _GROUP["size"]


def rank() -> int:
    return _GROUP["rank"]


def active() -> bool:
    return _GROUP["size"] > 1


def backend() -> str | None:
    return _GROUP["backend"]


def init_tensor_parallel(tp_size: int, device: str = "auto", timeout_s: float = 600.0) -> int:
    """Join the TP group of ``tp_size`` ranks (no-op at 1); returns this process's rank."""
    if tp_size == 1:
        return 0
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = int(os.environ.get("WORLD_SIZE", "0"))
        if world != tp_size:
            raise TensorParallelError(
                f"tensor_parallel_size is {tp_size} but WORLD_SIZE is {world or 'unset'}: "
                "start the ranks with `chainkv serve` (it spawns them) or torchrun"
            )
        use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if use_cuda:
            local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
            if local >= torch.cuda.device_count():
                raise TensorParallelError(f"rank {local} has no GPU ({torch.cuda.device_count()} visible)")
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
        world = dist.get_world_size()
    if world != tp_size:
        raise TensorParallelError(f"tensor_parallel_size is {tp_size} but the process group has {world} ranks")
    _GROUP.update(size=world, rank=dist.get_rank(), backend=dist.get_backend())
    return _GROUP["rank"]


def shutdown() -> None:
    """Leave the group (at exit); TP helpers are the identity afterwards."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUP.update(size=1, rank=0, backend=None)


# --- tensor collectives (identity at TP=1) --------------------------------------------------------
def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (row-parallel layers, the vocab-parallel embedding)."""
    if active():
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last axis (vocab-parallel logits)."""
    if not active():
        return x
    parts = [torch.empty_like(x) for _ in range(size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def all_gather_first(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape on every rank) along the first axis (heads)."""
    if not active():
        return x
    parts = [torch.empty_like(x) for _ in range(size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)


def _reduce_ints(values: list[int], op) -> list[int]:
    if not active() or not values:
        return list(values)
    dev = torch.device("cuda", torch.cuda.current_device()) if backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=op)
    return t.tolist()


def max_ints(values: list[int]) -> list[int]:
    """Element-wise max over ranks (page needs, head lengths)."""
    return _reduce_ints(values, dist.ReduceOp.MAX)


def min_ints(values: list[int]) -> list[int]:
    """Element-wise min over ranks (free pages)."""
    return _reduce_ints(values, dist.ReduceOp.MIN)


def any_rank(flag: bool) -> bool:
    return bool(max_ints([int(flag)])[0]) if active() else flag


# --- objects (commands, snapshots; rank 0 is the source) --------------------------------------------
def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: Any) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on rank 0 (None on the others)."""
    if not active():
        return [obj]
    out = [None] * size() if rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_gather_objects(obj: Any) -> list[Any]:
    if not active():
        return [obj]
    out = [None] * size()
    dist.all_gather_object(out, obj)
    return out
