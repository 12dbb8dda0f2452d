"""Find, load and place a model: a HF directory, a GGUF file, or the default SmolLM2."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve.model.default_model import DEFAULT_MODEL_NAME, ensure_converted_gguf, ensure_default_model
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.spec import ModelSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HINT = (
    "pass a local Hugging Face directory (config.json + *.safetensors + tokenizer files), "
    "a .gguf file, or no model for the default SmolLM2-135M-Instruct"
)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    spec: ModelSpec
    tokenizer: Any | None
    eos_token_ids: list[int]
    path: Path
    name: str
    max_model_len: int


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but no CUDA device is available; use device='cpu'")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def resolve_model_path(model: str | None, cache_dir: str | None = None) -> Path:
    if model is None:
        return ensure_default_model(cache_dir)
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model {model!r} not found: {_HINT} (no model hub is contacted)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {model!r} is not a .gguf file: {_HINT}")
        return ensure_converted_gguf(path, cache_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {model!r} has no config.json: {_HINT}")
    return path


def load_model(
    model: str | None,
    dtype: str = "auto",
    device: str = "auto",
    max_model_len: int | None = None,
    cache_dir: str | None = None,
) -> LoadedModel:
    """Load weights into radixserve's own model; raises ValueError with what to do on failure."""
    path = resolve_model_path(model, cache_dir)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    spec = ModelSpec.from_hf_config(_load_hf_config(path))
    context = spec.max_position_embeddings if max_model_len is None else max_model_len
    if context > spec.max_position_embeddings:
        raise ValueError(
            f"max_model_len {context} exceeds the model's context ({spec.max_position_embeddings} tokens)"
        )
    with torch.device("meta"):
        net = LlamaForCausalLM(spec, context)
    net = net.to(torch_dtype).to_empty(device=torch_device)
    net.rotary.build(context, torch_device)
    net.load_hf_state_dict(_read_weights(path))
    net.eval()
    tokenizer = _load_tokenizer(path)
    name = DEFAULT_MODEL_NAME if model is None else path.name
    return LoadedModel(net, spec, tokenizer, _eos_token_ids(path, spec, tokenizer), path, name, context)


def _load_hf_config(path: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"cannot read {path / 'config.json'}: {exc}") from None


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        return tensors
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        tensors = {}
        for f in bins:
            tensors.update(torch.load(f, map_location="cpu", weights_only=True))
        return tensors
    raise ValueError(f"model directory {path} has no *.safetensors or pytorch_model*.bin weights: {_HINT}")


def _load_tokenizer(path: Path) -> Any | None:
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _eos_token_ids(path: Path, spec: ModelSpec, tokenizer: Any | None) -> list[int]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    sources = [json.loads(gen.read_text()).get("eos_token_id")] if gen.is_file() else []
    sources.append(getattr(spec.hf_config, "eos_token_id", None))
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for source in sources:
        for token in source if isinstance(source, list) else [source]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids
