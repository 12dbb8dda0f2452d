"""Preparing a request: everything about it that needs no engine state.

Tokenizing a text, checking token ids, checking lengths against the context and the KV pool,
and compiling a constraint's grammar all happen here (a conversation becomes token ids and a
constraint beside it, in prompt_builder.py), on whatever thread asks (the server runs them on
a worker pool, a DSL program on its own thread), so that a huge prompt or schema never stalls
the engine thread.
What comes out, a PreparedRequest, the engine admits in microseconds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.execution.constrained import GrammarFactory, GrammarMatcher
from radixserve.sampling_params import SamplingParams

Prompt = str | list[int]

# Byte-level and metaspace pre-tokenizers keep every character of the text, so no token
# covers more characters of it than the longest vocabulary entry (see max_chars_per_token).
_LOSSLESS_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "Sequence"}
_LOSSLESS_NORMALIZERS = {"Prepend", "Replace", "Sequence"}


@dataclass(eq=False)
class PreparedRequest:
    """A checked request, ready to admit: its token ids, the total length it may reach,
    and its compiled constraint. Admitted at most once (the matcher holds state)."""

    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int
    cache_salt: str | None = None
    grammar: GrammarMatcher | None = None
    session_id: str | None = None  # the agent conversation it continues (a cache hint)
    hints: Any = None  # its AgentHints (core/agent_hints.py), or None
    admitted: bool = field(default=False, repr=False)


class RequestPreparer:
    """Turns prompts into PreparedRequests. Thread-safe and free of engine state: it reads
    only the tokenizer, the context length and the (fixed) size of the KV pool."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        grammars: GrammarFactory,
        model_name: str,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.grammars = grammars
        self.model_name = model_name
        per_token = max_chars_per_token(tokenizer) if tokenizer is not None else None
        # A text longer than this cannot fit in the context: refused without tokenizing it.
        self.max_prompt_chars = per_token * max_model_len if per_token is not None else None

    def prepare(self, prompt: Prompt, params: SamplingParams | None = None, cache_salt: str | None = None) -> PreparedRequest:
        """Raises ValueError (naming the limit) for a request that can never run."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        text, token_ids = self._tokenize(prompt)
        total = self._max_total_tokens(len(token_ids), params)
        grammar = self.grammars.matcher(params)
        return PreparedRequest(text, token_ids, params, total, cache_salt, grammar)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"model {self.model_name} has no tokenizer; pass token ids instead of text")
            self.check_chars(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise _no_room(len(prompt), self.max_model_len)
        vocab = self.vocab_size
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
        return None, list(prompt)

    def check_chars(self, text: str, what: str) -> None:
        """ValueError for a text too long to fit in the context, before it is tokenized."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise ValueError(
                f"{what} has {len(text)} characters, more than the {self.max_prompt_chars} that can fit in "
                f"the model's context of {self.max_model_len} tokens"
            )

    def _max_total_tokens(self, n: int, params: SamplingParams) -> int:
        if n >= self.max_model_len:
            raise _no_room(n, self.max_model_len)
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens"
            )
        capacity = self.num_blocks * self.block_size
        # No max_tokens: generate up to the context, or to what the whole pool can hold.
        total = min(self.max_model_len, capacity) if params.max_tokens is None else n + params.max_tokens
        blocks = -(-max(total, n + 1) // self.block_size)
        if blocks > self.num_blocks:
            raise ValueError(
                f"prompt plus max_tokens needs {blocks} KV blocks of {self.block_size} tokens; "
                f"the pool has {self.num_blocks}. Lower max_tokens or raise num_kv_blocks"
            )
        return total


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of input text one token can stand for, or None when the
    tokenizer may drop or merge characters (then no character bound is sound).

    Sound for fast tokenizers whose normalizer and pre-tokenizer keep every character
    (byte-level BPE, metaspace): each token then covers at most as many characters as its
    vocabulary entry has (an entry's byte-level or metaspace form has one character per
    byte or space, and a character is at least one byte); added tokens match their text.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    if not _keeps_every_char(_spec(backend.normalizer), _LOSSLESS_NORMALIZERS, _normalizer_ok):
        return None
    if not _keeps_every_char(_spec(backend.pre_tokenizer), _LOSSLESS_PRE_TOKENIZERS, _pre_tokenizer_ok):
        return None
    model = backend.model
    if type(model).__name__ != "BPE" or (model.unk_token is not None and model.fuse_unk):
        return None  # a fused unknown token can stand for any number of characters
    lengths = [len(t) for t in tokenizer.get_vocab()]
    return max(lengths) if lengths else None


def _spec(component: Any) -> dict | None:
    """A normalizer's or pre-tokenizer's JSON, as tokenizer.json holds it (serializing only
    it: the whole tokenizer's JSON, vocabulary and merges, takes seconds on a large vocabulary)."""
    return None if component is None else json.loads(component.__getstate__())


def _keeps_every_char(node: dict | None, allowed: set[str], ok: Callable[[dict], bool]) -> bool:
    if node is None:
        return True
    if node.get("type") not in allowed or not ok(node):
        return False
    children = node.get("pretokenizers") or node.get("normalizers") or []
    return all(_keeps_every_char(child, allowed, ok) for child in children)


def _normalizer_ok(node: dict) -> bool:
    if node["type"] == "Replace":  # e.g. " " -> "▁": one character for one
        content = node.get("content", "")
        pattern = (node.get("pattern") or {}).get("String")
        return pattern is not None and len(pattern) == 1 and len(content) == 1
    return True


def _pre_tokenizer_ok(node: dict) -> bool:
    return node["type"] not in ("Split", "Punctuation") or node.get("behavior") != "Removed"


def _no_room(n: int, max_model_len: int) -> ValueError:
    return ValueError(
        f"prompt has {n} tokens; the model's context is {max_model_len} tokens, which leaves no room to generate"
    )
