"""Structured output's guard against a JSON string that repeats itself: once it loops, it is closed.

A small model writing a schema's free string often falls into a loop ("A cat is a cat, a cat is a cat,
...") that the grammar cannot end: every token of the loop is a valid string character, so the reply
runs to ``max_tokens`` and does not parse. ``StringLoopGuard`` follows one constrained sequence's JSON
strings token by token (its own scan of each token's bytes: quotes, backslash escapes) and marks the
string *looping* once its last ``window`` tokens have already appeared, in that order, earlier in the
same string. While it loops, the grammar backend allows only the tokens that begin with the closing
quote (``"``, ``",``, ``"}``, ...) among those the grammar allows (``closing_words``): the string ends
there and the structure goes on. A string the grammar does not let end yet (``minLength``, a pattern)
is left as it is.

The window is in tokens (``GrammarBackend.string_loop_window``; 0 turns the guard off): a phrase of that
many tokens repeated within one string value.
"""

from __future__ import annotations

import torch

QUOTE, BACKSLASH = 0x22, 0x5C


def closing_words(token_bytes: list[bytes], vocab_size: int) -> torch.Tensor:
    """The vocabulary's tokens that begin with ``"`` as a token bitmask row of ``vocab_size`` bits (int32
    words, bit ``t % 32`` of word ``t // 32``: xgrammar's layout)."""
    words = [0] * ((vocab_size + 31) // 32)
    for t, b in enumerate(token_bytes[:vocab_size]):
        if b[:1] == b'"':
            words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


class StringLoopGuard:
    """One sequence's JSON strings: whether the one being written repeats itself (``looping``)."""

    def __init__(self, token_bytes: list[bytes], window: int):
        self.token_bytes = token_bytes
        self.window = window
        self.in_string = False
        self.escaped = False
        """The string's last byte was a backslash: its next byte is escaped (a ``"`` would not close it)."""
        self.tokens: list[int] = []
        """The tokens of the string being written (the one that opened it first)."""
        self.seen: set[tuple[int, ...]] = set()
        """Every run of ``window`` consecutive tokens in that string so far."""
        self.looping = False

    @property
    def must_close(self) -> bool:
        """The string repeats itself and may be closed by the next token."""
        return self.looping and self.in_string and not self.escaped

    def feed(self, token: int) -> None:
        """Follow the string state through ``token`` (one the grammar accepted)."""
        data = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else b""
        opened = False
        for byte in data:
            if not self.in_string:
                if byte == QUOTE:
                    self.in_string, opened = True, True
            elif self.escaped:
                self.escaped = False
            elif byte == BACKSLASH:
                self.escaped = True
            elif byte == QUOTE:
                self.in_string = False
        if opened or not self.in_string:
            self.tokens, self.seen, self.looping = [], set(), False
        if not self.in_string:
            return
        self.tokens.append(token)
        if len(self.tokens) >= self.window:
            run = tuple(self.tokens[-self.window :])
            self.looping = self.looping or run in self.seen
            self.seen.add(run)
