"""A model directory's config as transformers resolves it, kept beside config.json.

transformers fills in what a config.json leaves out (each family's defaults, Gemma 3's
layer_types and per-layer RoPE parameters), so radixserve reads configs through it. Importing
its config classes also imports torch.distributed and sympy (~70 MiB resident in a serving
process that needs neither), so the resolved config is written once as JSON
(`radixserve-config.json`, keyed by config.json's bytes and transformers' version) and
later loads read that. Where the directory cannot be written, transformers resolves it
every time. A RoPE variant that only transformers computes asks for its config object
(`ResolvedConfig.transformers_config`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

RESOLVED_FILE = "radixserve-config.json"
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


def load_hf_config(path: Path) -> Any:
    """The directory's resolved config: from RESOLVED_FILE when it matches config.json and
    this transformers, else from transformers (and the file written for next time)."""
    source = (path / "config.json").read_bytes()
    key = {"config_sha256": hashlib.sha256(source).hexdigest(), "transformers": _transformers_version()}
    cached = _read_resolved(path / RESOLVED_FILE, key)
    if cached is not None:
        return ResolvedConfig.of(cached, path)
    config = _auto_config(path)
    _write_resolved(path / RESOLVED_FILE, key, config)
    return config


def _auto_config(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _read_resolved(file: Path, key: dict[str, str]) -> dict[str, Any] | None:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("config"), dict):
        return None
    return data["config"]


def _write_resolved(file: Path, key: dict[str, str], config: Any) -> None:
    """Written whole or not at all (a temporary file renamed over it)."""
    try:
        text = json.dumps({"key": key, "config": config.to_dict()}, sort_keys=True)
    except (TypeError, ValueError, AttributeError):
        return  # a value JSON cannot hold: resolve it again next time
    try:
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=".radixserve-config-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, file)
    except OSError:
        try:
            os.unlink(tmp)
        except (OSError, UnboundLocalError):
            pass
