"""Engine: add requests, step the scheduler and the model, hand back outputs."""

from __future__ import annotations

import functools
import itertools
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from radixserve.attention.kv_pool import KVPool
from radixserve.attention.registry import resolve_backend_name
from radixserve.kernels.key_basis import KEY_BASIS
from radixserve.kernels.openmp_pool import release_thread_pool
from radixserve.kernels.quantized_pages import check_kv_cache_dtype, page_code
from radixserve.core.block_pool import BlockPool
from radixserve.core.window_pages import WindowPages
from radixserve.config import EngineConfig
from radixserve.execution.constrained import GrammarFactory
from radixserve.model.loader import LoadedModel, load_model, resolve_device
from radixserve.outputs import RequestOutput
from radixserve.engine.output import OutputProcessor
from radixserve.engine.stats import CacheStats, EngineStats, HintCounters
from radixserve.engine.cpu_share import CpuShare
from radixserve.engine.inputs import PreparedRequest, Prompt, RequestPreparer
from radixserve.engine.reply_ids import ReplyLookup
from radixserve.engine.chat_output import ChatOutput, chat_output
from radixserve.engine.prompt_builder import BuiltPrompt, ChatPrompt, PromptBuilder
from radixserve.tools.definitions import checked_tools
from radixserve.engine.kv_import import PendingImport
from radixserve.engine.kv_transfer import KVHandoff, KVTransfer, TransferFailed
from radixserve.engine.memory_plan import plan_memory
from radixserve.core.kv_manager import KVUsage
from radixserve.core.agent_hints import AgentHints
from radixserve.core.draft_tree import accepted_path
from radixserve.core.request import Request
from radixserve.execution.recurrent_state import model_state_bytes
from radixserve.execution.runner import ModelRunner
from radixserve.execution.runner_config import RunnerConfig
from radixserve.execution.step_trace import StepTrace
from radixserve.outputs import TokenLogprob
from radixserve.sampling_params import SamplingParams
from radixserve.core.scheduler import Scheduler
from radixserve.core.sessions import SessionTable
from radixserve.kv_tier.tiering import Tiering
from radixserve.core.step_cost import StepCostModel
from radixserve.core.prompt_lookup import PromptLookupDrafter
from radixserve.core.suffix_drafts import SuffixDrafter
from radixserve.core.radix_cache import RadixCache

logger = logging.getLogger(__name__)
_HELD_POLL_S = 0.005  # an idle step waits this long for a held request's tier pages
MAX_SESSION_ID_CHARS = 512  # a client's 256 characters, led by the server's tenant name

THREAD_RULE = (
    "an Engine is used by one thread at a time; another thread is inside it now. "
    "For concurrent use, drive it through radixserve.engine.loop.EngineLoop (or the server, "
    "or radixserve.lang.Runtime)"
)


def _one_thread(method: Callable) -> Callable:
    """Refuse (RuntimeError, before touching anything) a call while another thread is inside
    the engine; the same thread may nest calls (generate -> step)."""

    @functools.wraps(method)
    def guarded(self: "Engine", *args: Any, **kwargs: Any) -> Any:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(THREAD_RULE)
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy.release()

    return guarded


class Engine:
    """Continuous-batching generation over a paged KV pool with a radix prefix cache.

    Offline: `engine.generate(prompts, params)`. Online: `add_request`, then `step()`
    until `has_unfinished_requests()` is False, `abort(request_id)` at any time.
    Every keyword is an EngineConfig field.

    Threads: `prepare` (tokenize, check, compile the constraint) is thread-safe and reads
    no engine state. Everything else is for one thread at a time: a second thread calling
    in while one is inside gets a RuntimeError naming this rule, and nothing changes.
    EngineLoop is the way to share an engine between threads.
    """

    def __init__(self, model: str | None = None, **options: Any):
        self.config = EngineConfig(model=model, **options)
        self.step_trace: StepTrace | None = None
        self.tiering = Tiering()
        self.kv_events = None  # the KV event publisher (kv_events_endpoint)
        self._window_events = None  # a hybrid model's window group, followed for kv_events
        try:
            self._build(self.config)
        except BaseException:  # a refused option or a failed load: what was opened closes
            self._release()
            raise

    def _build(self, cfg: EngineConfig) -> None:
        self.step_trace = StepTrace(cfg.step_trace) if cfg.step_trace else None
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        # a step's team of threads: the cores left over by other processes (fixed off the CPU)
        on_cpu = resolve_device(cfg.device).type == "cpu"
        self.cpu_share = CpuShare(cfg.num_threads if on_cpu else torch.get_num_threads())
        check_kv_cache_dtype(cfg.kv_cache_dtype, resolve_device(cfg.device), cfg.attention_backend)  # before the model loads
        self.loaded: LoadedModel = load_model(cfg.model, cfg.dtype, cfg.device, cfg.max_model_len, cfg.model_cache_dir,
                                              cfg.weight_dtype)
        self.device = resolve_device(cfg.device)
        self.dtype = self.loaded.model.norm.weight.dtype  # the model's dtype (weight_dtype bfloat16 sets it too)
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.name
        self.max_model_len = self.loaded.max_model_len
        self.eos_token_ids = self.loaded.eos_token_ids
        self.attention_backend = resolve_backend_name(cfg.attention_backend, self.device)
        # the KV pool's element: the model's dtype (auto), or quantized pages (int8, fp8_e4m3)
        self.kv_cache_dtype = cfg.kv_cache_dtype if cfg.kv_cache_dtype != "auto" else str(self.dtype).removeprefix("torch.")
        self.hybrid = self._hybrid_kv()
        # a model with recurrent layers keeps snapshots of their states where prefixes end (core/recurrent_snapshots.py)
        snapshot_bytes = model_state_bytes(self.loaded.model, self.dtype) if cfg.enable_prefix_cache else 0
        self.memory_plan = plan_memory(cfg, self.loaded.spec, self.dtype, self.device, self.hybrid, snapshot_bytes)
        num_blocks = self.memory_plan.num_blocks
        window = WindowPages(self.memory_plan.num_window_pages, num_blocks, self.memory_plan.window,
                             cfg.block_size) if self.hybrid else None
        pool = BlockPool(num_blocks, window, self.memory_plan.num_snapshots)
        self.tiering = self._build_tiering() if cfg.enable_prefix_cache else Tiering()
        cache = self._build_cache(pool) if cfg.enable_prefix_cache else None
        sessions = SessionTable(cache, cfg.session_ttl_s, max_hold_s=cfg.hint_max_ttl_s) if cache is not None else None
        self.drafter = _drafter(cfg, cache)
        self.scheduler = Scheduler(cfg, pool, cache, self.drafter, sessions, prefetch=self.tiering)
        self.kv = self.scheduler.kv  # the one door to the pool, the tree and the tier
        if self.kv.snapshots is not None and self.tiering.state_slots is not None:  # snapshots tier with their blocks
            self.kv.snapshots.use_tier(self.tiering.state_slots, write_through=self.tiering.persisted)
        self.tiering.load(self.kv.load_tier, self.kv.load_tier_states)
        if self.kv_events is not None:  # a restarted engine announces the tier it adopted
            self.kv_events.publish(self.kv.take_events())
        runner_config = RunnerConfig.from_engine(cfg, num_blocks=num_blocks, backend=self.attention_backend,
                                                 device=self.device, dtype=self.dtype)
        self.runner = ModelRunner(model=self.loaded.model, spec=self.loaded.spec, config=runner_config,
                                  stop_token_ids=self.eos_token_ids, window=window)
        if self.runner.states is not None and isinstance(self.drafter, SuffixDrafter):
            self.drafter.tree_width = 1  # a recurrent state follows one sequence: drafts stay chains
        if self.runner.states is not None and self.memory_plan.num_snapshots:  # the cache keeps their snapshots
            self.runner.states.max_snapshots = self.memory_plan.num_snapshots
            self.runner.states.block_size = cfg.block_size
            if self.kv.snapshots is not None:  # its layers keep states inside a chunk: no step stops for one
                self.kv.snapshots.inner_saves = self.runner.states.inner_saves
            self.runner.states.tier_store = self.tiering.store  # the tier's state slots (None: no tier)
            self.runner.states.tier_positions.update(self.kv.tier_snapshot_positions())  # those loaded from disk
        self.grammars = GrammarFactory(self.tokenizer, self.loaded.spec.vocab_size, self.eos_token_ids)
        if cfg.jump_forward:  # constrained requests draft the text their grammar forces
            self.drafter.forced = lambda request, k: self.grammars.forced_draft(request.grammar, k)
        self.preparer = RequestPreparer(
            self.tokenizer, self.loaded.spec.vocab_size, self.max_model_len, cfg.block_size, num_blocks,
            self.grammars, self.model_name,
        )
        # chat prompts: the template, tools and the grammar of their calls
        self.prompts = PromptBuilder(self.tokenizer, self.model_name, self.preparer.check_chars)
        self._busy = threading.RLock()
        self._requests: dict[str, Request] = {}
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self._ids = itertools.count()
        self.generated_tokens = 0
        self.timings = {"schedule_s": 0.0, "model_s": 0.0, "postprocess_s": 0.0}
        self.last_step_timings = dict(self.timings)
        self.step_cost = StepCostModel()  # fitted from every step's measured time
        self.hint_stats = HintCounters()
        logger.info("engine: %s; weights %s (%.1f MiB); attention %s, KV %s (%d blocks of %d tokens); prompt "
                    "attention %s, prompt matmuls %s; native decoder %s", self.model_name, self.loaded.weight_dtype,
                    self.loaded.weight_bytes / 2**20, self.attention_backend, self.kv_cache_dtype, num_blocks,
                    cfg.block_size, cfg.prefill_attention_dtype, cfg.prefill_matmul_dtype,
                    "on" if self.loaded.model.native is not None else "off")
        logger.info("cpu: %s", self.cpu_share.describe())
        self.last_step_tokens = (0, 0)  # (decode tokens, prefill tokens) of the last step
        self.kv_transfer = KVTransfer(self)  # prefill/decode handoffs (engine/kv_transfer.py)
        release_thread_pool()  # the loading thread's OpenMP workers: it may not be the one that steps

    # ---- online API -------------------------------------------------------------

    @_one_thread
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
        hints: AgentHints | None = None,
    ) -> str:
        """Queue a request; raises ValueError (and changes nothing) if it can never run.
        `session_id` names the agent conversation it continues (an eviction hint); `hints`
        are its agent hints (core/agent_hints.py)."""
        return self.admit(self.prepare(prompt, params, cache_salt, session_id, hints), request_id)

    def prepare(
        self, prompt: Prompt, params: SamplingParams | None = None, cache_salt: str | None = None,
        session_id: str | None = None, hints: AgentHints | None = None,
    ) -> PreparedRequest:
        """Tokenize and check a request and compile its constraint; thread-safe, touches no
        engine state. Raises ValueError (naming the limit) if the request can never run."""
        if hints is not None and not isinstance(hints, AgentHints):
            raise ValueError(f"hints must be an AgentHints, got {type(hints).__name__}")
        if session_id is not None and (
            not isinstance(session_id, str) or not session_id or len(session_id) > MAX_SESSION_ID_CHARS
        ):
            raise ValueError(f"session_id must be a non-empty string of at most {MAX_SESSION_ID_CHARS} characters")
        prepared = self.preparer.prepare(prompt, params, cache_salt)
        prepared.session_id = session_id
        prepared.hints = hints
        return prepared

    def isolate_drafts(self) -> None:
        """Drafts read only each request's own tokens, never the prefix cache's stored
        sequences: for a server whose API keys share cache namespaces (another key's replies
        would feed them). Called before serving."""
        if isinstance(self.drafter, SuffixDrafter):
            self.drafter.tree = None

    @_one_thread
    def admit(self, prepared: PreparedRequest, request_id: str | None = None) -> str:
        """Queue a prepared request (cheap: no tokenizing, no compiling); returns its id.
        Raises ValueError (and changes nothing) for an id in use or a request admitted before."""
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prepared.admitted:
            raise ValueError("this prepared request was admitted already; prepare it again")
        prepared.admitted = True
        p = prepared
        request = Request(request_id, p.token_ids, p.params, p.max_total_tokens, p.cache_salt, prompt=p.prompt)
        request.grammar = p.grammar
        request.session_id = p.session_id
        if p.hints is not None:
            request.hints = p.hints
            self.hint_stats.admitted(p.hints)
        self._register(request)
        return request_id

    @_one_thread
    def admit_handoff(
        self, prepared: PreparedRequest, handoff: KVHandoff | PendingImport | TransferFailed | None,
        request_id: str | None = None,
    ) -> tuple[str, RequestOutput | None]:
        """Queue a prepared request whose prompt another engine computed (the decode role):
        the handoff's blocks go into this engine's tree (copied here from a KVHandoff; from a
        PendingImport, copied already off this thread: committed), and the request goes on
        from the handoff's first token, which is its first output (returned with the id). A
        TransferFailed, or a handoff that cannot be used, makes it an ordinary request that
        computes its prompt here (counted); None: an ordinary request, not counted."""
        taken = self.kv_transfer.take(handoff, prepared.token_ids, prepared.cache_salt)
        request_id = self.admit(prepared, request_id)
        if taken is None:
            return request_id, None
        request = self._requests[request_id]
        self._append_token(request, taken.first_token, taken.first_logprob)
        output = self._output(request)
        self._after_cache_changes()  # the imported blocks (and a request done at once) are announced now, not a step late
        return request_id, output

    @_one_thread
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample; returns an output for every request
        that got a token or finished in this step."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(self._prefill_token_budget())
        self._after_cache_changes()
        t1 = time.perf_counter()
        if not plan.chunks:
            self.timings["schedule_s"] += t1 - t0
            return []
        plan.snapshot_ops = self.kv.take_snapshot_ops()  # recurrent states: applied before the forward pass
        decode_tokens = sum(c.num_tokens for c in plan.chunks if c.decodes)  # before commit moves them on
        with self.cpu_share.step_team():  # as many threads as the cores other processes leave
            result = self.runner.run(plan)
        t2 = time.perf_counter()
        self.scheduler.commit(plan)
        for request, index, logprob in result.prompt_logprobs:
            self.outputs.set_prompt_logprob(request, index, logprob)
        outputs = []
        for c, token, logprob in zip(result.sampled, result.tokens, result.logprobs):
            self._append_token(c.request, token, logprob)
            outputs.append(self._output(c.request))
        outputs += [self._append_verified(chunk, tokens) for chunk, tokens in result.speculative]
        outputs += [self._finish_prefill_only(c.request) for c in plan.chunks if _prefill_done(c.request)]
        self._after_cache_changes()  # what finished requests moved to the tier
        t3 = time.perf_counter()
        self.last_step_timings = {"schedule_s": t1 - t0, "model_s": t2 - t1, "postprocess_s": t3 - t2}
        self._observe_step(decode_tokens, plan.num_tokens - decode_tokens, (t3 - t0) * 1000.0)
        if decode_tokens == plan.num_tokens:  # decode-only steps teach the drafter what rows cost
            self.drafter.observe_step(sum(1 for c in plan.chunks if c.decodes), decode_tokens, (t3 - t0) * 1000.0)
        for name, value in self.last_step_timings.items():
            self.timings[name] += value
        return outputs

    @_one_thread
    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already finished."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self.scheduler.finish(request, "abort")
        self._forget(request)
        self._after_cache_changes()
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @_one_thread
    def unfinished_request_ids(self) -> list[str]:
        """Ids of the requests queued or running, in admission order."""
        return list(self._requests)

    # ---- offline API ------------------------------------------------------------

    @_one_thread
    def generate(
        self,
        prompts: Prompt | ChatPrompt | Sequence[Prompt | ChatPrompt | list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        *,
        tools: list[Any] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order. A prompt is a text, token ids,
        a conversation (a list of message dicts, through the chat template) or a ChatPrompt.
        `tools` (OpenAI's function tools as dicts), `tool_choice` ("auto", "none", "required"
        or {"type": "function", "function": {"name": ...}}) and `parallel_tool_calls` apply
        to every prompt: a conversation renders them through the template, and every answer
        is constrained (required or a named tool forces a call valid under its schema) and
        read for calls. A conversation's or a prompt with tools' output is a ChatOutput (its
        `content` and `tool_calls`). All prompts are checked before any is queued, so one bad
        prompt raises without starting the others."""
        if isinstance(prompts, (str, ChatPrompt)) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        params_list = _broadcast_params(params, len(prompts))
        spec = checked_tools(tools, tool_choice, parallel_tool_calls) if tools is not None or tool_choice else None
        chats = [self.prompts.chat_prompt(p, spec) for p in prompts]
        return self._generate(prompts, chats, params_list, use_tqdm)

    @_one_thread
    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[Any] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        chat_template: str | None = None,
        tool_call_parser: str = "auto",
        template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[ChatOutput]:
        """Answer a conversation (a list of message dicts: role, content, an assistant's
        tool_calls, a tool result's tool_call_id), or each of a list of them, as chat
        completions do: through the chat template (`chat_template`: another Jinja template
        than the model's own) with `tools` and `tool_choice` as in `generate`; the tool-call
        format is the one the template speaks of (`tool_call_parser` names another, as
        --tool-call-parser does). `template_kwargs`: more arguments for the template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            raise ValueError("chat needs a conversation")
        spec = checked_tools(tools, tool_choice, parallel_tool_calls) if tools is not None or tool_choice else None
        renderer = self.prompts.renderer_for(chat_template, tool_call_parser)
        chats = [self.prompts.chat_prompt(c, spec, renderer, template_kwargs) for c in conversations]
        if any(c is None for c in chats):
            raise ValueError("chat takes conversations: lists of message dicts")
        return self._generate(conversations, chats, _broadcast_params(params, len(chats)), use_tqdm)

    def build_prompt(self, prompt: ChatPrompt) -> BuiltPrompt:
        """A conversation's token ids and the constraint of its tools (engine/prompt_builder.py);
        thread-safe, touches no engine state (the server builds on its prepare workers)."""
        return self.prompts.build(prompt)

    def _generate(
        self, prompts: Sequence[Any], chats: list[ChatPrompt | None], params_list: list[SamplingParams],
        use_tqdm: bool | None,
    ) -> list[RequestOutput]:
        built = [self.build_prompt(c) if c is not None else None for c in chats]
        prepared = [self.prepare(p, sp) if b is None else self.prepare(b.token_ids, b.params(sp))
                    for p, b, sp in zip(prompts, built, params_list)]
        ids = [self.admit(p) for p in prepared]
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(ids), use_tqdm)
        while pending:
            for out in self.step():
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] if b is None else chat_output(done[i], b.tools, b.fmt) for i, b in zip(ids, built)]

    # ---- chat and text ----------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, replies: ReplyLookup | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a conversation through the model's chat template; thread-safe.
        `replies`: the model's own ids for its earlier replies, spliced in (reply_ids.py);
        `template_kwargs`: more arguments for the template (e.g. enable_thinking)."""
        return self.prompts.chat_token_ids(messages, add_generation_prompt, replies, template_kwargs)

    # ---- accounting -------------------------------------------------------------

    @_one_thread
    def stats(self) -> dict[str, Any]:
        """The counters and gauges as one flat dictionary (EngineStats.as_dict())."""
        return self.snapshot().as_dict()

    @_one_thread
    def snapshot(self) -> EngineStats:
        """The counters and gauges, typed."""
        s = self.scheduler.stats
        usage, spec = self.kv.usage(), self.drafter.stats
        return EngineStats(
            prompt_tokens=s.prompt_tokens,
            cached_prompt_tokens=s.cached_prompt_tokens,
            generated_tokens=self.generated_tokens,
            computed_tokens=s.computed_tokens,
            preemptions=s.preemptions,
            deferred_for_sharing=s.deferred_for_sharing,
            steps=s.steps,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            blocks_total=usage.blocks_total,
            blocks_free=usage.blocks_free,
            blocks_cached=usage.blocks_cached,
            blocks_evictable=usage.blocks_evictable,
            evicted_blocks=usage.evicted_blocks,
            cache_nodes=usage.cache_nodes,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_bytes_per_token=self.runner.pool.bytes_per_token,
            weight_dtype=self.loaded.weight_dtype,
            weight_bytes=self.loaded.weight_bytes,
            spec_drafts=spec.drafts,
            spec_draft_tokens=spec.draft_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_acceptance_rate=spec.acceptance_rate,
            spec_pauses=spec.pauses,
            spec_tree_drafts=spec.tree_drafts,
            spec_branched_drafts=spec.branched_drafts,
            spec_branch_hits=spec.branch_hits,
            spec_accepted_length=spec.accepted_length,
            spec_forced_drafts=spec.forced_drafts,
            spec_forced_tokens=spec.forced_tokens,
            spec_forced_accepted=spec.forced_accepted,
            cpu=self.cpu_share.snapshot(),
            cache=self._cache_stats(usage),
            tier=self.tiering.stats(usage.tier_blocks) if self.kv.caching else None,
            transfer=self.kv_transfer.snapshot(),
            hints=self.hint_stats.snapshot(self.kv.sessions),
            **self._window_stats(usage),
            **self._recurrent_stats(usage),
            **self.timings,
        )

    def _recurrent_stats(self, usage: KVUsage) -> dict[str, int]:
        states = self.runner.states
        if states is None:
            return {}
        return dict(recurrent_state_bytes=states.nbytes, recurrent_request_bytes=states.slot_bytes,
                    **usage.recurrent)

    def _window_stats(self, usage: KVUsage) -> dict[str, int]:
        if not usage.window:
            return {}
        return dict(**usage.window, window_page_bytes=self.runner.pool.window_page_bytes)

    # ---- agent-aware cache: sessions, pins, the second tier ------------------------

    @_one_thread
    def close_session(self, session_id: str, cache_salt: str | None = None) -> bool:
        """Release a session's hold on the cache (its context stays cached as an ordinary
        entry); False if no such session is open."""
        sessions = self.kv.sessions
        return sessions is not None and sessions.close(cache_salt, session_id)

    @_one_thread
    def pin_prefix(self, prompt: Prompt, ttl_s: float, cache_salt: str | None = None) -> int:
        """Keep the cached part of this prompt (a shared system prompt and tool list) ahead of
        other entries for ttl_s seconds; returns how many of its tokens are cached and pinned."""
        if not self.kv.caching:
            return 0
        token_ids = self.prepare(prompt, SamplingParams(max_tokens=0), cache_salt).token_ids
        return self.kv.pin(token_ids, cache_salt, ttl_s)

    @_one_thread
    def release_hints(self, cache_salt: str | None = None, session_id: str | None = None,
                      prompt: Prompt | None = None) -> int:
        """Drop now what holds a prefix (agent hints' release): the session's hold, and the
        TTL holds and pins on its context and on `prompt`'s cached path; returns how many."""
        if not self.kv.caching:
            return 0
        token_ids = None
        if prompt is not None:
            token_ids = self.prepare(prompt, SamplingParams(max_tokens=0), cache_salt).token_ids
        return self.kv.release_hints(cache_salt, session_id, token_ids)

    @_one_thread
    def flush_tier(self, timeout_s: float = 30.0) -> bool:
        """Wait until the persisted tier and its index are on disk; False on timeout."""
        return self.tiering.flush(timeout_s)

    @_one_thread
    def close(self) -> None:
        """Write the persisted tier's index a last time, stop its threads and unmap it; close the step trace."""
        self._release()

    def _release(self) -> None:
        self.tiering.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.step_trace is not None:
            self.step_trace.close()

    @_one_thread
    def check_integrity(self) -> None:
        """Raise AssertionError if block accounting is off anywhere (and a recurrent model's
        state snapshots disagree with what the cache says they hold)."""
        self.scheduler.check_integrity()
        if self.runner.states is not None:
            self.runner.states.check_snapshots(self.kv.snapshot_positions(), self.kv.tier_snapshot_positions())

    @_one_thread
    def flush_cache(self, namespace: str | None = None) -> int:
        """Drop every unlocked prefix-cache entry (only those under cache salt `namespace`
        and its sub-salts `namespace/...`, when given); returns the number of blocks freed."""
        freed = self.scheduler.flush_cache(namespace)
        self._after_cache_changes()
        return freed

    # ---- helpers ----------------------------------------------------------------

    def _prefill_token_budget(self) -> int | None:
        """Prefill tokens the next step may take under max_step_ms, or more where a pending
        prompt would otherwise miss ttft_target_ms (None: no target)."""
        target = self.config.max_step_ms
        if not target:
            return None
        decodes, most = self.scheduler.num_decoding(), self.config.max_num_batched_tokens
        budget = self.step_cost.prefill_budget(decodes, target, most)
        ttft_ms = self.config.ttft_target_ms
        if ttft_ms and decodes:
            now = time.monotonic()
            pending = [(math.inf if arrived is None else (arrived - now) * 1000.0 + ttft_ms, left)
                       for arrived, left in self.scheduler.pending_prefills()]
            budget = self.step_cost.deadline_budget(pending, decodes, budget, most)
        return budget

    def _observe_step(self, decode_tokens: int, prefill_tokens: int, step_ms: float) -> None:
        self.last_step_tokens = (decode_tokens, prefill_tokens)
        self.step_cost.observe(decode_tokens, prefill_tokens, step_ms)
        if self.step_trace is not None:
            self.step_trace.record(decode_tokens, prefill_tokens, step_ms)

    def _register(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self.outputs.register(request)
        self.scheduler.add(request)

    def _append_token(self, request: Request, token: int, logprob: TokenLogprob | None) -> None:
        """Append a token (its text, its stop checks); a stop finishes the request."""
        request.token_ids.append(token)
        self.generated_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        if logprob is not None:
            request.logprobs.append(logprob)
        reason, stop = self.outputs.add_token(request, token)
        if reason is not None:
            self.scheduler.finish(request, reason, stop)

    def _output(self, request: Request) -> RequestOutput:
        """The request's output for this step (its delta: every token the step appended);
        a finished request is forgotten after it."""
        output = self.outputs.output(request)
        if request.finished:
            self._forget(request)
        return output

    def _append_verified(self, chunk, tokens: list[int]) -> RequestOutput:
        """Append a verified draft's tokens one by one, with every stop check between them;
        a stop drops the rest. Accepted draft tokens' K/V count as computed only once they are
        appended, and blocks only rejected tokens used go back to the pool. One output for
        all of them."""
        request = chunk.request
        path = accepted_path(chunk.draft, chunk.draft_parents, tokens) if chunk.draft_parents else None
        self.drafter.record(request, len(chunk.draft), len(tokens) - 1, path, chunk.draft_parents)
        for i, token in enumerate(tokens):
            if i:
                self.scheduler.accept_draft_token(request)
            self._append_token(request, token, None)
            if request.finished:
                return self._output(request)
        self.scheduler.release_unverified(request)
        return self._output(request)

    def _finish_prefill_only(self, request: Request) -> RequestOutput:
        """A max_tokens=0 request whose prompt is computed: it finishes without a token, its
        blocks going to the prefix cache like any finished request's."""
        self.scheduler.finish(request, "length")
        if request.hints.warmup:
            self.hint_stats.warmed(request.num_prompt_tokens - request.cached_tokens)
        return self._output(request)

    def _forget(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)
        self.outputs.forget(request.request_id)
        self.drafter.forget(request.request_id)

    def _build_tiering(self) -> Tiering:
        spec, cfg = self.loaded.spec, self.config
        full_layers = spec.num_layers - self._window_layers() if self.hybrid else spec.num_layers
        block_shape, storage = KVPool.geometry(full_layers, cfg.block_size, spec.num_kv_heads, spec.head_dim,
                                               self.dtype, cfg.kv_cache_dtype)
        if self.hybrid:  # a slot holds a block's full layers; window pages get slots of their own
            page_shape, _ = KVPool.geometry(self._window_layers(), cfg.block_size, spec.num_kv_heads, spec.head_dim,
                                            self.dtype, cfg.kv_cache_dtype)
            ratio = self.memory_plan.window_ratio
        layout = {"layers": spec.num_layers, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                  "block_size": cfg.block_size, "kv_layout": "layer,kv,block,token,head,dim",
                  "kv_cache_dtype": self.kv_cache_dtype}
        code = page_code(cfg.kv_cache_dtype)
        if code:
            layout.update(kv_layout="layer,kv,block,page", kv_scheme=code.scheme, kv_key_basis=KEY_BASIS)
        state_bytes = model_state_bytes(self.loaded.model, self.dtype)  # recurrent layers: their snapshots' slots
        if self.hybrid:
            layout["layer_windows"] = list(spec.layer_windows)  # which layers a slot holds (persistence)
            return Tiering.build(cfg, self.loaded.model, block_shape, storage, layout, page_shape, ratio,
                                 state_bytes=state_bytes)
        return Tiering.build(cfg, self.loaded.model, block_shape, storage, layout, state_bytes=state_bytes)

    def _after_cache_changes(self) -> None:
        """Run the tier copies decided since the last call (the scheduler's, finishing
        requests') before anything reuses the blocks they read; hand the cache's block events
        to the publisher (a queue put: encoding and sending happen on its thread)."""
        if not self.kv.caching:
            return
        if self.runner.states is not None:  # recurrent snapshots' operations, their tier copies before the tier's events
            self.runner.states.apply(self.kv.take_snapshot_ops())
        if self.tiering.store is not None:
            self.tiering.execute(self.runner.pool, self.kv.take_copies(), self.kv.take_tier_events())
        if self.kv_events is not None:
            followers = () if self._window_events is None else (self._window_events,)
            self.kv_events.publish(self.kv.take_events(*followers))

    def _cache_stats(self, usage: KVUsage) -> CacheStats | None:
        if not self.kv.caching:
            return None
        sessions = self.kv.sessions
        return CacheStats(
            restored_prompt_tokens=self.scheduler.stats.restored_prompt_tokens,
            tier_hits=usage.tier_hits,
            restored_blocks=usage.restored_blocks,
            evictions=usage.evictions,
            sessions_open=sessions.num_open if sessions is not None else 0,
            pool_cached_bytes=usage.blocks_cached * self.runner.pool.block_bytes,
            pins=sessions.num_pins if sessions is not None else 0,
        )

    def _build_cache(self, pool: BlockPool) -> RadixCache:
        persisted, cfg = self.tiering.persisted, self.config
        events = None
        if cfg.kv_events_endpoint:
            from radixserve.core.kv_events import KVEventLog
            from radixserve.engine.kv_events import KVEventPublisher, WindowGroupEvents, media_names

            window = self.memory_plan.window if self.hybrid else None  # hybrid KV: the window group's
            self.kv_events = KVEventPublisher(
                cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, block_size=cfg.block_size,
                media=media_names(bool(cfg.kv_offload_dir or cfg.kv_persist_dir)),
                hash_scheme=cfg.kv_events_hash, wire_format=cfg.kv_events_format,
                window=window,
            )
            if window is not None and cfg.kv_events_format == "map":  # the window group (1) by difference
                self._window_events = WindowGroupEvents(cfg.block_size)
            events = KVEventLog()
            events.cleared()  # a (re)started engine holds nothing, whatever a subscriber knew of it
        return RadixCache(pool, cfg.block_size, self.tiering.slots, write_through=persisted,
                          record_entries=persisted, events=events, window_tier=self.tiering.window_slots)

    def _hybrid_kv(self) -> bool:
        """Whether window layers keep their KV apart (core/window_pages.py): a model with
        window layers and hybrid_kv auto. The second tier and its persistence keep hybrid KV
        (a block's full layers and, where it has one, its window page)."""
        spec, cfg = self.loaded.spec, self.config
        if not spec.windowed or cfg.hybrid_kv == "off" or max(spec.layer_windows) >= self.max_model_len:
            return False  # (a window as long as the context keeps everything anyway)
        return True

    def _window_layers(self) -> int:
        return sum(1 for w in self.loaded.spec.layer_windows if w)

    # ---- the engine's KV, for inspection (tests, debugging): its own code goes through self.kv ----

    @property
    def pool(self) -> BlockPool:
        return self.kv.pool

    @property
    def cache(self) -> RadixCache | None:
        """The prefix cache's tree (None: caching is off)."""
        return self.kv.cache if self.kv.caching else None


def _drafter(cfg: EngineConfig, cache: RadixCache | None) -> PromptLookupDrafter:
    """The speculative drafter: prompt lookup, or suffix drafting over the prefix cache too."""
    args = (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.speculative == "suffix":
        drafter = SuffixDrafter(*args, default_on=True, cache=cache, tree_width=cfg.speculative_tree_width)
    else:
        drafter = PromptLookupDrafter(*args, default_on=cfg.speculative == "prompt-lookup")
    drafter.adaptive = cfg.speculative_adaptive
    return drafter


def _prefill_done(request: Request) -> bool:
    return request.params.prefill_only and not request.finished and request.num_computed_tokens == request.num_tokens


def _broadcast_params(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params


def _progress_bar(total: int, use_tqdm: bool | None):
    if use_tqdm is None:
        use_tqdm = total > 1 and sys.stderr.isatty()
    if not use_tqdm:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
