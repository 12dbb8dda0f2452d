"""The speculative prefill of agent hints: after a reply finishes, the prompt its next turn
will most likely start with is prefilled at the lowest priority, so that turn starts warm.

A conversation's warm-up is the conversation, the reply as an assistant turn, and the next
assistant header, through the chat template (its reply ids spliced as the next turn's
would be); a text or token prompt's is its prompt ids and the reply's ids. It is a
prefill-only request (max_tokens 0) in the same namespace and session, holding what it
computed for the original request's ttl_s if it gave one.
"""

from __future__ import annotations

from radixserve.core.agent_hints import WARMUP_PRIORITY, AgentHints
from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams
from radixserve.engine.prompt_builder import ChatPrompt
from radixserve.server.request_group import GenerationInput


def warmup_input(item: GenerationInput, output: RequestOutput) -> GenerationInput | None:
    """The warm-up request after `output` (a finished member of `item`); None when the
    request did not ask for one or did not finish normally."""
    hints = item.hints
    if hints is None or not hints.speculative_prefill or output.finish_reason in (None, "abort"):
        return None
    if isinstance(item.prompt, ChatPrompt) and item.prompt.token_ids is None:
        prompt: str | list[int] | ChatPrompt = item.prompt.with_reply(output.text)
    else:
        prompt = list(output.prompt_token_ids) + list(output.token_ids)
    warm = AgentHints(priority=WARMUP_PRIORITY, ttl_s=hints.ttl_s, warmup=True)
    return GenerationInput(prompt, SamplingParams(max_tokens=0), item.cache_salt, item.session_id, warm)
