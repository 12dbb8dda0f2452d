"""ReasoningMode: how one request's answer reasons. It makes the splitter of each answer,
counts the reasoning tokens, and puts the reasoning block ahead of a constrained answer:
a JSON schema, a regex or forced tool calls apply only once the block has ended."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from radixserve.execution.constrained import choices_regex
from radixserve.sampling_params import SamplingParams
from radixserve.reasoning.base import ReasoningParser, Span, Splitter
from radixserve.reasoning.tokens import Decode, reasoning_tokens


@dataclass(frozen=True)
class ReasoningMode:
    parser: ReasoningParser
    opened: bool  # the rendered prompt ends inside an open block
    budget: int | None = None  # at most this many tokens of reasoning text, then the end marker is forced
    decode: Decode | None = field(default=None, compare=False)  # token ids -> the answer's text

    def splitter(self) -> Splitter:
        return self.parser.splitter(self.opened)

    def count_tokens(self, spans: list[Span], token_ids: list[int]) -> int:
        """The generated tokens the reasoning blocks took."""
        if not spans:
            return 0
        if self.decode is None:
            return len(token_ids) if spans[-1].end is None else 0
        return reasoning_tokens(spans, token_ids, self.decode)

    @property
    def skip_special_tokens(self) -> bool:
        return not self.parser.keeps_special_tokens

    def apply(self, params: SamplingParams) -> SamplingParams:
        """The request's params with the reasoning block ahead of its constraint (and its
        special tokens kept in the text where the markers are special tokens)."""
        constraint = {name: getattr(params, name) for name in CONSTRAINTS if getattr(params, name) not in (None, False)}
        cleared = {name: (False if name == "json_object" else None) for name in CONSTRAINTS}
        skip = params.skip_special_tokens and self.skip_special_tokens
        if not constraint and self.budget is None:
            return replace(params, skip_special_tokens=skip)
        return replace(params, **{**cleared, **self.constrain(constraint)}, skip_special_tokens=skip)

    def constrain(self, constraint: dict[str, Any]) -> dict[str, Any]:
        """SamplingParams constraint fields for the answer behind the reasoning block: one
        structural tag, the block then the answer's own constraint (free text without one)."""
        answer = _answer_format(constraint)
        if answer is None and self.budget is None:
            return {}
        prefix = self.parser.grammar_prefix(self.opened, self.budget)
        body = {"type": "sequence", "elements": [prefix, answer or {"type": "any_text"}]}
        return {"structural_tag": {"type": "structural_tag", "format": body}}


def _compact_json(schema: str) -> dict[str, Any]:
    """The schema as a grammar of compact JSON, as the server constrains JSON elsewhere (free
    whitespace lets a small model ramble in it). ValueError for a schema xgrammar refuses."""
    import xgrammar as xgr

    try:
        return {"type": "grammar", "grammar": str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))}
    except (RuntimeError, ValueError, TypeError) as exc:
        lines = str(exc).strip().splitlines()
        raise ValueError(f"invalid json schema: {lines[0] if lines else type(exc).__name__}") from None
    except RecursionError:
        raise ValueError("json schema nests too deeply") from None


CONSTRAINTS = ("regex", "json_schema", "json_object", "choices", "structural_tag")  # SamplingParams' own


def _answer_format(constraint: dict[str, Any]) -> dict[str, Any] | None:
    """The structural-tag format of a SamplingParams constraint (None: unconstrained)."""
    if not constraint:
        return None
    if "structural_tag" in constraint:
        tag = constraint["structural_tag"]
        return (json.loads(tag) if isinstance(tag, str) else tag)["format"]
    if "json_schema" in constraint:
        schema = constraint["json_schema"]
        return _compact_json(schema if isinstance(schema, str) else json.dumps(schema))
    if constraint.get("json_object"):
        return _compact_json('{"type": "object"}')
    if "regex" in constraint:
        return {"type": "regex", "pattern": constraint["regex"]}
    if "choices" in constraint:
        return {"type": "regex", "pattern": choices_regex(constraint["choices"])}
    raise ValueError(f"unknown constraint {sorted(constraint)}")
