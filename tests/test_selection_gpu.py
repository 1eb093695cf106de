"""GPU: quest and offload through the Triton decode kernel's sparse page lists; offload's pinned host tier.

A small random-weight Llama (no checkpoint needed on the GPU machine), compared by token ids."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


RANDOM_LLAMA = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=2048,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def random_llama_engine(model_dir, device: str = "cuda", cuda_graphs: bool = False):
    """A small Llama with random weights (nothing to download or carry): greedy token ids are
    deterministic, so methods are compared token for token."""
    from transformers import LlamaConfig

    from tests.conftest import make_engine

    cfg = LlamaConfig(**RANDOM_LLAMA)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(str(model_dir))
    # no CUDA graphs by default: every step goes through the same (eager) kernel, with or without page lists
    return make_engine(
        model_dir,
        random_weights=True,
        device=device,
        num_pages=20000,
        prefill_chunk_size=128,
        max_model_len=2048,
        cuda_graphs=cuda_graphs,
        async_decode=False,
    )


@pytest.fixture(scope="module")
def gpu_engine(tmp_path_factory):
    return random_llama_engine(tmp_path_factory.mktemp("random-llama"))


@pytest.fixture(scope="module")
def prompt(gpu_engine):
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, RANDOM_LLAMA["vocab_size"], (600,), generator=gen).tolist()


def _run(eng, prompt, specs, max_tokens=32):
    from engine.sampling import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [eng.add_request(prompt, sp, method=s) for s in specs]
    done = {}
    while len(done) < len(ids):
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    return [done[i] for i in ids]


def test_triton_covering_page_lists_equal_dense(gpu_engine, prompt):
    from engine.method_spec import MethodSpec

    assert gpu_engine.backend.name == "triton"
    dense, quest, offload = _run(
        gpu_engine, prompt, [MethodSpec("dense"), MethodSpec("quest", budget=8192), MethodSpec("offload", budget=8192)]
    )
    assert quest == dense and offload == dense


def test_triton_sparse_page_lists_match_reference(gpu_engine, prompt):
    """A small Quest budget through the Triton kernel reads the same pages the reference backend
    would: the attention output of one step equals the reference over the same view."""
    from engine.attention.reference import ReferenceAttention
    from engine.cache.view import AttentionView

    eng = gpu_engine
    pool = eng.pool
    P, D = pool.page_size, pool.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, H, Hq, NP = 3, eng.shape.num_kv_heads, eng.shape.num_heads, 12
    pages = torch.arange(B * H * NP, device="cuda", dtype=torch.int32).view(B, H, NP) + 100
    pool.k[100 : 100 + B * H * NP].normal_(generator=gen)
    pool.v[100 : 100 + B * H * NP].normal_(generator=gen)
    lengths = torch.tensor([[NP * P - 3] * H, [NP * P] * H, [5 * P + 1] * H], dtype=torch.int32, device="cuda")
    sel = torch.tensor([0, 3, 7, 11, -1], device="cuda").repeat(B, H, 1)
    view = AttentionView(pages, lengths, P, selected_pages=sel)
    q = torch.randn(B, Hq, D, device="cuda", dtype=pool.dtype, generator=gen)
    out, _ = eng.backend.decode(pool, view, q, D**-0.5)
    ref, _ = ReferenceAttention().decode(pool, view, q, D**-0.5)
    assert torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_offload_on_cuda_uses_pinned_host_pages_within_budget(gpu_engine, prompt):
    from engine.method_spec import MethodSpec
    from engine.methods import create_method

    eng = gpu_engine
    L, H, P = eng.shape.num_layers, eng.shape.num_kv_heads, eng.shape.page_size
    spec = MethodSpec("offload", budget=6 * P, method_args={"n_sink": 16, "n_local": 32})
    twin = MethodSpec("offload", budget=6 * P, method_args={"n_sink": 16, "n_local": 32, "use_host": False})
    per_head = create_method(spec, eng.shape).layout(len(prompt))[2] + 1
    tokens, same = _run(eng, prompt, [spec, twin], 48)
    assert eng.pool.host.pinned and eng.pool.host.fetches > 0
    assert tokens == same
    # and the bound during a lone run
    from engine.sampling import SamplingParams

    rid = eng.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True), method=spec)
    while eng.has_unfinished():
        eng.step()
        if eng.manager.has(rid) and eng._seqs[rid].num_cached > len(prompt):
            assert eng.manager.num_pages(rid) <= L * H * per_head
            assert sum(eng.manager.num_host_pages(rid, layer) for layer in range(L)) > 0


def test_quest_decodes_inside_cuda_graphs(gpu_engine, prompt, tmp_path):
    """Quest with a budget in tokens runs its page selection inside the decode CUDA graph: the same
    tokens as the eager step (a sparse budget, three sequences of different lengths in one batch)."""
    from engine.method_spec import MethodSpec

    graphs = random_llama_engine(tmp_path / "graphs", cuda_graphs=True)
    prompts = [prompt, prompt[:437], prompt[:250]]
    spec = MethodSpec("quest", budget=128)
    sp = _params(40)
    eager = [o.token_ids for o in gpu_engine.generate(prompts, sp, method=spec)]
    before = graphs.runner.graph_steps
    replayed = [o.token_ids for o in graphs.generate(prompts, sp, method=spec)]
    assert graphs.runner.graph_steps - before >= 35  # decode steps ran as graph replays
    assert replayed == eager


def _params(n):
    from engine.sampling import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True)
