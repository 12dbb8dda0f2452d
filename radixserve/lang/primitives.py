"""What a program writes: `gen`, `select`, and the chat roles `system` / `user` / `assistant`.

    s += rl.system("You sort support tickets.")
    s += rl.user(ticket)
    s += rl.assistant(rl.select("team", choices=["billing", "tech", "sales"]))
    s += "Reason: " + rl.gen("why", max_tokens=32, stop="\\n")
"""

from __future__ import annotations

from typing import Any

from radixserve.lang.expr import CHOICES_METHODS, Expr, Gen, Role, RoleBegin, RoleEnd, Select, Text, Tools, as_expr
from radixserve.sampling_params import SamplingParams
from radixserve.tools.definitions import checked_tools


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool | None = None,
    regex: str | None = None,
    json_schema: dict | str | Any | None = None,
    choices: list[str] | None = None,
    tool_choice: str | dict | None = None,
    parallel_tool_calls: bool | None = None,
) -> Gen:
    """Generate text at the end of the state and store it as variable `name`.

    Options left out come from the program run's defaults (`fn.run(temperature=0)`), else
    max_tokens is 128 and the rest are SamplingParams' defaults. `regex`, `json_schema` (a dict, a JSON string or a
    pydantic model class) and `choices` constrain the output token by token: it always
    matches (unless max_tokens cuts it). Bad values raise ValueError here.

    `tool_choice` ("auto", "required", "none" or {"type": "function", "function": {"name":
    ...}}) makes the gen call the tools `rl.tools(...)` declared: required or a named tool
    forces a call valid under its schema (`parallel_tool_calls=False`: exactly one), auto
    lets the model choose. The text is the variable, as ever; `state.tool_calls(name)` has
    the calls read out of it (name, arguments as JSON).
    """
    calls = None if tool_choice is None else {"tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls}
    if tool_choice is not None and tool_choice not in ("none", "auto", "required") and not isinstance(tool_choice, dict):
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a dict naming a function, got {tool_choice!r}")
    if tool_choice is None and parallel_tool_calls is not None:
        raise ValueError("parallel_tool_calls needs tool_choice")
    given = {k: v for k, v in locals().items() if k not in ("name", "tool_choice", "parallel_tool_calls", "calls")
             and v is not None}
    if "json_schema" in given:
        given["json_schema"] = _schema_of(given["json_schema"])
    if "choices" in given:
        given["choices"] = list(given["choices"])
    SamplingParams(**given)  # validates now rather than when the program runs
    if calls is not None and any(k in given for k in ("regex", "json_schema", "choices")):
        raise ValueError("a gen that calls tools takes no regex, json_schema or choices: the calls are its constraint")
    return Gen(_check_name(name), given, calls)


def tools(definitions: list[dict[str, Any]]) -> Tools:
    """Declare the conversation's tools (OpenAI's function tools: {"type": "function",
    "function": {"name", "description", "parameters"}}), before its first message. A chat
    template that knows tools renders them as it does; with one that does not (the default
    model's), the system message carries them, as the server's chat completions write them.
    A gen with `tool_choice` then calls them."""
    return Tools(checked_tools(definitions, compile=False).tools)


def select(name: str | None = None, choices: list[str] | None = None, choices_method: str = "total") -> Select:
    """Append the choice the model finds most likely after the text so far; store it as `name`.

    Every choice is scored by the sum of its tokens' log-probabilities given the prefix,
    all choices in one batched pass that shares the prefix's KV blocks.
    `choices_method="token_length_normalized"` decides by the mean per token instead.
    The scores are in `state.scores(name)`.
    """
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError("select needs a non-empty list of choices")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"choices must be non-empty strings, got {choices!r}")
    if choices_method not in CHOICES_METHODS:
        raise ValueError(f"choices_method must be one of {', '.join(CHOICES_METHODS)}, got {choices_method!r}")
    return Select(_check_name(name), tuple(choices), choices_method)


def system(content: Any = "") -> Role:
    """A system message through the model's chat template."""
    return Role("system", _content(content))


def user(content: Any = "") -> Role:
    """A user message through the model's chat template."""
    return Role("user", _content(content))


def assistant(content: Any = "") -> Role:
    """An assistant message; a gen or select inside generates into the open assistant turn."""
    return Role("assistant", _content(content))


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    """Open an assistant turn (generation prompt); close it with `assistant_end()`."""
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


# ---- helpers ---------------------------------------------------------------------------


def _content(content: Any) -> Expr:
    return Text(content) if isinstance(content, str) else as_expr(content)


def _check_name(name: str | None) -> str | None:
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"a variable name must be a non-empty string, got {name!r}")
    return name


def _schema_of(schema: Any) -> dict | str:
    if isinstance(schema, (dict, str)):
        return schema
    if hasattr(schema, "model_json_schema"):  # a pydantic model class
        return schema.model_json_schema()
    raise ValueError(f"json_schema must be a dict, a JSON string or a pydantic model, got {schema!r}")
