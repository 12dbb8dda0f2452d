"""RequestOutput: what a caller sees of a request after a step (cumulative), and OutputDelta:
what that step added, as the engine loop hands it out (never more than the step's tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives (most likely first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class OutputDelta:
    """What one output adds to the request's previous one: the new tokens, their logprobs
    (None when not asked for) and the new text (a running request's text only grows: a
    possible stop string is held back)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    text: str
    first: bool  # the request's first output


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far
    text: str  # generated text so far; while running, a possible partial stop string is held back
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    restored_tokens: int = 0  # of cached_tokens, restored from the second KV tier
    logprobs: list[TokenLogprob] | None = None
    # One entry per prompt token; None before prompt_logprobs_start and at index 0.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_preemptions: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # ttft_s, e2e_s once known
    delta: OutputDelta | None = None  # set by the EngineLoop that hands the output out; None from Engine.step

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)
