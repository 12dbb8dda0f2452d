"""A value the model wrote, as JSON text: as written where it is JSON already (so it renders
back to the same bytes), else a Python literal read with `ast` (never evaluated) and converted,
else the text itself as a JSON string."""

from __future__ import annotations

import ast
import json
from typing import Any

_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def json_value(text: str) -> str:
    """The value as JSON text: as written when it is JSON, else its Python literal converted
    (a value that is neither stays, as a string)."""
    try:
        json.loads(text)
        return text
    except (ValueError, RecursionError):
        pass
    try:
        return json.dumps(_literal(ast.parse(text, mode="eval").body), ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return json.dumps(text, ensure_ascii=False)


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        return {_key(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not a literal")


def _key(node: ast.AST | None) -> str:
    value = _literal(node) if node is not None else None
    if not isinstance(value, str):
        raise ValueError("a dict key that is not a string")
    return value
