"""The gRPC server: ``chainkv.v1.Sidecar`` on grpc.aio, and the ``SidecarServer`` that puts the
sidecar's parts together (the HTTP front runs on it too).

server.py (the front door: what an embedder imports), sidecar_server.py (``SidecarServer``: the
parts built, started and stopped in order), server_thread.py (a SidecarServer on a background
thread), service.py (``SidecarService``: the servicer, requests in, status codes out),
endpoint.py (listening, TLS, health), reflection.py (server reflection, v1 and v1alpha),
errors.py (exceptions -> status codes, the one table), auth.py (bearer token -> tenant),
options.py (``ServerOptions``: every server setting, declared once), metrics.py (Prometheus and
the access log), logs.py (JSON logs with the request's tenant and session), ports.py (each
listening port checked before the model loads).

Named after the protocol it serves, as ``sidecar/http/`` is; ``import grpc`` inside it is still
the grpcio library (imports are absolute).
"""
