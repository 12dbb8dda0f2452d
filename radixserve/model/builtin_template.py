"""Built-in chat templates: the turn format of each family served, for a model file that
carries no chat template (a base model's GGUF, a checkpoint without tokenizer_config's
template), as llama.cpp falls back to its own. `--chat-template` still overrides it.

The template is chosen by the family (its registry entry's `chat_template`), and within the Llama family (Llama, Mistral, Qwen2,
Qwen3 checkpoints) first by the turn markers the tokenizer has as tokens of their own, then
by the model type. The templates are Jinja files beside this module (chat_templates/,
shipped as package data). The Llama family's and Gemma 3's know no tools: tool calls go
through the fallback rendering (tools/rendering.py) in the hermes format, which `auto` picks
for them. Qwen3-MoE's, Qwen 3.5's, LFM2's and harmony's render tools, calls and reasoning as
the family's published template does, and under them `auto` picks the tool-call format and
reasoning parser the family's registry entry names (`builtin_defaults`).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from radixserve.model.registry import FAMILIES, ModelFamily, family_for_config

TEMPLATES_DIR = Path(__file__).parent / "chat_templates"
BUILTIN_NAMES = ("gemma3", "chatml", "llama3", "mistral", "llama2", "qwen3", "qwen3_5", "lfm2", "harmony")
BUILTIN_MARK = "radixserve's built-in"  # in the first line of each

# a token of the tokenizer's own -> the turn format it marks (first match wins)
TURN_MARKERS = (("<|im_start|>", "chatml"), ("<|start_header_id|>", "llama3"), ("<start_of_turn>", "gemma3"),
                ("[INST]", "mistral"))
# a Llama-family model type -> the turn format, where the tokenizer marks none
LLAMA_MODEL_TYPES = {"qwen2": "chatml", "qwen3": "chatml", "mistral": "mistral"}
LLAMA_DEFAULT = "llama2"


@cache
def builtin_template(name: str) -> str:
    """The text of a built-in template (one of BUILTIN_NAMES)."""
    if name not in BUILTIN_NAMES:
        raise ValueError(f"no built-in chat template {name!r}; there are {', '.join(BUILTIN_NAMES)}")
    return (TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def builtin_name(template: str | None) -> str | None:
    """Which built-in template `template` is (None: not one of them)."""
    for name in BUILTIN_NAMES:
        if template is not None and template == builtin_template(name):
            return name
    return None


def builtin_defaults(template: str | None) -> tuple[str | None, str | None]:
    """(tool-call format, reasoning parser) that the family of built-in `template` names;
    (None, None) for any other template, or a family that names none (then `auto` reads the text)."""
    name = builtin_name(template)
    family = next((f for f in FAMILIES if name is not None and f.chat_template == name), None)
    return (family.tool_call_format, family.reasoning_parser) if family is not None else (None, None)


def choose_builtin(config: dict[str, Any], tokenizer: Any, family: ModelFamily | None = None) -> str | None:
    """The built-in template's name for a model of `config` (config.json's fields) with
    `tokenizer`: the family's own template, else by the tokenizer's turn markers and the model
    type (None: no family of ours; its checkpoint is refused elsewhere). `family`: where the
    caller has looked it up already."""
    if family is None:
        try:
            family = family_for_config(SimpleNamespace(model_type=config.get("model_type"),
                                                       architectures=config.get("architectures")))
        except ValueError:
            return None
    if family.chat_template is not None:
        return family.chat_template
    own_tokens = getattr(tokenizer, "added_tokens_encoder", None) or {}
    for marker, name in TURN_MARKERS:
        if marker in own_tokens:
            return name
    return LLAMA_MODEL_TYPES.get(config.get("model_type"), LLAMA_DEFAULT)


def with_builtin_template(tokenizer: Any, model_dir: Path, family: ModelFamily | None = None) -> Any:
    """`tokenizer`, given its family's built-in chat template where it has none of its own
    (`family`, else the family read from model_dir/config.json)."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None):
        return tokenizer
    name = choose_builtin(_config(model_dir), tokenizer, family)
    if name is not None:
        tokenizer.chat_template = builtin_template(name)
    return tokenizer


def _config(model_dir: Path) -> dict[str, Any]:
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
