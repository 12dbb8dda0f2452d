"""EngineProtocol: what the server, the cluster and the DSL runtime may use of an engine.

Engine implements it; a test double or another engine that does can stand in for it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from radixserve.config import EngineConfig
    from radixserve.core.agent_hints import AgentHints
    from radixserve.core.block_pool import BlockPool
    from radixserve.engine.inputs import PreparedRequest, Prompt
    from radixserve.engine.kv_import import PendingImport
    from radixserve.engine.prompt_builder import BuiltPrompt, ChatPrompt
    from radixserve.engine.reply_ids import ReplyLookup
    from radixserve.engine.kv_transfer import KVHandoff, KVTransfer, TransferFailed
    from radixserve.engine.stats import EngineStats
    from radixserve.model.loader import LoadedModel
    from radixserve.outputs import RequestOutput
    from radixserve.sampling_params import SamplingParams


class EngineProtocol(Protocol):
    config: EngineConfig
    tokenizer: Any  # a transformers tokenizer, or None for a model without one
    model_name: str
    max_model_len: int
    attention_backend: str
    pool: BlockPool
    loaded: LoadedModel
    kv_transfer: KVTransfer  # prefill/decode handoffs: export, hold, import (engine thread only)

    # ---- any thread ---------------------------------------------------------------

    def prepare(self, prompt: Prompt, params: SamplingParams | None = None, cache_salt: str | None = None,
                session_id: str | None = None, hints: AgentHints | None = None) -> PreparedRequest: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            replies: ReplyLookup | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]: ...

    def build_prompt(self, prompt: ChatPrompt) -> BuiltPrompt: ...  # a conversation with tools -> ids, constraint

    # ---- the engine thread ----------------------------------------------------------

    def admit(self, prepared: PreparedRequest, request_id: str | None = None) -> str: ...

    def admit_handoff(self, prepared: PreparedRequest, handoff: KVHandoff | PendingImport | TransferFailed | None,
                      request_id: str | None = None) -> tuple[str, RequestOutput | None]: ...

    def step(self) -> list[RequestOutput]: ...  # each output's delta set: what the step added

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    def unfinished_request_ids(self) -> list[str]: ...

    def stats(self) -> dict[str, Any]: ...

    def snapshot(self) -> EngineStats: ...

    def check_integrity(self) -> None: ...

    def flush_cache(self, namespace: str | None = None) -> int: ...

    def close_session(self, session_id: str, cache_salt: str | None = None) -> bool: ...

    def pin_prefix(self, prompt: Prompt, ttl_s: float, cache_salt: str | None = None) -> int: ...

    def release_hints(self, cache_salt: str | None = None, session_id: str | None = None,
                      prompt: Prompt | None = None) -> int: ...

    def close(self) -> None: ...
