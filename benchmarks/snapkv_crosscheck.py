"""SnapKV on quality.py's passkey prompts, computed outside the engine (HF transformers, eager).

Why: issue 3 saw snapkv/pyramidkv/adakv near 0 on the passkey while tova/keydiff matched dense.
This recomputes kvpress' SnapKV rule from HF's own attention probabilities — the last ``w``
queries' attention over the first ``n - w`` tokens, summed over the window, avg-pooled (kernel 5,
stride 1, zero padding), averaged over each GQA group, top ``budget - w`` per kv-head plus the
window — prunes HF's cache to those tokens and decodes greedily. No engine code runs, so its
accuracy is what the rule itself gives on this model and prompt. It also reports the fraction of
the key's digit tokens kept over all (layer, kv-head) and, with ``--rows``, a variant that scores
with only the last ``rows`` queries (the question and chat template) while keeping a ``w`` window.

    python benchmarks/snapkv_crosscheck.py --context 512 --samples 6 --windows 64,32,16 --rows 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.quality import passkey_prompts  # noqa: E402
from engine.model.loader import resolve_model_dir  # noqa: E402


class _Tok:
    """What passkey_prompts needs of an engine, with the engine's tokenization."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False)

    def apply_chat_template(self, messages):
        return list(
            self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )


def snapkv_keep(attentions, n: int, w: int, budget: int, H: int, rows: int | None = None) -> list[torch.Tensor]:
    """kvpress' SnapKV keep-indices ``[H, budget]`` per layer from eager attentions ``[1, Hq, n, n]``."""
    keeps = []
    for a in attentions:
        a = a[0]
        s = a[:, -(rows or w) :, : n - w].sum(1)
        s = F.avg_pool1d(s[:, None], 5, stride=1, padding=2)[:, 0]
        s = s.view(H, -1, n - w).mean(1)
        top = s.topk(budget - w, dim=-1).indices
        keeps.append(torch.cat([top, torch.arange(n - w, n).expand(H, w)], 1).sort(-1).values)
    return keeps


@torch.no_grad()
def greedy(model, toks: list[int], keeps, steps: int) -> list[int]:
    """Greedy answer after pruning each layer's cache to ``keeps[layer]`` (None: dense)."""
    n = len(toks)
    o = model(torch.tensor([toks]), use_cache=True)
    cache = o.past_key_values
    for layer, idx in enumerate(keeps or []):
        c = cache.layers[layer]
        ix = idx[None, :, :, None].expand(1, idx.shape[0], idx.shape[1], c.keys.shape[-1])
        c.keys, c.values = c.keys.gather(2, ix), c.values.gather(2, ix)
    out = [int(o.logits[0, -1].argmax())]
    for i in range(steps - 1):
        o = model(
            torch.tensor([[out[-1]]]),
            past_key_values=cache,
            position_ids=torch.tensor([[n + i]]),
            cache_position=torch.tensor([cache.get_seq_length()]),
            use_cache=True,
        )
        out.append(int(o.logits[0, -1].argmax()))
    return out


def digit_positions(tok, toks: list[int], key: str) -> list[int]:
    offs, text = [], ""
    for t in toks:
        offs.append(len(text))
        text += tok.decode([t])
    c0 = text.find(f"The pass key is {key}") + len("The pass key is ")
    return [i for i, s in enumerate(offs) if c0 <= s < c0 + len(key)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--budget", type=float, default=0.5, help="budget ratio")
    ap.add_argument("--windows", default="64,32,16")
    ap.add_argument("--rows", type=int, default=0, help="also: window 64 kept, scored by the last ROWS queries only")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(resolve_model_dir("smollm2"))
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    H = model.config.num_key_value_heads
    configs = [(int(w), None) for w in args.windows.split(",")] + ([(64, args.rows)] if args.rows else [])
    hits = {c: 0 for c in configs}
    dense_hits = 0
    for toks, key in passkey_prompts(_Tok(tok), args.samples, args.context, args.seed):
        n, budget = len(toks), int(args.budget * len(toks))
        with torch.no_grad():
            att = model(torch.tensor([toks]), output_attentions=True).attentions
        digits = digit_positions(tok, toks, key)
        dense = tok.decode(greedy(model, toks, None, 10))
        dense_hits += key in dense
        print(f"key {key}, {n} tokens, dense {dense!r}")
        for c in configs:
            keeps = snapkv_keep(att, n, c[0], budget, H, c[1])
            kept = sum(int(p in set(row.tolist())) for k in keeps for row in k for p in digits) / (
                len(keeps) * H * len(digits)
            )
            ans = tok.decode(greedy(model, toks, keeps, 10))
            hits[c] += key in ans
            print(f"  window {c[0]:3d}{f' scored by last {c[1]}' if c[1] else '':18s} digits kept {kept:.2f}  {ans!r}")
    print(
        f"dense {dense_hits}/{args.samples}; "
        + "; ".join(f"snapkv w={w}{f' rows={r}' if r else ''}: {h}/{args.samples}" for (w, r), h in hits.items())
    )


if __name__ == "__main__":
    main()
