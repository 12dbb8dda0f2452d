"""What a validated request body becomes: the engine requests to submit and how to answer."""

from __future__ import annotations

from dataclasses import dataclass, replace

from radixserve.core.agent_hints import AgentHints
from radixserve.sampling_params import SamplingParams
from radixserve.engine.prompt_builder import ChatPrompt
from radixserve.server.request_group import GenerationInput

Prompt = str | list[int] | ChatPrompt


@dataclass(frozen=True)
class GenerationJob:
    """An OpenAI request: every prompt sampled n times. Member m (the engine request and
    the response's choice index) is sample m % n of prompt m // n."""

    model: str
    prompts: list[Prompt]
    params: list[SamplingParams]  # one per sample index; sample i has seed + i when seeded
    n: int
    stream: bool
    include_usage: bool
    echo: bool = False
    logprobs: int | None = None  # alternatives per token (0: the chosen token only); None: off
    cache_salt: str | None = None  # the engine's salt: the tenant's namespace and the client's cache_salt
    session_id: str | None = None  # the agent conversation it continues (a cache hint)
    hints: AgentHints | None = None  # agent hints (core/agent_hints.py)
    return_token_ids: bool = False  # the answer carries prompt_token_ids and token_ids (output/token_ids.py)

    def inputs(self) -> list[GenerationInput]:
        return [
            GenerationInput(prompt, self.params[i], self.cache_salt, self.session_id, self.hints)
            for prompt in self.prompts for i in range(self.n)
        ]


@dataclass(frozen=True)
class NativeJob:
    """A /generate request: each prompt sampled n times with the same params (sample i
    with seed + i when seeded). Member m is sample m % n of prompt m // n."""

    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    batched: bool  # the input was a list of prompts: answer with a list
    cache_salt: str | None
    n: int = 1
    rids: list[str] | None = None  # the client's id of each prompt (SGLang's rid)
    return_logprob: bool = False  # report logprob lists even where empty
    return_text_in_logprobs: bool = False
    session_id: str | None = None  # the agent conversation it continues (a cache hint)
    hints: AgentHints | None = None  # agent hints (core/agent_hints.py)

    @property
    def answers_list(self) -> bool:
        return self.batched or self.n > 1

    def inputs(self) -> list[GenerationInput]:
        samples = [self.params] * self.n
        if self.params.seed is not None:
            samples = [replace(self.params, seed=self.params.seed + i) for i in range(self.n)]
        return [GenerationInput(p, params, self.cache_salt, self.session_id, self.hints) for p in self.prompts for params in samples]
