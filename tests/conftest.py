"""Shared fixtures: tiny random HF models (fast, fixed seed) and the real SmolLM2 engine. Every test
builds its engines with ``make_engine`` (only tests of invalid configs call ``LLMEngine`` themselves).

Test tiers: every test that loads SmolLM2 is marked ``slow`` — here, for every test whose fixtures
(directly or through other fixtures) include one of ``SMOLLM2_FIXTURES``; by hand (``@pytest.mark.slow``)
for a test that builds a SmolLM2 engine itself or runs the CLI / a sidecar process. The fast tier is
``pytest -m "not slow"``.
"""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

# Without CUDA the Triton kernel tests run under Triton's interpreter; the variable is read when a
# kernel is defined, so it is set here, before any engine module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
)


SMOLLM2_FIXTURES = {"smol_engine", "smollm2_dir", "smollm2_hf", "smollm2_sidecar"}
"""Fixtures that load SmolLM2: a test that uses one, directly or not, is ``slow``."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SMOLLM2_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def make_tiny(arch: str, path, seed: int = 0, **extra):
    """Save a tiny random HF model of ``arch`` (llama, llama3, qwen2, qwen3, mistral) into ``path``."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = dict(TINY, **extra)
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(**kw, tie_word_embeddings=False), tf.LlamaForCausalLM
    elif arch == "llama3":  # llama3 rope scaling, tied embeddings
        kw["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
        cfg, cls = tf.LlamaConfig(**kw, tie_word_embeddings=True), tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**kw, tie_word_embeddings=False), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(**kw, head_dim=32, tie_word_embeddings=True), tf.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(**kw, sliding_window=None), tf.MistralForCausalLM
    else:
        raise ValueError(arch)
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    model.save_pretrained(str(path))
    return model


def make_engine(model: str | None, base: dict | None = None, /, *, random_weights: bool = False, **config):
    """An ``LLMEngine`` on the model folder ``model`` (a tiny one: ``make_tiny``'s folder, ``tiny_models(arch)[0]``,
    ``tiny_chat_dir``; None: ``EngineConfig``'s default model, SmolLM2) with the ``EngineConfig`` fields of
    ``base`` (settings a test module shares, e.g. ``SMALL_PAGES_CPU``) and ``config`` over them. Nothing is
    defaulted here: an engine is configured as its test spells it. ``random_weights``: the weights are not
    loaded (a folder that holds only a config)."""
    from engine.config import EngineConfig
    from engine.llm import LLMEngine

    fields = {**(base or {}), **config}
    if model is not None:
        fields["model"] = str(model)
    return LLMEngine(EngineConfig(**fields), random_weights=random_weights)


SMALL_PAGES_CPU = dict(device="cpu", page_size=4, prefill_chunk_size=32, max_num_batched_tokens=256)
"""Engine settings for session tests on a tiny model: 4-token pages, so a few turns span many pages."""


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> (folder, HF model); built once per session."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[arch] = (str(path), make_tiny(arch, path))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def smollm2_dir():
    from engine.model.loader import resolve_model_dir

    return str(resolve_model_dir("smollm2"))


@pytest.fixture(scope="session")
def generate_help() -> str:
    """What ``python -m sidecar.cli generate --help`` prints: one subprocess for every test that reads it."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "generate", "--help"], capture_output=True, text=True, check=True
    ).stdout


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    """The parity oracle. Eager attention: HF's own sdpa path differs from its eager path by ~7e-5
    in SmolLM2's logits, so eager is the implementation to match to 1e-4."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def smol_engine():
    """A SmolLM2 engine shared by tests that do not constrain the pool (default dense method)."""
    return make_engine(None, num_pages=40000, prefill_chunk_size=128, max_num_batched_tokens=1024)


def chat(engine, text: str) -> list[int]:
    return engine.apply_chat_template([{"role": "user", "content": text}])


def haystack(n_items: int) -> str:
    colors = ["red", "blue", "green", "yellow", "purple"]
    return " ".join(f"Item {i} is a {colors[i * 7 % 5]} ball." for i in range(n_items))


def first_turn(engine, text: str, system: str | None = None) -> list[int]:
    """A session's first turn in the engine's chat template: an optional system message, then ``text`` as user."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return engine.apply_chat_template(msgs)


def next_turn(engine, text: str, role: str = "user") -> list[int]:
    """The tokens that follow an assistant reply (which ends with <|im_end|>) in ChatML: ``text`` as ``role``,
    then the assistant header."""
    return engine.encode(f"\n<|im_start|>{role}\n{text}<|im_end|>\n<|im_start|>assistant\n")


def run_turn(engine, sid: str, tokens: list[int], params, **kw):
    """Add ``tokens`` as session ``sid``'s next turn (``kw`` goes to ``add_turn``: method, turn_index, ...) and
    step the engine until that session's request finishes; returns its final output. Other requests in flight
    step along."""
    engine.add_turn(sid, tokens, params, **kw)
    while True:
        for out in engine.step():
            if out.request_id == sid and out.finished:
                return out


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory, smollm2_dir):
    """A tiny random llama with SmolLM2's tokenizer and chat template (vocab 49152): chat, tools and
    structured output on a model that loads in a second (its replies are random text)."""
    import shutil
    from pathlib import Path

    path = tmp_path_factory.mktemp("tiny-chat")
    make_tiny("llama", path, vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(smollm2_dir) / name).exists():
            shutil.copy(Path(smollm2_dir) / name, path / name)
    return str(path)


@pytest.fixture(scope="session")
def tiny_chat_server(tiny_chat_dir):
    """One in-process sidecar (gRPC, no store, default options) on an engine of ``tiny_chat_dir``, shared by
    the modules that need only "a server on the tiny chat model" (they use their own session ids)."""
    from sidecar.grpc.server import ServerOptions, ServerThread

    engine = make_engine(tiny_chat_dir, num_pages=4000, prefill_chunk_size=128, max_model_len=2048)
    server = ServerThread(engine, ServerOptions(port=0))
    server.start()
    yield server
    server.stop(grace=1)


@pytest.fixture(scope="session")
def smollm2_sidecar(tmp_path_factory):
    """One ``chainkv serve`` process on SmolLM2 (tests/sidecar_proc.py) serving both fronts (``--http-port``),
    auth off, sessions in a directory store: for tests that need "a real sidecar" and do not stop, kill or
    reconfigure it. ``.port`` is gRPC, ``.http_port`` the OpenAI-compatible HTTP API."""
    from tests.sidecar_proc import Sidecar

    store = tmp_path_factory.mktemp("sidecar-store")
    proc = Sidecar(f"file://{store}", "--http-port", "0", tokens={}).start()
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def redis_proc(tmp_path_factory):
    """A real redis-server of the test module's own (tests/redis_server.py), on a free port in a temp dir;
    a module that needs another kind (append-only file on) defines its own."""
    from redis_server import RedisProcess

    proc = RedisProcess(tmp_path_factory.mktemp("redis")).start()
    yield proc
    proc.stop()
