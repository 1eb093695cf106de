"""The tensor-parallel front door: one process per rank, rank 0 taking requests for all of them.

It sits beside ``engine/llm.py`` (it builds and wraps an LLMEngine on every rank); nothing else in
``engine/`` imports it. The leaf modules the ranks' engines use (collectives, sharding, sharded
layers, capacity agreement, snapshot merging) are in ``engine/distributed/``.

    driver.py     rank 0's front door (``TensorParallelEngine``) and the followers' loop
    launcher.py   one process per rank; a rank that dies takes the server down
"""
