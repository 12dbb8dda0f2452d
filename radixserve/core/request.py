"""Request: one generation's token ids, status, block table and counters (plain Python)."""

from __future__ import annotations

import enum
import time
from typing import Any

from radixserve.core.agent_hints import NO_HINTS, AgentHints
from radixserve.outputs import GrowingText
from radixserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFETCHING = "prefetching"  # waiting, and not schedulable until its tier pages are read in
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One generation request.

    `token_ids` is the prompt followed by the generated tokens. The first
    `num_computed_tokens` of them have their K/V in the blocks of `block_table`
    (block i holds tokens [i*block_size, (i+1)*block_size)). While running, the request
    holds one pool reference per block of its table, and `cache_node` is the radix node
    it has locked (the end of the cached prefix it reuses), or None. `token_ids`, `logprobs`
    and `text` only grow while it runs (a stop cuts the text once, at the finish): each step's
    output is a view of them fixed at its lengths (engine/output.py), never a copy.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_total_tokens: int,
        cache_salt: str | None = None,
        prompt: str | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.max_total_tokens = max_total_tokens
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.block_table: list[int] = []
        self.window_first = 0  # hybrid KV: the first block of block_table counted in WindowPages.users
        self.num_computed_tokens = 0
        self.cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.restored_tokens = 0  # of those, restored from the second KV tier
        self.session_id: str | None = None  # the agent conversation this request continues
        # Most leading tokens a prefix hit may serve; None: no limit.
        self.reuse_limit: int | None = None
        self.hints: AgentHints = NO_HINTS
        self.cache_node: Any = None
        self.grammar: Any = None  # an xgrammar matcher when the request is constrained
        self.block_hashes: list[int] = []  # chained hashes of full blocks, filled lazily
        self.logprobs: list[Any] = []
        # prompt_logprobs[j]: logprob of prompt token j given tokens [0, j) once computed
        self.prompt_logprobs: list[Any] | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None
        )
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text = GrowingText()  # the generated text (engine/output.py extends it a token's piece at a time)
        self.num_preemptions = 0
        self.waited_steps = 0
        self.admitted_once = False
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_text(self) -> str:
        """The generated text as one string (joined when read)."""
        return self.text.value()

    @output_text.setter
    def output_text(self, value: str) -> None:
        self.text.set(value)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def reusable_prefix_len(self) -> int:
        """How many leading tokens may come from the prefix cache: all but the last (its
        logits give the next token), and none from which a prompt logprob is still owed."""
        limit = self.num_tokens - 1
        if self.reuse_limit is not None:
            limit = min(limit, self.reuse_limit)
        if self.prompt_logprobs is not None:
            first = max(self.params.prompt_logprobs_start, 1)
            missing = next((j for j in range(first, self.num_prompt_tokens) if self.prompt_logprobs[j] is None), None)
            if missing is not None:
                limit = min(limit, missing - 1)
        return limit

    @property
    def in_prefill(self) -> bool:
        """True while tokens other than the last are still uncomputed."""
        return self.num_computed_tokens < self.num_tokens - 1

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
