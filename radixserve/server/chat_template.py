"""--chat-template: a Jinja chat template in place of the model's own, given as a file or as
the template itself (as vLLM, SGLang and llama.cpp take it). The text is checked at startup:
a path that does not exist, or a template Jinja cannot compile, stops the server with the
reason rather than failing the first request."""

from __future__ import annotations

from pathlib import Path

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
