"""Grammar-constrained decoding: a reply that must match a JSON Schema, any JSON object, a regex or an
EBNF grammar, with an optional fixed text before and after it (a forced tool call is a JSON object
between ``<tool_call>\\n`` and ``\\n</tool_call>``; the sidecar builds that constraint).

The grammar is compiled once per distinct ``Constraint`` by xgrammar against the engine's tokenizer
(``GrammarBackend.compile``; thread-safe and cached, so a server compiles on a worker thread before
the turn reaches the engine thread). Each constrained sequence owns a ``GrammarMatcher``: before
sampling, its row of the logits gets the matcher's token bitmask (every token that cannot continue
the grammar goes to -inf, ``apply_masks``); after sampling, the matcher accepts the token
(``advance``). Where the grammar forces the next text, only the first of its whole vocabulary tokens,
longest first, stays allowed (``_force_whole_token``): forced text is written in tokens close to
the model tokenizer's own split. A JSON string that starts repeating itself is closed
(engine/string_loop_guard.py: a small model's loop inside a free string would otherwise run to
``max_tokens`` and never parse). Once the grammar is complete only the stop tokens (the engine's EOS
ids) stay allowed, so the reply ends where the structure ends.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from engine.string_loop_guard import StringLoopGuard, closing_words

KINDS = ("json_object", "json_schema", "regex", "grammar")
MAX_SPEC_CHARS = 256 * 1024
"""The longest schema, regex or grammar text a constraint may carry."""
MAX_AFFIX_CHARS = 256
MAX_JSON_DEPTH = 64
STRING_LOOP_WINDOW = 8
"""A JSON string whose last this many tokens already appeared in it is closed (0: never)."""


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (bad kind, malformed or unsupported schema, regex or grammar)."""


@dataclass(frozen=True)
class Constraint:
    """What a reply must match (``SamplingParams.constraint``).

    ``kind``: ``json_object`` (any JSON object), ``json_schema`` (``spec``: the schema as JSON text),
    ``regex`` (``spec``: the pattern) or ``grammar`` (``spec``: EBNF in xgrammar's GBNF dialect).
    ``prefix`` / ``suffix``: fixed text around the structured part."""

    kind: str
    spec: str = ""
    prefix: str = ""
    suffix: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise ConstraintError(f"a constraint's text must be a string of at most {MAX_SPEC_CHARS} characters")
        if self.kind != "json_object" and not self.spec:
            raise ConstraintError(f"a {self.kind} constraint needs its text")
        if len(self.prefix) > MAX_AFFIX_CHARS or len(self.suffix) > MAX_AFFIX_CHARS:
            raise ConstraintError(f"a constraint's prefix and suffix take at most {MAX_AFFIX_CHARS} characters")
        if self.kind == "json_schema":
            check_schema(self.spec)

    @classmethod
    def json_schema(cls, schema: dict | str, prefix: str = "", suffix: str = "") -> "Constraint":
        # the keys keep their order: a grammar writes an object's properties in the schema's order
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
        return cls("json_schema", text, prefix, suffix)


def check_schema(text: str) -> dict | bool:
    """The schema parsed and sanity-checked (an object or a boolean, nesting at most MAX_JSON_DEPTH)."""
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ConstraintError(f"the JSON schema is not JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError("a JSON schema must be a JSON object")
    if _depth(schema) > MAX_JSON_DEPTH:
        raise ConstraintError(f"the JSON schema nests deeper than {MAX_JSON_DEPTH} levels")
    return schema


def _depth(value: Any) -> int:
    depth, level = 0, [value]
    while level:
        depth += 1
        nxt = []
        for v in level:
            if isinstance(v, dict):
                nxt.extend(v.values())
            elif isinstance(v, list):
                nxt.extend(v)
        level = nxt
        if depth > MAX_JSON_DEPTH + 1:
            break
    return depth - 1


class GrammarBackend:
    """xgrammar against one tokenizer: compiles constraints (cached) and makes per-sequence matchers."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: set[int],
        cache_size: int = 256,
        forced_whole_tokens: bool = True,
        string_loop_window: int = STRING_LOOP_WINDOW,
    ):
        try:
            import xgrammar as xgr
        except ImportError:
            raise ConstraintError(
                "structured output needs xgrammar (pip install 'chainkv[server]' or xgrammar)"
            ) from None

        self._xgr = xgr
        self.forced_whole_tokens = forced_whole_tokens
        """Text the grammar forces is written in whole vocabulary tokens (``_force_whole_token``)."""
        self.string_loop_window = string_loop_window
        """JSON constraints: a string that repeats a run of this many tokens is closed (0: off)."""
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2)
        self._token_bytes = list(self.info.decoded_vocab)
        self._closing = closing_words(self._token_bytes, vocab_size)
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, c: Constraint):
        """The compiled grammar of ``c`` (raises ConstraintError); safe to call from any thread."""
        with self._lock:
            hit = self._cache.get(c)
            if hit is not None:
                self._cache.move_to_end(c)
                return hit
        compiled = self._compile(c)
        with self._lock:
            self._cache[c] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, c: Constraint):
        xgr = self._xgr
        try:
            if c.kind == "json_object":
                body = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif c.kind == "json_schema":
                body = xgr.Grammar.from_json_schema(c.spec, any_whitespace=False, strict_mode=True)
            elif c.kind == "regex":
                body = xgr.Grammar.from_regex(c.spec)
            else:
                body = xgr.Grammar.from_ebnf(c.spec)
            parts = [body]
            if c.prefix:
                parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(c.prefix)}"))
            if c.suffix:
                parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(c.suffix)}"))
            grammar = xgr.Grammar.concat(*parts) if len(parts) > 1 else body
            return self.compiler.compile_grammar(grammar)
        except ConstraintError:
            raise
        except (RuntimeError, ValueError, TypeError, RecursionError) as e:  # xgrammar's parse / compile errors
            raise ConstraintError(f"the {c.kind.replace('_', ' ')} cannot be compiled: {_short(e)}") from None

    def matcher(self, c: Constraint, extra_stop_ids: list[int] | None = None) -> "Matcher":
        stops = sorted(set(self.stop_token_ids) | set(extra_stop_ids or []))
        guard = None
        if self.string_loop_window > 0 and c.kind in ("json_object", "json_schema"):
            guard = StringLoopGuard(self._token_bytes, self.string_loop_window)
        return Matcher(self._xgr.GrammarMatcher(self.compile(c), override_stop_tokens=stops), guard)

    def apply_masks(self, logits: torch.Tensor, matchers: list["Matcher | None"]) -> None:
        """Mask, in place, the rows of ``logits`` ``[M, V]`` that belong to constrained sequences."""
        rows = [i for i, m in enumerate(matchers) if m is not None and not m.done]
        if not rows:
            return
        xgr = self._xgr
        bitmask = xgr.allocate_token_bitmask(len(logits), self.vocab_size)
        for i in rows:
            matchers[i].inner.fill_next_token_bitmask(bitmask, i)
            guard = matchers[i].guard
            if guard is not None and guard.must_close:
                closing = bitmask[i] & self._closing
                if bool(closing.any()):  # the grammar lets the string end here: it does
                    bitmask[i] = closing
            if self.forced_whole_tokens:
                _force_whole_token(bitmask[i], matchers[i])
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, inner, guard: StringLoopGuard | None = None):
        self.inner = inner
        self.guard = guard
        """JSON constraints: follows the reply's strings, to close one that loops (or None)."""
        self.rejected = False
        """A token the grammar did not allow was fed (cannot happen through the sampler)."""

    @property
    def done(self) -> bool:
        """The grammar is finished and a stop token was accepted: nothing more may follow."""
        return self.rejected or self.inner.is_terminated()

    def advance(self, token: int) -> bool:
        if self.done:
            return False
        ok = bool(self.inner.accept_token(token))
        self.rejected = not ok
        if ok and self.guard is not None:
            self.guard.feed(token)
        return ok


def _force_whole_token(row: torch.Tensor, m: Matcher) -> None:
    """Where the grammar forces the next text (a JSON key and its quotes and colon, a tool call's fixed
    frame), allow only the first token of that text as xgrammar splits it into whole vocabulary tokens
    (``find_jump_forward_tokens``: longest tokens first). Otherwise the mask lets the model spell the
    forced text in any pieces (``"setup"`` as ``s``/``et``/``u``/``p``), token sequences it never saw in
    training, which derail a small model. ``row``: the sequence's filled bitmask row (int32 words), kept
    as it is when no text is forced or the token is not in it."""
    tokens = m.inner.find_jump_forward_tokens()
    if not tokens:
        return
    t = tokens[0]
    word, bit = divmod(t, 32)
    if word >= len(row) or not (int(row[word]) >> bit) & 1:
        return
    row.zero_()
    row[word] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32 words: bit 31 is the sign bit


_NATIVE_NOISE = re.compile(
    r"\[\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\]\s*|[\w./\\~-]*\.(?:cc|cpp|cxx|c|h|hpp|cu|cuh|py):\d+:?\s*"
)
"""What a native library's error prefixes to its message: a time stamp and the source file and line it was
built from (``[19:08:20] /project/cpp/json_schema_converter.cc:5082: ``)."""


def _short(e: BaseException) -> str:
    """The library's message alone, for the client: its first line without time stamps or source paths."""
    for line in str(e).splitlines():
        text = _NATIVE_NOISE.sub("", line).strip()
        if text:
            return text[:300]
    return type(e).__name__
