"""A model directory's tokenizer.

A directory with tokenizer.json loads it through transformers' generic fast-tokenizer class
(the file says everything: its model, pre-tokenizer, post-processor with BOS, decoder and
special tokens; tokenizer_config.json adds the chat template and the special tokens' roles).
AutoTokenizer would pick a family's class by name instead, which costs resident memory the
file itself does not need: GemmaTokenizer rebuilds its 262k vocabulary and merges in Python
(~250 MiB more), and resolving any class by name imports transformers' model configs
(torch.distributed and sympy with them). Importing even the generic class costs ~18 MiB, so
what it builds is kept in radixserve's cache and served without transformers after the first
load (model/resolved_tokenizer.py). A directory without tokenizer.json (only a sentencepiece
model) goes through AutoTokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixserve.model.builtin_template import with_builtin_template
from radixserve.model.registry import ModelFamily
from radixserve.model.resolved_tokenizer import load_resolved

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: str | Path, family: ModelFamily | None = None, cache_dir: str | None = None) -> Any | None:
    """The directory's tokenizer, or None where it has no tokenizer files. A tokenizer without
    a chat template gets its family's built-in one (model/builtin_template.py; `family`: where
    the caller has looked it up). `cache_dir`: radixserve's cache (config.cache_root)."""
    path = Path(path)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    return with_builtin_template(_load(path, cache_dir), path, family)


def _load(path: Path, cache_dir: str | None) -> Any:
    if (path / "tokenizer.json").is_file():
        return load_resolved(path, cache_dir)  # transformers' generic class, resolved once (model/resolved_tokenizer.py)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
