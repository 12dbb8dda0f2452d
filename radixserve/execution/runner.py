"""ModelRunner: StepPlan -> tensors -> logits -> next tokens. The only place, besides the
model and the attention backends, that touches tensors."""

from __future__ import annotations

import array
from dataclasses import dataclass, field, replace
from itertools import chain

import torch

from radixserve.attention.backend import GroupPlans
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.registry import get_backend_class
from radixserve.model.causal_lm import CausalLM
from radixserve.model.spec import ModelSpec
from radixserve.model.native_decoder import NativeDecoder
from radixserve.kernels.native_ops import max_rows
from radixserve.outputs import TokenLogprob
from radixserve.execution.recurrent_state import RecurrentStatePool
from radixserve.execution.runner_config import RunnerConfig
from radixserve.execution.sampler import Sampler, SamplingRow
from radixserve.core.request import Request
from radixserve.core.draft_tree import accepted_path, ancestor_masks, depths, moves
from radixserve.core.plan import ScheduledChunk, StepPlan
from radixserve.core.window_pages import WindowPages

ROWS_ATTENTION_WORK = 32 * 1024  # query rows x context, summed over a step's prefill chunks


@dataclass
class PackedBatch:
    """One step's chunks as model inputs: flat token ids and positions, attention metadata,
    the logits rows to keep (sampling chunks' last tokens, then every drafted row), and
    which chunks sample, which verify a draft, and where each chunk begins in the batch."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling: list[ScheduledChunk]
    drafted: list[ScheduledChunk]
    chunk_starts: list[int]
    window_meta: AttentionMetadata | None = None  # hybrid KV: the window layers' pages


@dataclass
class StepResult:
    sampled: list[ScheduledChunk]  # chunks that reached their request's last token
    tokens: list[int]  # the next token of each, in the same order
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[tuple[Request, int, TokenLogprob]]  # (request, prompt index, logprob)
    # chunks with a draft, and the tokens each appends: its accepted draft tokens, then the
    # token sampled after them (the correction of the first rejected one, or a bonus token)
    speculative: list[tuple[ScheduledChunk, list[int]]] = field(default_factory=list)


class ModelRunner:
    """Built from a RunnerConfig (execution/runner_config.py); `window` holds the window layers'
    pages where the engine keeps hybrid KV (core/window_pages.py), else None."""

    def __init__(
        self,
        *,
        model: CausalLM,
        spec: ModelSpec,
        config: RunnerConfig,
        stop_token_ids: list[int],
        window: WindowPages | None = None,
    ):
        self.model = model
        self.spec = spec
        self.config = config
        self.block_size = config.block_size
        self.device = config.device
        self.window = window  # hybrid KV: window layers read pages of their own
        self.pool = self._kv_pool(config, spec, window)
        self.states = RecurrentStatePool.for_model(model, config.dtype, config.device)  # recurrent layers' states
        self.backend = get_backend_class(config.backend)(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.attention_scale, config.dtype, self.pool.pages
        )
        self.backend.configure(config.attention)
        self.sampler = Sampler(config.seed, config.device)
        self.eos_token_ids = stop_token_ids
        # over a hybrid pool, the window layers read their pages through the step's window plan
        native = config.native_decoder and self.backend.hosts_native_decoder
        model.native = (NativeDecoder.for_model(spec, model.layers, list(spec.layer_windows), model.native_head(),
                                                model.native_embedding()) if native else None)
        model.use_onednn_linear(config.onednn_linear)
        model.use_bf16_matmuls(config.prefill_matmul_dtype == "bfloat16")
        model.use_integer_prompt_matmuls(config.quantized_prompt_matmul == "integer")
        # Steps of at most this many tokens lay every token out as its own attention row
        # (see _as_single_query_rows); 0: never.
        self.row_limit = max_rows() if model.native is not None else 0

    @staticmethod
    def _kv_pool(config: RunnerConfig, spec: ModelSpec, window: WindowPages | None) -> KVPool:
        window_layers = tuple(i for i, w in enumerate(spec.layer_windows) if w) if window is not None else ()
        return KVPool(spec.num_layers, config.num_blocks, config.block_size, spec.num_kv_heads, spec.head_dim,
                      config.dtype, config.device, config.kv_cache_dtype, window_layers,
                      window.num_pages if window is not None else 0, prefault=config.prefault_kv_pool)

    def run(self, plan: StepPlan) -> StepResult:
        """Run one forward pass over the plan's chunks: sample the next token of every chunk
        that reaches its request's last token, and score prompt tokens where asked."""
        chunks = sorted(plan.chunks, key=_batch_order)
        batch = self._prepare(chunks)
        sampling, drafted = batch.sampling, batch.drafted
        prompt_rows = _prompt_logprob_rows(chunks, batch.chunk_starts)
        logits_indices = batch.logits_indices
        if prompt_rows:
            extra = [row for _, row, _, _ in prompt_rows]
            logits_indices = torch.cat([logits_indices, self._tensor(extra, torch.int64)])
        attention = self.backend.prepare(batch.meta)  # once per step, read by every layer
        self._begin_recurrent(chunks, batch, plan.snapshot_ops)
        if batch.window_meta is not None:
            attention = GroupPlans(attention, self.backend.prepare(batch.window_meta))
        logits = self.model(batch.input_ids, batch.positions, self.backend, self.pool, attention, logits_indices,
                            batch.meta.num_decodes)
        result = StepResult(sampling, [], [], [])
        if sampling:
            rows = [self._sampling_row(c) for c in sampling]
            result.tokens, result.logprobs = self.sampler(logits[: len(sampling)], rows)
        verified = len(sampling) + sum(c.num_tokens for c in drafted)
        if drafted:
            rows = [self._sampling_row(c) for c in drafted]
            drafts = [c.draft for c in drafted]
            parents = [c.draft_parents for c in drafted]
            accepted = self.sampler.verify(logits[len(sampling):verified], rows, drafts, parents)
            result.speculative = list(zip(drafted, accepted))
            self._settle_recurrent(result.speculative)
            self._move_accepted(result.speculative)
        if prompt_rows:
            result.prompt_logprobs = _score_prompt_tokens(logits[verified:], prompt_rows)
        return result

    def _begin_recurrent(self, chunks: list[ScheduledChunk], batch: PackedBatch, ops: list) -> None:
        """A model with recurrent layers reads its requests' states through the step's
        RecurrentStep (execution/recurrent_state.py), after the cache's snapshot operations
        (saves of where requests stood, restores of where admitted ones resume)."""
        if self.states is not None:
            self.states.apply(ops)
            self.model.recurrent_step = self.states.begin_step(chunks, batch.chunk_starts)

    def _settle_recurrent(self, verified: list[tuple[ScheduledChunk, list[int]]]) -> None:
        """Verified drafts: recurrent states keep only the accepted tokens."""
        if self.states is not None:
            self.states.settle(verified)

    def _move_accepted(self, verified: list[tuple[ScheduledChunk, list[int]]]) -> None:
        """A draft tree's accepted path: its K/V from the slots of its nodes (base + node) to
        those of its depths (base + depth), where they differ (core/draft_tree.py), so the
        request's slots hold its tokens in order; the rest is overwritten or released."""
        src: list[int] = []
        dst: list[int] = []
        bs = self.block_size
        for chunk, tokens in verified:
            if not chunk.draft_parents:
                continue
            base, table = chunk.start + 1, chunk.request.block_table
            for node, depth in moves(accepted_path(chunk.draft, chunk.draft_parents, tokens)):
                src.append(table[(base + node) // bs] * bs + (base + node) % bs)
                dst.append(table[(base + depth) // bs] * bs + (base + depth) % bs)
        if not src:
            return
        self.pool.copy_slots(src, dst)
        if self.window is not None:
            page_of = self.window.page_of
            self.pool.copy_slots([page_of[s // bs] * bs + s % bs for s in src],
                                 [page_of[d // bs] * bs + d % bs for d in dst], window=True)

    def _prepare(self, chunks: list[ScheduledChunk]) -> PackedBatch:
        """Flat token batch and attention metadata. A drafted chunk (a decode plus its draft)
        enters attention as one single-query row per token, each with its own context length,
        so the decode kernel verifies it exactly as it would decode those tokens one by one;
        in a small step (_as_single_query_rows) every chunk does. A draft tree's node i is
        written to slot start + 1 + i and computed at position start + 1 + depth(i), its row
        masked to its ancestors (AttentionMetadata.tree_masks)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]  # per attention row
        seq_lens: list[int] = []
        row_tables: list[list[int]] = []
        chunk_starts: list[int] = []  # where each chunk's tokens begin in the batch
        logits_indices: list[int] = []
        draft_indices: list[int] = []  # every row of a drafted chunk: each verifies the next token
        sampling: list[ScheduledChunk] = []
        drafted: list[ScheduledChunk] = []
        num_decodes = 0
        tree_masks: list[int] = []  # per attention row (core/draft_tree.py); all 0 without trees
        as_rows = self._as_single_query_rows(chunks)
        for c in chunks:
            request, start, end = c.request, c.start, c.start + c.num_tokens
            table = request.block_table
            chunk_starts.append(query_start[-1])
            input_ids.extend(request.token_ids[start:end - len(c.draft)])
            input_ids.extend(c.draft)
            if c.draft_parents:
                if self.states is not None:
                    raise ValueError("a draft tree needs a model without recurrent layers")
                positions.append(start)
                positions.extend(start + 1 + d for d in depths(c.draft_parents))
            else:
                positions.extend(range(start, end))
            _extend_slots(slots, table, start, end, bs)
            if c.draft or as_rows:
                first = query_start[-1]
                for pos in range(start, end):
                    query_start.append(query_start[-1] + 1)
                    seq_lens.append(pos + 1)
                    row_tables.append(table)
                tree_masks.extend([0] + ancestor_masks(c.draft_parents) if c.draft_parents else [0] * c.num_tokens)
                num_decodes += c.num_tokens
                if c.draft:
                    draft_indices.extend(range(first, first + c.num_tokens))
                    drafted.append(c)
                elif c.samples:
                    logits_indices.append(query_start[-1] - 1)
                    sampling.append(c)
                continue
            query_start.append(query_start[-1] + c.num_tokens)
            seq_lens.append(end)
            row_tables.append(table)
            tree_masks.append(0)
            num_decodes += c.num_tokens == 1
            if c.samples:
                logits_indices.append(query_start[-1] - 1)
                sampling.append(c)
        width = max(len(t) for t in row_tables)
        tables = [t + [0] * (width - len(t)) for t in row_tables]
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            block_size=bs,
            query_start_loc=self._tensor(query_start, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._table_tensor(tables, torch.int32),
            slot_mapping=self._tensor(slots, torch.int64),
            query_start_loc_list=query_start,
            seq_lens_list=seq_lens,
        )
        if any(tree_masks):
            meta.tree_masks = self._tensor([m - (1 << 64) if m >> 63 else m for m in tree_masks], torch.int64)
            meta.tree_masks_list = tree_masks
        return PackedBatch(
            input_ids=self._tensor(input_ids, torch.int64),
            positions=self._tensor(positions, torch.int64),
            meta=meta,
            logits_indices=self._tensor(logits_indices + draft_indices, torch.int64),
            sampling=sampling,
            drafted=drafted,
            chunk_starts=chunk_starts,
            window_meta=self._window_meta(meta, tables, slots) if self.window is not None else None,
        )

    def _window_meta(self, meta: AttentionMetadata, tables: list[list[int]], slots: list[int]) -> AttentionMetadata:
        """The step's metadata over the window layers' pages: the same rows and lengths,
        each block named by its window page (a new token's block always has one)."""
        bs, page_of = self.block_size, self.window.page_of
        return replace(
            meta,
            block_tables=self._table_tensor([self.window.window_table(t) for t in tables], torch.int32),
            slot_mapping=self._tensor([page_of[s // bs] * bs + s % bs for s in slots], torch.int64),
        )

    def _as_single_query_rows(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether this step lays every token out as its own attention row, as drafts always
        are, so that the native decoder runs the whole step: at most row_limit tokens, and
        prefill chunks whose rows x context stay under ROWS_ATTENTION_WORK. The decode
        kernel reads a chunk's context once for all its rows, but each row still does its own
        arithmetic at decode speed; past that work the tiled prefill kernel's speed outweighs
        the Python the native decoder saves (bench_kernels --cpu --cpu-routing, 8 decodes plus
        a prompt in 16 / 40 / 100-token chunks, rows / tiled step time: 0.99 / 0.93 / 1.03 at
        contexts under 1k, 1.07 / 1.06 / 1.22 at 1-2k, 1.18-1.28 at 2-3k)."""
        if sum(c.num_tokens for c in chunks) > self.row_limit:
            return False
        work = sum(c.num_tokens * (c.start + c.num_tokens) for c in chunks if c.num_tokens > 1 and not c.draft)
        return work <= ROWS_ATTENTION_WORK

    def _sampling_row(self, chunk: ScheduledChunk) -> SamplingRow:
        request = chunk.request
        params = request.params
        stop_ids = [] if params.ignore_eos else list(self.eos_token_ids)
        return SamplingRow(
            params=params,
            token_ids=request.token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            stop_token_ids=stop_ids + params.stop_token_ids,
            grammar=request.grammar,
        )

    def _tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ints. On the host by way of an array, which torch reads without
        converting each element: ~1 us against torch.tensor's ~3, for the seven a step makes."""
        if self.device.type == "cpu" and values:
            return torch.frombuffer(array.array(_ARRAY_TYPES[dtype], values), dtype=dtype)
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _table_tensor(self, rows: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        """[len(rows), width] from rows of one width."""
        width = len(rows[0]) if rows else 0
        return self._tensor(list(chain.from_iterable(rows)), dtype).view(len(rows), width)


_ARRAY_TYPES = {torch.int32: "i", torch.int64: "q"}  # array.array's codes of the same widths
assert array.array("i").itemsize == 4 and array.array("q").itemsize == 8


def _batch_order(chunk: ScheduledChunk) -> tuple[bool, list[int]]:
    """Single-token queries first, ordered by block table, so that requests sharing
    prefix blocks are neighbours (decode attention reads a shared block once for them)."""
    single = chunk.num_tokens == 1 or bool(chunk.draft)  # a drafted chunk runs as single-query rows
    return not single, chunk.request.block_table if single else []


def _extend_slots(slots: list[int], table: list[int], start: int, end: int, block_size: int) -> None:
    """Append the pool slot of every position in [start, end): one range per block."""
    pos = start
    while pos < end:
        index = pos // block_size
        stop = min(end, (index + 1) * block_size)
        shift = (table[index] - index) * block_size  # slot = position + shift within this block
        slots.extend(range(pos + shift, stop + shift))
        pos = stop


def _prompt_logprob_rows(chunks: list[ScheduledChunk], chunk_starts: list[int]):
    """(request, logits row, prompt index j, token j) for every computed position whose next
    token is a prompt token the request wants scored."""
    rows = []
    for i, c in enumerate(chunks):
        request = c.request
        if request.prompt_logprobs is None:
            continue
        first = max(request.params.prompt_logprobs_start, 1)
        for p in range(max(c.start, first - 1), min(c.start + c.num_tokens, request.num_prompt_tokens - 1)):
            rows.append((request, chunk_starts[i] + p - c.start, p + 1, request.token_ids[p + 1]))
    return rows


def _score_prompt_tokens(logits: torch.Tensor, rows) -> list[tuple[Request, int, TokenLogprob]]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor([token for *_, token in rows], device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    k = max(request.params.prompt_logprobs for request, *_ in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    out = []
    for i, (request, _, index, token) in enumerate(rows):
        kr = request.params.prompt_logprobs
        top = list(zip(top_ids[i, :kr].tolist(), top_values[i, :kr].tolist())) if kr else []
        out.append((request, index, TokenLogprob(token, chosen[i], top)))
    return out
