"""The ``chainkv`` command line: ``chainkv serve | generate | calibrate | demo``.

main.py (``main``, the console script: dispatches and runs generate, calibrate and demo),
args.py (the parser and every subcommand's flags), engine_args.py (``EngineConfig`` <-> flags),
serve.py (``chainkv serve``: settings read and checked, then the engine served),
serve_config.py (the server's settings from flags, environment and YAML), demo.py (a tool-using
agent session against a running sidecar). ``python -m sidecar.cli`` runs the command too
(__main__.py).
"""
