"""One process per tensor-parallel rank; a rank that dies takes the others down.

:func:`launch` spawns ``tensor_parallel_size`` processes (torch.multiprocessing, spawn), each in
the torch.distributed group (gloo on the CPU, NCCL on GPUs, rank r on GPU r). Every rank builds
its shard of the engine; rank 0 runs ``target(engine, *args)`` with the replicated front door
(:class:`~engine.tensor_parallel.driver.TensorParallelEngine`), the others follow it. The parent
watches its children: when rank 0 returns, the followers are released and joined; when any rank
exits with an error (or is killed), the remaining ranks are terminated and :func:`launch`
returns that rank's non-zero exit code, so a supervisor (Kubernetes) restarts the whole server
and sessions resume from the store. SIGTERM/SIGINT to the parent are passed to rank 0, which
drains and shuts the group down. A rank dies with the launcher (Linux: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(
    rank: int, size: int, port: int, config_dict: dict, target: Callable, args: tuple, random_weights: bool
) -> None:
    """The body of one rank's process."""
    from engine.config import EngineConfig
    from engine.distributed import group
    from engine.tensor_parallel.driver import TensorParallelEngine, follow
    from engine.llm import LLMEngine

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=str(port),
    )
    _die_with_parent()
    if rank > 0:  # a terminal's Ctrl-C reaches every process: rank 0 drains, then releases the followers
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = EngineConfig.from_dict(config_dict)
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        # the CPU's cores are shared by the ranks: more threads than cores spin against each other
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    group.init_tensor_parallel(size, config.device)
    try:
        engine = LLMEngine(config, random_weights=random_weights)
        if rank == 0:
            driver = TensorParallelEngine(engine)
            try:
                target(driver, *args)
            finally:
                driver.shutdown()
        else:
            follow(engine)
    finally:
        group.shutdown()
    _exit_after_clean_shutdown()


def _exit_after_clean_shutdown() -> None:
    """End a rank whose work is done without the interpreter's teardown. Every collective has finished
    and the group is destroyed, but the native (c10d/gloo) objects' destructors at interpreter exit
    still abort the process now and then ("terminate called without an active exception", exit -6:
    seen on a follower after a clean SIGTERM drain, about one exit in five on a loaded CPU), which the
    launcher would report as a failed server. Python-level state is flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def _die_with_parent() -> None:
    """Linux: this rank gets SIGKILL when the launcher dies (even by SIGKILL), so no rank outlives
    the server (a rank 0 still holding the port, followers blocked in a collective)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own exit path still stops the ranks


def launch(config, target: Callable[..., Any], *args: Any, random_weights: bool = False, poll_s: float = 0.1) -> int:
    """Run ``target(engine, *args)`` on rank 0 of a ``config.tensor_parallel_size``-rank engine;
    returns 0, or the exit code of the first rank that failed (the others are then stopped)."""
    size = config.tensor_parallel_size
    port = int(os.environ.get("MASTER_PORT") or free_port())
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=run_rank,
            args=(r, size, port, config.to_dict(), target, args, random_weights),
            name=f"chainkv-tp{r}",
            daemon=False,
        )
        for r in range(size)
    ]
    for p in procs:
        p.start()

    def forward_signal(signum, _frame):
        if procs[0].is_alive():
            os.kill(procs[0].pid, signum)

    previous = {s: signal.signal(s, forward_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            codes = [p.exitcode for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                log.error("tensor-parallel rank %d exited with %s: stopping the other ranks", rank, code)
                _stop(procs)
                return code if code > 0 else 128 - code  # killed by signal n: 128 + n
            if codes[0] == 0:
                for p in procs[1:]:
                    p.join(timeout=60)
                _stop(procs)
                late = [p.exitcode for p in procs[1:] if p.exitcode != 0]
                return 0 if not late else (late[0] if late[0] > 0 else 128 - late[0])
            time.sleep(poll_s)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _stop(procs, grace_s: float = 10.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
