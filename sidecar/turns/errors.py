"""How a turn ends without its reply when its request was fine: stopped by something other than
its caller (``TurnAborted``, ABORTED) or failed on the engine (``SequenceFailed``, INTERNAL).

Raised by ``TurnRunner`` (runner.py); a module of their own so that the status table
(sidecar/grpc/errors.py) and the gRPC front door name them without importing the runner.
"""

from __future__ import annotations


class SequenceFailed(RuntimeError):
    """The engine failed this turn alone (its sampling or token processing raised); INTERNAL."""


class TurnAborted(RuntimeError):
    """The turn was stopped by something other than its caller (EndSession, a cancelled first attempt)."""
