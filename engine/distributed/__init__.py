"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on the CPU).

One process per rank. Every rank holds a Megatron-style shard of the model (its query heads, its
kv-heads, its slice of the MLP and of the vocabulary) and a CacheManager with the page tables of
its own kv-heads only. Rank 0 alone takes requests; it broadcasts every engine call to the other
ranks, which run the same scheduler in lockstep (capacity.py here; the front door that broadcasts
the calls and the launcher of the ranks are in ``engine/tensor_parallel/``, which imports the engine;
the modules here do not import it back).

    group.py      process group setup and the few collectives the engine uses
    sharding.py   which heads / rows / vocabulary a rank owns; sharded weights
    layers.py     column/row/vocab-parallel modules and the sharded Llama
    capacity.py   page accounting every rank agrees on, and the per-step plan check
    snapshots.py  merging rank snapshots into one (the TP layout recorded), re-sharding on load
"""
