"""Model loading errors, EngineConfig vocabulary, and the `chainkv generate` command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from engine.config import ConfigError, EngineConfig
from engine.llm import LLMEngine
from engine.model.loader import ModelLoadError, resolve_model_dir
from sidecar.cli.main import build_parser
from sidecar.cli.engine_args import engine_config_from_args


def test_missing_paths_and_files(tmp_path):
    with pytest.raises(ModelLoadError, match="no such path"):
        resolve_model_dir(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="safetensors"):
        resolve_model_dir(str(tmp_path))
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        resolve_model_dir(str(tmp_path / "x.gguf"))


def test_unsupported_architecture(tmp_path):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(str(tmp_path))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        LLMEngine(EngineConfig(model=str(tmp_path), num_pages=64))


def test_missing_weight(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    src, _ = tiny_models("llama")
    for f in ("config.json",):
        shutil.copy(f"{src}/{f}", tmp_path / f)
    tensors = load_file(f"{src}/model.safetensors")
    tensors.pop("model.layers.1.mlp.down_proj.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="down_proj"):
        LLMEngine(EngineConfig(model=str(tmp_path), num_pages=64))


def test_config_vocabulary_is_one(tmp_path):
    with pytest.raises(ConfigError, match="unknown engine setting"):
        EngineConfig.from_dict({"page_sz": 16})
    with pytest.raises(ConfigError):
        EngineConfig(page_size=12)
    yaml_file = tmp_path / "engine.yaml"
    yaml_file.write_text("method: streaming_llm\nbudget: 128\nmethod_args: {n_sink: 8}\npage_size: 32\n")
    args = build_parser().parse_args(
        ["generate", "--config", str(yaml_file), "--budget", "256", "--method-arg", "n_sink=2", "hi"]
    )
    cfg = engine_config_from_args(args)
    assert (cfg.method, cfg.budget, cfg.page_size, cfg.method_args) == ("streaming_llm", 256, 32, {"n_sink": "2"})
    # every EngineConfig field is a flag of the same name
    flags = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["generate"]._actions}
    assert set(EngineConfig().to_dict()) <= flags


@pytest.mark.slow  # a subprocess
def test_generate_help_lists_methods(generate_help):
    from engine.methods import REGISTRY

    for name in REGISTRY:
        assert name in generate_help
    assert "n_sink=4" in generate_help


@pytest.mark.slow
def test_generate_json_on_smollm2():
    cmd = [
        sys.executable,
        "-m",
        "sidecar.cli",
        "generate",
        "--chat",
        "--json",
        "--max-tokens",
        "12",
        "--num-pages",
        "4000",
        "What is the capital of France?",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert "Paris" in out["text"]
    assert isinstance(out["token_ids"], list) and 0 < len(out["token_ids"]) <= 12


@pytest.mark.slow  # a subprocess
def test_generate_reports_bad_method():
    res = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "generate", "--method", "nope", "--num-pages", "100", "x"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2 and "unknown method 'nope'" in res.stderr
