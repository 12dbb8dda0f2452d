"""The reasoning parsers by name (--reasoning-parser, vLLM's names) and `auto`: the parser
the chat template in force calls for. A new format is one module and one line here."""

from __future__ import annotations

from typing import Any

from radixserve.reasoning.base import ReasoningParser
from radixserve.reasoning.deepseek_r1 import DeepSeekR1
from radixserve.reasoning.gpt_oss import CHANNEL, GptOss
from radixserve.reasoning.qwen3 import Qwen3
from radixserve.reasoning.think import THINK_END, prompt_opens_think

PARSERS: dict[str, type] = {"deepseek_r1": DeepSeekR1, "qwen3": Qwen3, "gpt_oss": GptOss}
CHOICES = ("none", "auto", *PARSERS)


def parser_named(name: str) -> ReasoningParser | None:
    """The parser of a --reasoning-parser value other than `auto` (None for `none`)."""
    if name == "none":
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(CHOICES)}")
    return PARSERS[name]()


def detect_parser(tokenizer: Any, chat_template: str | None = None) -> ReasoningParser | None:
    """`auto`, from the template in force (`chat_template`, else the tokenizer's own): a
    family's built-in template: the parser its registry entry names; harmony channels:
    gpt_oss; a template that speaks of `</think>`: deepseek_r1 when its generation prompt
    opens the block, qwen3 otherwise; no reasoning markers: None (all is content)."""
    template = chat_template or (getattr(tokenizer, "chat_template", None) if tokenizer is not None else None)
    if not isinstance(template, str):
        return None
    if "radixserve's built-in" in template[:200]:  # a family's built-in template: the parser its entry names
        from radixserve.model.builtin_template import builtin_defaults  # its model is loaded already

        named = builtin_defaults(template)[1]
        if named is not None:
            return parser_named(named)
    if CHANNEL in template and "analysis" in template:
        return GptOss()
    if THINK_END not in template:
        return None
    return DeepSeekR1() if prompt_opens_think(probe(tokenizer, chat_template)) else Qwen3()


def probe(tokenizer: Any, chat_template: str | None = None, **template_kwargs: Any) -> str:
    """The generation prompt of a one-turn conversation, as the template in force renders it."""
    if tokenizer is None:
        return ""
    extra = {"chat_template": chat_template} if chat_template is not None else {}
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                             add_generation_prompt=True, **extra, **template_kwargs)
    except Exception:  # a template that needs more than one plain turn: read nothing from it
        return ""
