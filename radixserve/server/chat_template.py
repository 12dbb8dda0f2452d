"""--chat-template: a Jinja chat template in place of the model's own, given as a file or as
the template itself (as vLLM, SGLang and llama.cpp take it). The text is checked at startup:
a path that does not exist, or a template Jinja cannot compile, stops the server with the
reason rather than failing the first request. `template_in_force` is what the startup line
says of the template chat renders with (a model file without one gets its family's
built-in template: model/builtin_template.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixserve.model.builtin_template import builtin_name

_TEMPLATE_MARKS = ("{{", "{%", "\n")  # what only a template, never a plain path, holds


def load_chat_template(value: str) -> str:
    """The template's text: the file `value` names, or `value` itself when it is a template.
    ValueError (saying which) otherwise."""
    path = Path(value).expanduser()
    if not any(mark in value for mark in _TEMPLATE_MARKS):
        if not path.is_file():
            raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
        text = path.read_text(encoding="utf-8")
        where = f"--chat-template {value}"
    else:
        text, where = value, "--chat-template (inline)"
    check_chat_template(text, where)
    return text


def check_chat_template(text: str, where: str) -> None:
    """ValueError naming `where` when Jinja cannot compile `text` (or it is empty)."""
    if not text.strip():
        raise ValueError(f"{where}: the template is empty")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"{where}: not a valid Jinja template: {exc.message} (line {exc.lineno})") from None


def template_in_force(tokenizer: Any, chat_template: str | None) -> str:
    """Which chat template chat renders with: --chat-template's, the model's own, or the
    built-in one of its family (the model file having none)."""
    if chat_template is not None:
        return "--chat-template"
    own = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not own:
        return "none (chat is refused: give one with --chat-template)"
    name = builtin_name(own)
    if name is not None:
        return f"built-in {name} (the model file has none; --chat-template overrides it)"
    return "the model's own"
