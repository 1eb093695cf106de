"""Repetition penalties on the logits rows of a batch: OpenAI's ``presence_penalty`` and
``frequency_penalty``, and vLLM's / Hugging Face's ``repetition_penalty``.

For a row whose sequence generated token ``t`` ``c[t]`` times in this turn (its ``output_ids``):

* ``logit[t] -= frequency_penalty * c[t] + presence_penalty * (c[t] > 0)`` (OpenAI; both in [-2, 2]).
* ``repetition_penalty`` ``r`` (> 0, 1 is off) applies to every token the sequence has *seen*: its
  prompt and its output, as vLLM does. For a session turn the prompt is the whole history before
  this turn's reply (earlier turns included). A seen token's logit is divided by ``r`` when positive
  and multiplied by ``r`` otherwise, so ``r > 1`` makes it less likely either way.

The repetition penalty comes first, then the frequency and presence penalties (vLLM's order), and
all of them before the grammar masks of structured output (engine/constrained.py) and sampling, so
a penalty can never unmask a token the grammar forbids.

Each penalized sequence keeps a ``PenaltyState`` on the logits' device: its output token counts
``[V]`` (updated with the tokens appended since the last step by one ``scatter_add_``) and, when
it uses ``repetition_penalty``, the mask ``[V]`` of its prompt's tokens (built once per turn). The
math then runs once on the stacked ``[m, V]`` rows of the penalized sequences. A batch in which no
sequence uses a penalty returns after one check of its params; its rows are not touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sequence import Sequence


@dataclass
class PenaltyState:
    """One sequence's token statistics for the penalties of its current turn."""

    serial: int
    """The turn (``Sequence.turn_serial``) they belong to; a new turn starts them again."""
    counts: torch.Tensor
    """``[V]`` float32: how often each token occurs in ``output_ids[:counted]``."""
    counted: int
    prompt_seen: torch.Tensor | None
    """``[V]`` bool: tokens of the turn's prompt (only when ``repetition_penalty`` is used)."""


def uses_penalty(p) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _token_tensor(ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """``ids`` as a long tensor on ``device``, with ids outside the vocabulary dropped (run-ahead decode's
    ``PENDING`` slots among them)."""
    t = torch.tensor(ids, dtype=torch.long)
    t = t[(t >= 0) & (t < vocab)] if len(ids) else t
    return t.to(device, non_blocking=True)


def _state(seq: Sequence, vocab: int, device: torch.device) -> PenaltyState:
    """``seq``'s state, brought up to date with the tokens it generated since the last step."""
    st: PenaltyState | None = getattr(seq, "penalty_state", None)
    n_out = len(seq.output_ids)
    if st is None or st.serial != seq.turn_serial or st.counted > n_out or st.counts.device != device:
        prompt_seen = None
        if seq.params.repetition_penalty != 1.0:
            prompt = seq.token_ids[: len(seq.token_ids) - n_out]
            prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt_seen[_token_tensor(prompt, vocab, device)] = True
        st = PenaltyState(seq.turn_serial, torch.zeros(vocab, dtype=torch.float32, device=device), 0, prompt_seen)
        seq.penalty_state = st
    if st.counted < n_out:
        new = _token_tensor(seq.output_ids[st.counted :], vocab, device)
        st.counts.scatter_add_(0, new, torch.ones(new.shape, dtype=torch.float32, device=device))
        st.counted = n_out
    return st


def penalize(
    logits: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor | None,
    counts: torch.Tensor,
    seen: torch.Tensor | None,
) -> torch.Tensor:
    """The penalized rows ``[m, V]``: ``presence``, ``frequency``, ``repetition`` are ``[m]``;
    ``counts`` ``[m, V]`` the output counts, ``seen`` ``[m, V]`` the prompt-or-output mask (both
    needed only with ``repetition``)."""
    x = logits.float()
    if repetition is not None and seen is not None:
        r = repetition[:, None]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - counts * frequency[:, None] - (counts > 0).float() * presence[:, None]
    return x.to(logits.dtype)


@torch.inference_mode()
def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Penalize, in place, the rows of ``logits`` ``[len(seqs), V]`` whose sequences ask for it."""
    rows = [i for i, s in enumerate(seqs) if uses_penalty(s.params)]
    if not rows:
        return
    vocab, device = logits.shape[-1], logits.device
    states = [_state(seqs[i], vocab, device) for i in rows]
    params = [seqs[i].params for i in rows]
    counts = torch.stack([st.counts for st in states])
    presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32).to(device)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32).to(device)
    repetition = seen = None
    if any(p.repetition_penalty != 1.0 for p in params):
        repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32).to(device)
        no_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        prompt = torch.stack([st.prompt_seen if st.prompt_seen is not None else no_prompt for st in states])
        seen = prompt | (counts > 0)
    index = torch.tensor(rows, dtype=torch.long).to(device)
    logits[index] = penalize(logits[index], presence, frequency, repetition, counts, seen)
