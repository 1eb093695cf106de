"""Our forward vs the HF transformers implementation: logits through chunked prefill and decode."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLMEngine
from engine.sampling import SamplingParams

from tests.conftest import chat, haystack, make_engine


def _check_logits(engine: LLMEngine, hf_model, prompt: list[int], n_decode: int = 20, tol: float = 1e-4):
    params = SamplingParams(max_tokens=n_decode, ignore_eos=True, prompt_logits=True, return_logits=True)
    out = engine.generate([prompt], params)[0]
    assert len(out.token_ids) == n_decode
    full = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        ref = hf_model(full).logits[0].float()
    n = len(prompt)
    assert out.prompt_logits.shape == (n, ref.shape[-1])
    prompt_err = (out.prompt_logits - ref[:n]).abs().max().item()
    # the token sampled at step i came from the logits at position n - 1 + i
    step_err = (out.step_logits - ref[n - 1 : n - 1 + n_decode]).abs().max().item()
    assert prompt_err <= tol, f"prefill logits differ by {prompt_err}"
    assert step_err <= tol, f"decode logits differ by {step_err}"
    return out


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3", "mistral"])
def test_tiny_logits_match_hf(tiny_models, arch):
    path, hf = tiny_models(arch)
    engine = make_engine(path, prefill_chunk_size=96, max_num_batched_tokens=256, num_pages=2048)
    prompt = torch.randint(0, 320, (330,), generator=torch.Generator().manual_seed(1)).tolist()
    _check_logits(engine, hf, prompt)
    assert engine.runner.forward_passes >= 4 + 19  # several prefill chunks, then decode steps


def test_smollm2_logits_match_hf(smol_engine, smollm2_hf):
    prompt = chat(smol_engine, haystack(34) + " Which item is green?")
    assert len(prompt) >= 300
    _check_logits(smol_engine, smollm2_hf, prompt)


def test_smollm2_greedy_equals_hf_generate(smol_engine, smollm2_hf):
    prompt = chat(smol_engine, "Write a short story about a robot who learns to paint.")
    out = smol_engine.generate([prompt], SamplingParams(max_tokens=40))[0]
    with torch.no_grad():
        ref = smollm2_hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt) :].tolist()
    assert len(out.token_ids) >= 32
    assert out.token_ids == ref[: len(out.token_ids)]
    assert out.text.strip()
