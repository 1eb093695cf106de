"""The turns: what a client asks of a turn, checked, rendered, run on the engine and answered.

runner.py (``TurnRunner``: one turn from request to completion, and what happens when it does not
finish), errors.py (how a turn ends without its reply: aborted, or failed on the engine), request.py
(``TurnRequest``: the typed turn both fronts build), protocol.py (a turn request checked and turned
into engine arguments; engine state into gRPC messages), validation.py (what one request may cost,
checked before any work), limits.py (per-tenant limits), chat.py (a turn's new messages rendered
into tokens), tool_calls.py (tool calls parsed out of streamed text), structured.py (response
formats and tool choice as grammar constraints), prune.py (pruning a session's history between
turns), hooks.py (``ServerHooks``: the callbacks at each RPC, turn, snapshot and prune that metrics
override).
"""
