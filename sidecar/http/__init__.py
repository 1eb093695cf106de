"""The OpenAI-compatible HTTP front: ``/v1/models``, ``/v1/chat/completions`` and ``/v1/responses`` on
the same sessions, engine and tenants as the gRPC sidecar (``chainkv serve --http-port N``).

app.py (the FastAPI app and its uvicorn server), backend.py (the one way onto the sessions),
chat_completions.py, responses_api.py (with response_events.py: a response's output items, events
and stored record), conversations.py (finding a stateless chat's session), requests.py (request
fields shared by both APIs), errors.py (OpenAI error JSON and statuses).
"""
