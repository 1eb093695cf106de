"""Incremental detokenization: text deltas as tokens arrive, and stop-string matching.

Decoding token by token breaks multi-byte characters and BPE merges, so each delta is the
difference between decoding a short window of recent tokens with and without the newest ones;
a window that ends inside a character (U+FFFD) waits for the next token. Text that could be
the beginning of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0  # tokens already turned into text
        self.stopped_on: str | None = None
        self._emitted = 0  # characters of text already returned

    def push(self, token_id: int) -> str:
        """Add one token; returns the new text (possibly empty). Cuts at a stop string."""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        return self._append(delta)

    def _append(self, delta: str) -> str:
        old = len(self.text)
        self.text += delta
        for s in self.stop:
            # a stop string may straddle earlier deltas: search from where it could start
            at = self.text.find(s, max(0, old - len(s) + 1))
            if at != -1:
                self.stopped_on = s
                self.text = self.text[:at]
                return self.flush()
        # hold back what could still turn out to be the start of a stop string
        hold = max((len(s) - 1 for s in self.stop), default=0)
        safe = max(self._emitted, len(self.text) - hold)
        out, self._emitted = self.text[self._emitted : safe], safe
        return out

    def flush(self) -> str:
        """Text not yet returned (held back for stop matching); call when generation ends."""
        out, self._emitted = self.text[self._emitted :], len(self.text)
        return out
