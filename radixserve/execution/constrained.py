"""Constrained decoding: a request's regex, JSON schema, any-JSON or choice list becomes an
xgrammar matcher that masks the logits of every step and advances with every sampled token.

Grammars are compiled while a request is prepared, off the engine thread; their size is
bounded before compiling (a clear ValueError names the limit) and the compile time after
(the request is refused when compiling takes longer; the compile itself, which xgrammar
cannot interrupt, finishes in the background on a single worker thread). Compiled
grammars are cached up to a byte limit.

Jump-forward: where the grammar forces the text that follows (a tool call's keys, a
schema's punctuation, the rest of a choice), `forced_draft` tokenizes that text as the
tokenizer would and offers it as a draft; the speculative path verifies it in one step with
every row masked by the grammar state after the draft tokens before it (`apply_draft_masks`),
so the tokens appended are exactly those masked decoding would pick, whatever the boundary
tokenization: a draft token the model would not have chosen (a forced `"` where it writes
`"get`) is replaced by the model's own choice at that row.

Preemption by recompute keeps a request's generated tokens, so its matcher state stays in
step with them: nothing is rolled back. xgrammar is imported on the first constrained
request only.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar, GrammarCompiler, GrammarMatcher
else:
    CompiledGrammar = GrammarCompiler = GrammarMatcher = Any


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on a constraint, checked before compiling (sizes) and while compiling (time)."""

    max_regex_chars: int = 4096
    max_schema_chars: int = 65536
    max_structural_tag_chars: int = 1 << 20  # tool calls: up to 128 tools' argument grammars
    max_schema_depth: int = 64
    max_enum_values: int = 2048  # enum and const values and choices, over the whole constraint
    compile_timeout_s: float = 10.0
    cache_limit_bytes: int = 64 << 20


_REGEX_SPECIAL = set("\\.^$*+?{}[]|()")


class GrammarFactory:
    """Compiles constraints against one tokenizer. Thread-safe: any number of threads may
    ask for matchers; compiles run one at a time on the factory's own worker thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], limits: GrammarLimits | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.limits = limits or GrammarLimits()
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """A fresh matcher for the request's constraint, or None when it has none. Raises
        ValueError with the compiler's reason for an invalid regex or schema, or naming
        the limit that a too large (or too slow to compile) constraint passes."""
        kind, spec = _constraint(params)
        if kind is None:
            return None
        if self.tokenizer is None:
            raise ValueError("constrained decoding needs a tokenizer; this model has none")
        check_size(kind, spec, params, self.limits)
        import xgrammar as xgr

        return xgr.GrammarMatcher(self._compile(kind, spec))

    def forced_draft(self, matcher: GrammarMatcher, limit: int) -> list[int]:
        """Up to `limit` tokens of the text the matcher's grammar forces next, as the
        tokenizer encodes it, cut at the first token the grammar refuses; [] when nothing is
        forced. The matcher is left as it was."""
        if limit <= 0 or matcher.is_terminated():
            return []
        text = matcher.find_jump_forward_string()
        if not text:
            return []
        tokens = self.tokenizer.encode(text, add_special_tokens=False)[:limit]
        return grammar_prefix(matcher, tokens)

    def cache_size_bytes(self) -> int:
        """Bytes held by compiled grammars in the cache (bounded by limits.cache_limit_bytes)."""
        return self._compiler.get_cache_size_bytes() if self._compiler is not None else 0

    def _compile(self, kind: str, spec: str) -> CompiledGrammar:
        compiler, pool = self._get_compiler()
        if kind == "regex":
            future = pool.submit(compiler.compile_regex, spec)
        elif kind == "structural_tag":
            future = pool.submit(compiler.compile_structural_tag, spec)
        else:  # compact JSON: unbounded whitespace lets a small model ramble in it
            future = pool.submit(compiler.compile_json_schema, spec, any_whitespace=False)
        timeout = self.limits.compile_timeout_s
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise ValueError(
                f"the {kind.replace('_', ' ')} did not compile within {timeout:g} s (grammar compile time limit); "
                f"simplify it"
            ) from None
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"invalid {kind.replace('_', ' ')}: {_first_line(exc)}") from None

    def _get_compiler(self) -> tuple[GrammarCompiler, concurrent.futures.ThreadPoolExecutor]:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                hf = getattr(self.tokenizer, "as_transformers", lambda: self.tokenizer)()  # xgrammar reads transformers' class
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
                # One compiling thread: a compile never takes more than one core from the engine.
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=self.limits.cache_limit_bytes
                )
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="radixserve-grammar")
            return self._compiler, self._pool


def check_size(kind: str, spec: str, params: SamplingParams, limits: GrammarLimits) -> None:
    """Raise ValueError naming the limit a constraint passes (cheap: no compiling)."""
    if kind == "regex":
        if params.choices is not None and len(params.choices) > limits.max_enum_values:
            raise ValueError(f"choices has {len(params.choices)} entries; the limit is {limits.max_enum_values}")
        if params.choices is not None:  # literal alternatives compile fast: the schema bound
            if len(spec) > limits.max_schema_chars:
                raise ValueError(f"choices have {len(spec)} characters; the limit is {limits.max_schema_chars}")
        elif len(spec) > limits.max_regex_chars:
            raise ValueError(f"regex has {len(spec)} characters; the limit is {limits.max_regex_chars}")
        return
    if kind == "structural_tag":
        if len(spec) > limits.max_structural_tag_chars:
            raise ValueError(f"structural tag has {len(spec)} characters; the limit is {limits.max_structural_tag_chars}")
        return
    if len(spec) > limits.max_schema_chars:
        raise ValueError(f"json schema has {len(spec)} characters; the limit is {limits.max_schema_chars}")
    try:
        schema = json.loads(spec)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"invalid json schema: {_first_line(exc)}") from None
    depth, values = _schema_shape(schema, limits.max_schema_depth)
    if depth > limits.max_schema_depth:
        raise ValueError(f"json schema nests deeper than {limits.max_schema_depth} levels (the limit)")
    if values > limits.max_enum_values:
        raise ValueError(f"json schema has {values} enum/const values; the limit is {limits.max_enum_values}")


def _schema_shape(schema: Any, max_depth: int) -> tuple[int, int]:
    """(nesting depth, number of enum and const values) of a parsed schema; stops
    descending past max_depth (iterative: a deep schema cannot exhaust the stack)."""
    deepest, values = 0, 0
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > max_depth:
            continue
        if isinstance(node, dict):
            enum = node.get("enum")
            values += len(enum) if isinstance(enum, list) else 0
            values += 1 if "const" in node else 0
            stack.extend((child, depth + 1) for child in node.values() if isinstance(child, (dict, list)))
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node if isinstance(child, (dict, list)))
    return deepest, values


def apply_grammar_masks(logits, matchers: list[tuple[int, GrammarMatcher]]) -> None:
    """Mask (to -inf), in place, every token the matcher of row i forbids."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row, matcher in matchers:
        matcher.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=[row for row, _ in matchers])


def grammar_prefix(matcher: GrammarMatcher, tokens: list[int]) -> list[int]:
    """The longest prefix of `tokens` the matcher accepts from its state now; the matcher is
    rolled back to that state."""
    accepted = 0
    for token in tokens:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        accepted += 1
    if accepted:
        matcher.rollback(accepted)
    return tokens[:accepted]


def apply_draft_masks(logits, drafted: list[tuple[int, GrammarMatcher, list[int]]]) -> None:
    """Mask, in place, the len(draft) + 1 verification rows of each constrained draft from
    `start`: row j by the grammar state after draft[:j] (the matcher is advanced through the
    draft, then rolled back). Past a draft token the grammar refuses, rows are not masked:
    verification stops at that token (its masked row cannot choose it)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    indices = []
    for start, matcher, draft in drafted:
        accepted = 0
        for j in range(len(draft) + 1):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, start + j)
            indices.append(start + j)
            if j == len(draft) or not matcher.accept_token(draft[j]):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
    if indices:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=indices)


def choices_regex(choices: list[str]) -> str:
    return "(" + "|".join(_escape(c) for c in choices) + ")"


def _escape(text: str) -> str:
    """Escape the regex metacharacters only (xgrammar warns about escaped spaces and letters)."""
    return "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in text)


def _constraint(params: SamplingParams) -> tuple[str | None, str | None]:
    if params.regex is not None:
        return "regex", params.regex
    if params.choices is not None:
        return "regex", choices_regex(params.choices)
    if params.json_schema is not None:
        schema = params.json_schema
        try:
            return "json_schema", schema if isinstance(schema, str) else json.dumps(schema)
        except RecursionError:
            raise ValueError("json schema nests too deeply") from None
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
