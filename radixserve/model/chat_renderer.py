"""render_chat: a conversation through a Jinja chat template, as transformers renders it.

transformers' apply_chat_template(tokenize=False) for one conversation: messages normalized
(message objects as dicts, None-valued keys dropped, everything rebuilt from plain JSON
types, reasoning copied under the names templates read), the tokenizer's named special
tokens and the caller's keywords as template variables, and a sandboxed environment with
its filters and globals (tojson without HTML escaping, raise_exception, strftime_now, dict,
a namespace without underscore names, loop controls, `{% generation %}` blocks). Kept here
so that a serving process renders without importing transformers (model/resolved_tokenizer.py);
tests/model/test_resolved_tokenizer.py checks it against transformers on the served templates.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_chat(template: str, messages: list[Any], special_tokens: dict[str, str], tools: list[dict] | None = None,
                documents: list[dict] | None = None, add_generation_prompt: bool = False,
                continue_final_message: bool | str = False, **kwargs: Any) -> str:
    """The prompt text of one conversation (a list of message dicts)."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be JSON schemas (dicts)")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = _alias_reasoning(plain_data(_normalized(messages)))
    final = None
    if continue_final_message:
        chat, final = _tag_final_message(chat, continue_final_message, template)
    rendered = _compiled(template).render(messages=chat, tools=plain_data(tools), documents=plain_data(documents),
                                          add_generation_prompt=add_generation_prompt,
                                          **plain_data({**special_tokens, **kwargs}))
    return _cut_at_tag(rendered, final) if continue_final_message else rendered


def plain_data(value: Any) -> Any:
    """`value` rebuilt from plain JSON types; anything else an inert "<TypeName>" placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)) and not hasattr(value, "shape"):
        return plain_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalized(messages: list[Any]) -> list[dict]:
    out = []
    for message in _as_dicts(getattr(messages, "messages", messages)):
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def _as_dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _as_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_as_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    out = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


def _tag_final_message(chat: list[dict], field: bool | str, template: str) -> tuple[list[dict], str]:
    field = field if isinstance(field, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final] if field in REASONING_FIELDS else [field]
    if not any(f in template for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the chat_template')
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                break
        else:
            raise ValueError("continue_final_message is set but we could not find any text to continue in the final message!")
    else:
        for f in fields:
            chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return chat, final


def _cut_at_tag(rendered: str, final: str) -> str:
    if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template")
    at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: the body as it is (transformers tracks its span
    for assistant masks, which rendering text does not ask for)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """A template namespace that refuses underscore-prefixed names."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"Chat templates cannot store underscore-prefixed attributes on a "
                                                  f"namespace, but got {name!r}. Please rename the attribute.")


class _Dict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env.from_string(template)
