"""A model directory's config as transformers resolves it, kept in radixserve's cache.

transformers fills in what a config.json leaves out (each family's defaults, Gemma 3's
layer_types and per-layer RoPE parameters), so radixserve reads configs through it. Importing
its config classes also imports torch.distributed and sympy (~70 MiB resident in a serving
process that needs neither), so the resolved config is written once as JSON (`resolved-config.json` in
the directory's entry in the cache, model/derived_files.py: keyed by config.json's bytes,
transformers' version and the directory's path; never written into the model directory) and
later loads read that. Where the cache cannot be written, transformers resolves it every time.
A RoPE variant that only transformers computes asks for its config object
(`ResolvedConfig.transformers_config`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from radixserve.model.derived_files import read_derived, write_derived

RESOLVED_FILE = "resolved-config.json"  # its name in the directory's entry of the cache (model/derived_files.py)
_SUB_CONFIGS = ("text_config", "vision_config", "audio_config")


class ResolvedConfig(SimpleNamespace):
    """A transformers config's attributes, read back from JSON: `getattr` works as on the
    config object; nested sub-configs (an image-text model's text_config) are ResolvedConfigs too."""

    def transformers_config(self) -> Any:
        """The transformers config object itself (imports transformers' config classes)."""
        config = _auto_config(Path(self.__dict__["_path"]))
        sub = self.__dict__.get("_sub")
        return getattr(config, sub) if sub else config

    @classmethod
    def of(cls, values: dict[str, Any], path: Path, sub: str | None = None) -> "ResolvedConfig":
        fields = {k: cls.of(v, path, k) if k in _SUB_CONFIGS and isinstance(v, dict) else v for k, v in values.items()}
        config = cls(**fields)
        config.__dict__["_path"], config.__dict__["_sub"] = str(path), sub
        return config


def load_hf_config(path: Path, cache_dir: str | None = None) -> Any:
    """The directory's resolved config: from the cache when it matches config.json and this
    transformers, else from transformers (and kept in the cache for next time)."""
    source = (path / "config.json").read_bytes()
    key = {"config_sha256": hashlib.sha256(source).hexdigest(), "transformers": _transformers_version()}
    cached = read_derived(path, RESOLVED_FILE, key, cache_dir)
    if isinstance(cached, dict):
        return ResolvedConfig.of(cached, path)
    config = _auto_config(path)
    try:
        values = config.to_dict()
    except (TypeError, ValueError, AttributeError):
        return config
    write_derived(path, RESOLVED_FILE, key, values, cache_dir, sort_keys=True)  # a value JSON cannot hold: not kept
    return config


def _auto_config(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
