"""Constrained decoding: a request's regex, JSON schema, any-JSON or choice list becomes an
xgrammar matcher that masks the logits of every step and advances with every sampled token.

Preemption by recompute keeps a request's generated tokens, so its matcher state stays in
step with them: nothing is rolled back. xgrammar is imported on the first constrained
request only.
"""

from __future__ import annotations

import json
import re
from typing import Any

from radixserve.sampling_params import SamplingParams


class GrammarFactory:
    """Compiles constraints against one tokenizer; compiled grammars are cached by xgrammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._compiler = None

    def matcher(self, params: SamplingParams) -> Any | None:
        """A fresh matcher for the request's constraint, or None when it has none.
        Raises ValueError with the compiler's reason for an invalid regex or schema."""
        kind, spec = _constraint(params)
        if kind is None:
            return None
        if self.tokenizer is None:
            raise ValueError("constrained decoding needs a tokenizer; this model has none")
        import xgrammar as xgr

        compiler = self._get_compiler(xgr)
        try:
            if kind == "regex":
                grammar = compiler.compile_regex(spec)
            elif kind == "structural_tag":
                grammar = compiler.compile_structural_tag(spec)
            else:  # compact JSON: unbounded whitespace lets a small model ramble in it
                grammar = compiler.compile_json_schema(spec, any_whitespace=False)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"invalid {kind.replace('_', ' ')}: {_first_line(exc)}") from None
        return xgr.GrammarMatcher(grammar)

    def _get_compiler(self, xgr):
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler


def apply_grammar_masks(logits, matchers: list[tuple[int, Any]]) -> None:
    """Mask (to -inf), in place, every token the matcher of row i forbids."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row, matcher in matchers:
        matcher.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=[row for row, _ in matchers])


def choices_regex(choices: list[str]) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def _constraint(params: SamplingParams) -> tuple[str | None, str | None]:
    if params.regex is not None:
        return "regex", params.regex
    if params.choices is not None:
        return "regex", choices_regex(params.choices)
    if params.json_schema is not None:
        schema = params.json_schema
        return "json_schema", schema if isinstance(schema, str) else json.dumps(schema)
    if params.structural_tag is not None:
        tag = params.structural_tag
        return "structural_tag", tag if isinstance(tag, str) else json.dumps(tag)
    if params.json_object:
        return "json_object", '{"type": "object"}'
    return None, None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        # xgrammar prefixes its messages with "[time] path:line: "
        line = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", line.strip())
        if line:
            return line
    return text or type(exc).__name__
