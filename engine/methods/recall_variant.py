"""<method>+recall: any evicting method, with what it evicts kept recallable in host memory.

Rule: the base method runs unchanged on ``1 - recall_reserve`` of the budget, the device working
set stays within the whole budget (pages are freed as before), and every token it evicts moves to
the session's cold tier on the host (engine/cache/cold_store.py) with Quest-style key bounds per
block of ``page_size`` cold tokens kept on the device. Once a turn's input is prefilled (and the
method has compressed it), the turn's last queries score every cold block; the ``recall_pages``
best blocks per kv-head are fetched and ranked by their exact attention logits, max-pooled over
``recall_pool`` neighbouring positions (a copied record's later tokens rank with the key the
query attends to), and the best fill the head up to its budget without displacing what it holds
(the others go back to the cold tier; with ``recall_reserve=0`` they compete with the held
tokens). The turn's last input token is then run again so its reply's first token reads the
recalled KV. With ``recall_interval`` set, decode steps recall the same
way every that many tokens. Snapshots carry the cold tier, so a session resumes whole elsewhere.

References: ArkVale (Chen et al., NeurIPS 2024: page digests of evicted KV recalled when they
become relevant), InfLLM (Xiao et al., NeurIPS 2024: cold blocks in host memory scored by
representatives), Quest (Tang et al., ICML 2024: the per-page min/max key bound). engine/recall.py
carries the rule out; this module only declares the variant and checks its parameters.

Parameters (besides the base method's):
    recall_pages = 0          cold blocks per kv-head scored exactly at each recall; 0: the head's
                              budget in pages (at least 1): four times the default reserve's room, so
                              the exact ranking chooses (with only as many candidates as room, every
                              fetched token was kept and the key bounds alone decided)
    recall_window = 32        the latest queries (per layer, of the turn's input or of decoding)
                              that score the cold blocks; the latest ``recall_window`` tokens a head
                              holds (at most half its budget) are never displaced
    recall_pool = 9           a token ranks by the best score (``recall_score``) within ``recall_pool`` positions of
                              it (a max-pooling in position order, centred; 1: its own): a record's
                              later tokens come back with the key the query attends to (odd, <= 63)
    recall_score = "logit"    what ranks a token: ``logit``, its best exact logit over the queries; ``mass``,
                              the attention weight the queries give it, summed (softmax over what the
                              head holds and the fetched candidates, as SnapKV weighs its window)
    recall_scope = "all"      which cold blocks a turn's input may recall: ``all``, or ``earlier`` (only
                              what earlier turns evicted: the method's choice for this turn stands,
                              so a variant's first turn is its base method's, token for token)
    recall_reserve = 0.25     the share of the budget the recall fills: the method itself keeps the
                              rest, and a recall never displaces what the method kept, only what an
                              earlier recall brought (the method's next compression weighs those like
                              its own tokens). 0: the method keeps the whole budget and a recall
                              competes with all of it (but the pinned), displacing the lowest logits
    recall_interval = None    decode steps between recalls while a reply is decoded (None: recall
                              only when a turn's input is in); 0 is refused
    recall_rerun = True       run the turn's last input token again after a recall
    cold_format = "plain"     how cold KV is stored on the host: ``plain`` (the model's dtype) or
                              ``fp8`` (float8 e4m3 with a scale per token: half the bytes of bf16)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.lifecycle import SparseMethod
from engine.method_spec import MethodError

SUFFIX = "+recall"
COLD_FORMATS = ("plain", "fp8")
RECALL_SCOPES = ("all", "earlier")
RECALL_SCORES = ("logit", "mass")


@dataclass
class RecallParams:
    recall_pages: int = 0
    recall_window: int = 32
    recall_pool: int = 9
    recall_score: str = "logit"
    recall_scope: str = "all"
    recall_reserve: float = 0.25
    recall_interval: int | None = None
    recall_rerun: bool = True
    cold_format: str = "plain"

    def check(self, name: str) -> None:
        def bad(msg: str) -> MethodError:
            return MethodError(f"{name}: {msg}")

        for key in ("recall_pages", "recall_window", "recall_pool"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(f"{key} must be an integer, not {value!r}")
        if not 0 <= self.recall_pages <= 1 << 16:
            raise bad(f"recall_pages must be in [0, 65536] (0: the budget in pages), not {self.recall_pages}")
        if not 1 <= self.recall_window <= 4096:
            raise bad(f"recall_window must be in [1, 4096] queries, not {self.recall_window}")
        if not (1 <= self.recall_pool <= 63 and self.recall_pool % 2 == 1):
            raise bad(f"recall_pool must be an odd number of positions in [1, 63], not {self.recall_pool}")
        r = self.recall_reserve
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
            raise bad(f"recall_reserve must be a share of the budget in [0, 1), not {r!r}")
        if self.recall_score not in RECALL_SCORES:
            raise bad(f"recall_score must be one of {', '.join(RECALL_SCORES)}, not {self.recall_score!r}")
        if self.recall_scope not in RECALL_SCOPES:
            raise bad(f"recall_scope must be one of {', '.join(RECALL_SCOPES)}, not {self.recall_scope!r}")
        i = self.recall_interval
        if i is not None and (isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= 1 << 20):
            raise bad(f"recall_interval must be a number of decode steps >= 1 (or unset), not {i!r}")
        if not isinstance(self.recall_rerun, bool):
            raise bad(f"recall_rerun must be true or false, not {self.recall_rerun!r}")
        if self.cold_format not in COLD_FORMATS:
            raise bad(f"cold_format must be one of {', '.join(COLD_FORMATS)}, not {self.cold_format!r}")


_RECALL_FIELDS = [f.name for f in dataclasses.fields(RecallParams)]
_VARIANTS: dict[type, type] = {}


def base_name(name: str) -> str | None:
    """The base method of a ``<method>+recall`` name, or None for a plain name."""
    return name[: -len(SUFFIX)] if name.endswith(SUFFIX) else None


def recall_variant(base: type[SparseMethod]) -> type[SparseMethod]:
    """The ``<base>+recall`` class: ``base`` with the recall parameters added (made once)."""
    if base in _VARIANTS:
        return _VARIANTS[base]
    if not base.holds_budget:
        raise MethodError(
            f"{base.name}{SUFFIX}: {base.name!r} keeps every token (nothing is evicted, so nothing to recall); "
            f"recall applies to methods that evict"
        )
    bases = (base.Params,) if base.Params is not None else ()
    fields = [(f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(RecallParams)]
    params = dataclasses.make_dataclass(f"{base.__name__}RecallParams", fields, bases=bases)

    def budget_for(self, num_tokens: int) -> int | None:
        """The method's own share: the budget less the recall's reserve."""
        full = base.budget_for(self, num_tokens)
        return None if full is None else max(1, full - int(full * self.recall_params.recall_reserve))

    def device_budget(self, num_tokens: int) -> int | None:
        """The head's whole device budget, the recall's reserve included."""
        return base.budget_for(self, num_tokens)

    def __init__(self, spec, shape):
        self.recall_params = RecallParams()  # the base's constructor may ask for a budget
        base.__init__(self, spec, shape)
        self.recall_params = RecallParams(**{k: getattr(self.params, k) for k in _RECALL_FIELDS})
        self.recall_params.check(self.name)
        if self.kv_layout().format != "plain":
            raise MethodError(
                f"{self.name}: recall needs plain KV pages, {base.name!r} stores {self.kv_layout().describe()}"
            )

    variant = type(
        f"{base.__name__}Recall",
        (base,),
        {
            "name": base.name + SUFFIX,
            "Params": params,
            "__init__": __init__,
            "__module__": base.__module__,
            "recall_settings": lambda self: self.recall_params,
            "budget_for": budget_for,
            "device_budget": device_budget,
        },
    )
    _VARIANTS[base] = variant
    return variant
