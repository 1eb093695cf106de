"""The OpenAI-compatible HTTP front: ``/v1/models``, ``/v1/chat/completions`` and ``/v1/responses`` on
the same sessions, engine and tenants as the gRPC sidecar (``chainkv serve --http-port N``).

app.py (the FastAPI app and its uvicorn server), backend.py (the one way onto the sessions),
chat_completions.py (with chain_protocol.py: SparseEngine's chain_id / chain_append_start),
responses_api.py (with response_events.py: a response's output items, events and stored record),
conversations.py (finding a stateless chat's session), cache_control.py (``/v1/prefix_cache/...``,
with cache_requests.py: its request bodies, and prune_jobs.py: asynchronous prunings), requests.py
(request fields shared by both APIs), errors.py (OpenAI error JSON and statuses).
"""
