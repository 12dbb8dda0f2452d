"""Find, load and place a model: a HF directory, a GGUF file, or the default SmolLM2."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from radixserve.kernels.heap import return_freed_memory
from radixserve.kernels.quant_linear import QuantWeight, quantize
from radixserve.model.default_model import (
    DEFAULT_MODEL_NAME, default_gguf_path, ensure_converted_gguf, ensure_default_model,
)
from radixserve.model.causal_lm import CausalLM, _map_weight_name
from radixserve.model.hf_config import load_hf_config
from radixserve.model.tokenizer import load_tokenizer
from radixserve.model.packaged_models import PACKAGED_MODELS, packaged_gguf
from radixserve.model.registry import ModelFamily, family_for_config, model_class
from radixserve.model.spec import ModelSpec

logger = logging.getLogger(__name__)

WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "int8", "int4")
REPACKED_FILE = "quantized.safetensors"  # a GGUF's weights in QuantWeight's layout, beside the conversion
# 2: the legacy types' scales and offsets float16; 3: float tensors as the model holds them (Gemma 3's
# norms as the GGUF stores them, 1 + w)
_REPACK_FORMAT = "radixserve-repacked-3"
# Weights quantized by --weight-dtype int8/int4: the projections, the embedding, the lm head.
_QUANTIZABLE = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HINT = (
    "pass a local Hugging Face directory (config.json + *.safetensors + tokenizer files), "
    f"a .gguf file, a packaged model ({', '.join(PACKAGED_MODELS)}), or no model for the default "
    "SmolLM2-135M-Instruct"
)


@dataclass
class LoadedModel:
    model: CausalLM
    spec: ModelSpec
    tokenizer: Any | None
    eos_token_ids: list[int]
    path: Path
    name: str
    max_model_len: int
    weight_dtype: str = "float32"  # how the weights are held: float32, bfloat16, int8, int4, or gguf:TYPES
    weight_bytes: int = 0


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


def resolve_model_path(model: str | None, cache_dir: str | None = None, float_weights: bool = True) -> Path:
    """The model's directory (a GGUF's conversion; without `float_weights` only its config
    and tokenizer are converted, the weights being read from the file itself)."""
    return open_model(model, cache_dir, float_weights).directory


@dataclass
class ModelSource:
    """Where a load reads from: the directory (config.json, tokenizer; a GGUF's conversion),
    the GGUF file the model comes from (its header read at most once, by whichever step
    needs it first), and the family where that header has named it already."""

    directory: Path
    gguf: Any | None  # a gguf_file.GGUFFile

    def family(self, config_fields: dict[str, Any]) -> ModelFamily:
        """The model's family, looked up once: from the GGUF header where this load read it,
        else from config.json's own fields (whether or not transformers knows the type)."""
        if self.gguf is not None and self.gguf.opened:
            return self.gguf.family
        return family_for_config(SimpleNamespace(model_type=config_fields.get("model_type"),
                                                 architectures=config_fields.get("architectures")))


def open_model(model: str | None, cache_dir: str | None = None, float_weights: bool = True) -> ModelSource:
    if model is None:
        return ModelSource(ensure_default_model(cache_dir), _gguf_file(default_gguf_path()))
    if model in PACKAGED_MODELS:
        gguf = _gguf_file(packaged_gguf(model, cache_dir))
        return ModelSource(ensure_converted_gguf(gguf, cache_dir, float_weights), gguf)
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model {model!r} not found: {_HINT} (no model hub is contacted)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {model!r} is not a .gguf file: {_HINT}")
        gguf = _gguf_file(path)
        return ModelSource(ensure_converted_gguf(gguf, cache_dir, float_weights), gguf)
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {model!r} has no config.json: {_HINT}")
    return ModelSource(path, None)


def _gguf_file(path: Path) -> Any:
    from radixserve.model.gguf_file import GGUFFile

    return GGUFFile(path)


def resolve_weight_dtype(weight_dtype: str, model: str | None, device: torch.device, dtype: str,
                         cache_dir: str | None = None) -> str:
    """How the weights will be held: 'gguf' (a GGUF's quantized tensors as stored: `auto` on
    CPU), 'int8' / 'int4' (quantized at load), or 'float' (the model's dtype). Refuses
    combinations that cannot run, before anything is loaded."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    if weight_dtype in ("float32", "bfloat16"):
        if dtype not in ("auto", weight_dtype):
            raise ValueError(f"weight_dtype {weight_dtype} with dtype {dtype}: the weights are the model's "
                             f"dtype; set one of them")
        return "float"
    quantizes = weight_dtype in ("int8", "int4") or (weight_dtype == "auto" and _gguf_source(model, cache_dir)
                                                     is not None)
    if not quantizes:
        return "float"
    if device.type != "cpu" or resolve_dtype(dtype, device) != torch.float32:
        if weight_dtype == "auto":
            return "float"  # quantized kernels are CPU float32 ones; elsewhere auto keeps floats
        raise ValueError(f"weight_dtype {weight_dtype} runs on CPU with float32 activations "
                         f"(device {device.type}, dtype {dtype}); use weight_dtype float32 or bfloat16")
    return "gguf" if weight_dtype == "auto" else weight_dtype


def load_model(
    model: str | None,
    dtype: str = "auto",
    device: str = "auto",
    max_model_len: int | None = None,
    cache_dir: str | None = None,
    weight_dtype: str = "auto",
) -> LoadedModel:
    """Load weights into radixserve's own model; raises ValueError with what to do on failure."""
    torch_device = resolve_device(device)
    if weight_dtype == "bfloat16" and dtype == "auto":
        dtype = "bfloat16"
    storage = resolve_weight_dtype(weight_dtype, model, torch_device, dtype, cache_dir)
    source = open_model(model, cache_dir, float_weights=storage != "gguf")
    path = source.directory
    torch_dtype = resolve_dtype(dtype, torch_device)
    config, family = _load_hf_config(source, cache_dir)
    spec = ModelSpec.from_hf_config(config, family)
    context = spec.max_position_embeddings if max_model_len is None else max_model_len
    if context > spec.max_position_embeddings:
        raise ValueError(
            f"max_model_len {context} exceeds the model's context ({spec.max_position_embeddings} tokens)"
        )
    tensors = _weights_for(storage, source, cache_dir)
    quantized = {name: t for name, t in tensors.items() if isinstance(t, QuantWeight)}
    with torch.device("meta"):
        net = model_class(family)(spec, context)
    net.drop_float_weights({_map_weight_name(name)[0] for name in quantized})
    _allocate(net, torch_dtype, torch_device)
    net.build_rotary(context, torch_device)
    net.load_weights({name: t for name, t in tensors.items() if not isinstance(t, QuantWeight)},
                     "gguf" if storage == "gguf" else "hf")
    net.load_quantized(quantized)
    del tensors, quantized
    return_freed_memory()
    net.eval()
    tokenizer = load_tokenizer(path, family, cache_dir)
    name = DEFAULT_MODEL_NAME if model is None else model if model in PACKAGED_MODELS else path.name
    described = _describe_weights(net, storage, torch_dtype)
    logger.info("weights: %s, %.1f MiB", described, net.weight_bytes() / 2**20)
    stops = family_stop_ids(family, tokenizer) if source.gguf is not None else []
    return LoadedModel(net, spec, tokenizer, _eos_token_ids(path, spec, tokenizer, stops), path, name, context,
                       described, net.weight_bytes())


def _allocate(net: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give a model built on the meta device real, uninitialized storage: floating tensors in
    `dtype`, others as they are. (Module.to_empty would do it through torch's reference
    implementations, which import sympy: ~33 MiB resident for nothing.)"""
    for module in net.modules():
        for name, param in module._parameters.items():
            if param is not None:
                kind = dtype if param.is_floating_point() else param.dtype
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=kind, device=device), requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                kind = dtype if buffer.is_floating_point() else buffer.dtype
                module._buffers[name] = torch.empty(buffer.shape, dtype=kind, device=device)


def _gguf_source(model: str | None, cache_dir: str | None = None) -> Path | None:
    """The GGUF file a model comes from (the default model's packaged file), or None."""
    if model is None:
        try:
            return default_gguf_path()
        except FileNotFoundError:
            return None
    if model in PACKAGED_MODELS:
        return packaged_gguf(model, cache_dir)
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _weights_for(storage: str, source: ModelSource,
                 cache_dir: str | None = None) -> dict[str, torch.Tensor | QuantWeight]:
    """The weights as named in transformers' checkpoints: a GGUF's as the model holds them
    (storage 'gguf'), else a transformers checkpoint's (quantized at load for int8 / int4)."""
    if storage == "gguf":
        return repacked_weights(source.gguf, source.directory)
    tensors = _read_weights(source.directory)
    if storage in ("int8", "int4"):
        bits = 8 if storage == "int8" else 4
        tensors = {name: quantize(t, bits) if _quantizable(name, t) else t for name, t in tensors.items()}
    return _fuse_consistently(tensors)


def _quantizable(name: str, t: torch.Tensor) -> bool:
    return name.endswith(_QUANTIZABLE) and t.dim() == 2 and t.shape[1] % 64 == 0


def _fuse_consistently(tensors: dict[str, torch.Tensor | QuantWeight]) -> dict[str, torch.Tensor | QuantWeight]:
    """Parts fused into one layer (q/k/v, gate/up) are all quantized or all float: where a
    file mixes them (a part of a type that is not repacked), the quantized parts are widened."""
    kinds: dict[str, set[bool]] = {}
    for name, t in tensors.items():
        kinds.setdefault(_map_weight_name(name)[0], set()).add(isinstance(t, QuantWeight))
    mixed = {target for target, seen in kinds.items() if len(seen) > 1}
    return {name: t.dequantize() if isinstance(t, QuantWeight) and _map_weight_name(name)[0] in mixed else t
            for name, t in tensors.items()}


def repacked_weights(gguf: Any, directory: Path) -> dict[str, torch.Tensor | QuantWeight]:
    """The GGUF's weights (`gguf`: its path or its gguf_file.GGUFFile), quantized ones in
    QuantWeight's layout, the rest as the family's model holds them: from REPACKED_FILE in the
    model's converted directory, or repacked from the file once and written there."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from radixserve.model.gguf_file import read_weights

    cached = directory / REPACKED_FILE
    if cached.is_file():
        with safe_open(str(cached), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") == _REPACK_FORMAT:
                # copied out of the file's mapping, which is then released: pages of the mapping that
                # a fused layer read would otherwise stay resident beside the fused copy
                return _unflatten({key: f.get_tensor(key).clone() for key in f.keys()}, json.loads(meta["quantized"]))
    weights = _fuse_consistently(read_weights(gguf, quantized=True))
    flat: dict[str, torch.Tensor] = {}
    layout: dict[str, dict[str, str]] = {}
    for name, t in weights.items():
        if isinstance(t, QuantWeight):
            layout[name] = t.meta()
            flat.update({f"{name}::{part}": tensor for part, tensor in t.tensors().items()})
        else:
            flat[name] = t
    fd, tmp = tempfile.mkstemp(prefix=".repack-", suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        save_file(flat, tmp, metadata={"format": _REPACK_FORMAT, "quantized": json.dumps(layout)})
        os.replace(tmp, cached)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return weights


def _unflatten(flat: dict[str, torch.Tensor], layout: dict[str, dict[str, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {name: t for name, t in flat.items() if "::" not in name}
    for name, meta in layout.items():
        parts = {part: flat[f"{name}::{part}"] for part in ("codes", "scale", "offset") if f"{name}::{part}" in flat}
        out[name] = QuantWeight.from_saved(parts, meta)
    return out


def _describe_weights(net: CausalLM, storage: str, dtype: torch.dtype) -> str:
    from radixserve.model.moe import SparseMoE

    kinds = {m.quant.kind for m in net.quantized_layers().values() if m.quant is not None}
    kinds |= {w.kind for m in net.modules() if isinstance(m, SparseMoE)
              for w in (m.quant_gate_up or []) + (m.quant_down or [])}  # experts (gpt-oss's MXFP4)
    kinds = sorted(kinds)
    if storage == "gguf":
        return "gguf:" + "+".join(dict.fromkeys(k for kind in kinds for k in kind.split("+")))
    return storage if storage in ("int8", "int4") else str(dtype).removeprefix("torch.")


def _load_hf_config(source: ModelSource, cache_dir: str | None = None) -> tuple[Any, ModelFamily]:
    """The model's config and family; a family radixserve does not run is refused from
    config.json's own fields first (or the GGUF's header), naming what it runs."""
    path = source.directory
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path / 'config.json'}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path / 'config.json'} is not a JSON object")
    family = source.family(raw)
    try:
        return load_hf_config(path, cache_dir), family
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"cannot read {path / 'config.json'}: {exc}") from None


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(f for f in path.glob("*.safetensors") if f.name != REPACKED_FILE)
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


def family_stop_ids(family: ModelFamily, tokenizer: Any | None) -> list[int]:
    """The ids of the family's stop tokens (ModelFamily.stop_tokens) that the tokenizer has:
    what a GGUF, whose header names one EOS, stops at beside it."""
    if tokenizer is None:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = None if backend is not None else tokenizer.get_vocab()
    ids = [backend.token_to_id(text) if backend is not None else vocab.get(text) for text in family.stop_tokens]
    return [i for i in ids if i is not None]


def _eos_token_ids(path: Path, spec: ModelSpec, tokenizer: Any | None, family_stops: list[int]) -> list[int]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    sources = [json.loads(gen.read_text()).get("eos_token_id")] if gen.is_file() else []
    sources.append(getattr(spec.hf_config, "eos_token_id", None))
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    sources.append(family_stops)
    for source in sources:
        for token in source if isinstance(source, list) else [source]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids
