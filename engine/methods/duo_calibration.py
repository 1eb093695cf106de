"""DuoAttention head calibration on locally generated passkey-retrieval data.

``chainkv calibrate duo_attention`` runs this. Each sample is a haystack of filler sentences with a
five-digit passkey hidden at a random depth, a question, and the answer appended (teacher forcing,
as the paper's calibration does). The model runs the whole sample densely once; for every
(layer, kv-head) we measure the attention mass that the answer-time queries (the question and the
answer) put *outside* the streaming window: past the first ``n_sink`` tokens and before the most
recent ``n_recent`` tokens of each query. A head that must reach back into the haystack to find
the passkey puts a lot of mass there (a retrieval head); a head that attends sinks and recent
tokens puts almost none (a streaming head). The score of a kv-head is the largest over its query
group, averaged over samples; DuoAttention streams the heads with the lowest scores.

The paper instead learns a gate per head by distillation on the same kind of data (mix full and
streaming attention, minimise the output difference plus an L1 push towards streaming). Our
score is the training-free counterpart: it measures directly what streaming would drop.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass
class PasskeySample:
    prompt: list[int]
    answer: list[int]
    needle: tuple[int, int]
    """Token span of the passkey sentence in ``prompt``."""


def passkey_sample(tokenizer, num_tokens: int, rng: random.Random) -> PasskeySample:
    """About ``num_tokens`` tokens of filler with a passkey at a random depth, then the question."""
    key = str(rng.randint(10000, 99999))
    filler = tokenizer.encode(FILLER, add_special_tokens=False)
    intro = tokenizer.encode(
        "There is a pass key hidden in a lot of irrelevant text. Find it and memorize it. ", add_special_tokens=False
    )
    needle = tokenizer.encode(f"The pass key is {key}. Remember it. {key} is the pass key. ", add_special_tokens=False)
    question = tokenizer.encode("What is the pass key? The pass key is", add_special_tokens=False)
    n_fill = max(1, (num_tokens - len(intro) - len(needle) - len(question)) // len(filler))
    depth = rng.randint(1, max(1, n_fill - 1))
    before = intro + filler * depth
    prompt = before + needle + filler * (n_fill - depth) + question
    return PasskeySample(
        prompt, tokenizer.encode(" " + key, add_special_tokens=False), (len(before), len(before) + len(needle))
    )


class _MassRecorder:
    """An ``attend`` for the model forward: dense causal attention that records, per query head,
    the mean attention mass of the last ``w`` queries outside each query's sink + recent window."""

    def __init__(self, n_sink: int, n_recent: int, w: int, scale: float):
        self.n_sink, self.n_recent, self.w, self.scale = n_sink, n_recent, w, scale
        self.mass: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, Hq, D = q.shape
        H = k.shape[1]
        G = Hq // H
        qh = q.view(n, H, G, D).permute(1, 2, 0, 3).float()  # [H, G, n, D]
        kh, vh = k.permute(1, 0, 2).float(), v.permute(1, 0, 2).float()  # [H, n, D]
        scores = torch.einsum("hgnd,htd->hgnt", qh, kh) * self.scale
        t = torch.arange(n, device=q.device)
        scores = scores.masked_fill(t[None, :] > t[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("hgnt,htd->hgnd", probs, vh).permute(2, 0, 1, 3).reshape(n, Hq, D).to(q.dtype)
        w = min(self.w, n)
        qpos = t[n - w :]
        far = (t[None, :] >= self.n_sink) & (t[None, :] < (qpos[:, None] - self.n_recent + 1))  # [w, n]
        self.mass[layer] = (probs[:, :, n - w :, :] * far).sum(-1).mean(-1).reshape(Hq)  # [Hq]
        return out


@torch.inference_mode()
def calibrate(
    engine,
    samples: int = 8,
    min_tokens: int = 1024,
    max_tokens: int = 2048,
    n_sink: int = 128,
    n_recent: int = 256,
    seed: int = 0,
) -> dict:
    """Head scores ``[L][H]`` for ``engine``'s model, as a pattern dict duo_attention loads."""
    model = engine.model
    mc = engine.model_config
    rng = random.Random(seed)
    total = torch.zeros(mc.num_layers, mc.num_kv_heads)
    found = 0
    for _ in range(samples):
        sample = passkey_sample(engine.tokenizer, rng.randint(min_tokens, max_tokens), rng)
        ids = sample.prompt + sample.answer
        if len(ids) > engine.max_model_len:
            raise ValueError(f"a calibration sample of {len(ids)} tokens exceeds max_model_len {engine.max_model_len}")
        w = len(sample.answer) + 8  # the end of the question and the answer
        rec = _MassRecorder(n_sink, n_recent, w, mc.head_dim**-0.5)
        dev = engine.device
        rows = torch.arange(len(sample.prompt) - 1, len(ids) - 1, device=dev)
        logits = model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev), rec, rows)
        predicted = logits.argmax(-1).tolist()
        found += predicted == sample.answer
        mass = torch.stack([rec.mass[layer].cpu() for layer in range(mc.num_layers)])  # [L, Hq]
        total += mass.view(mc.num_layers, mc.num_kv_heads, -1).amax(-1)
    scores = total / samples
    return {
        "model": engine.model_dir.name,
        "num_layers": mc.num_layers,
        "num_kv_heads": mc.num_kv_heads,
        "head_dim": mc.head_dim,
        "calibration": {
            "data": "passkey",
            "samples": samples,
            "min_tokens": min_tokens,
            "max_tokens": max_tokens,
            "n_sink": n_sink,
            "n_recent": n_recent,
            "seed": seed,
            "answered": found,
            "score": "attention mass of answer-time queries outside sink + recent, max over the query group",
        },
        "scores": [[round(float(x), 6) for x in row] for row in scores],
    }


def write_pattern(pattern: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps({k: v for k, v in pattern.items() if k != "scores"}, indent=1)
    rows = ",\n".join("  " + json.dumps(row) for row in pattern["scores"])  # one layer per line
    path.write_text(head[:-2] + ',\n "scores": [\n' + rows + "\n ]\n}\n")
    return path
