"""Scheduler: decides, before every forward pass, which requests run and how many tokens
each computes (plain Python over ints and lists; no tensors).

One step:
  1. Running requests first, oldest first: a decode computes 1 token, a request still
     in prefill its next chunk (at most chunked_prefill_size). A request that needs a
     new block and finds none free evicts from the prefix cache; if that is not enough,
     the newest running request is preempted (its blocks are released, its computed
     prefix goes into the cache, and it returns to the front of the waiting queue to be
     recomputed later).
  2. Then waiting requests, in policy order, while the token budget, max_num_seqs and the
     pool allow: each reuses its longest cached prefix and computes the rest, chunked.
     A waiting request whose next uncached block is being computed by another request
     right now waits a step and then hits it in the cache (in-batch sharing). A request
     whose restore would read tier pages from disk waits (PREFETCHING) until they are in.
     Agent hints: priority orders the queue (policy.py); an osl counts the blocks the
     request's expected output will take, and keeps that many for admitted ones.
  3. A finished request's hints act on the prefix it leaves (SessionTable.apply_hints).

Blocks, the prefix cache, the tier and the sessions are reached through one KVManager.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config import EngineConfig
from radixserve.core.block_pool import BlockPool
from radixserve.core.draft_tree import is_chain
from radixserve.core.hashing import extend_block_hashes
from radixserve.core.kv_manager import KVManager, TierPrefetch
from radixserve.core.plan import ScheduledChunk, StepPlan
from radixserve.core.policy import SchedulePolicy
from radixserve.core.prompt_lookup import PromptLookupDrafter
from radixserve.core.radix_cache import RadixCache
from radixserve.core.request import Request, RequestStatus
from radixserve.core.sessions import SessionTable

_HELD_POLL_S = 0.005  # with nothing else to run, a step waits this long for a held request's pages


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # every added request's prompt, once
    cached_prompt_tokens: int = 0  # of those, served from the prefix cache at first admission
    computed_tokens: int = 0  # tokens run through the model, recomputation included
    preemptions: int = 0
    deferred_for_sharing: int = 0  # admissions postponed a step to hit a prefix being computed
    restored_prompt_tokens: int = 0  # of cached_prompt_tokens, restored from the second tier
    steps: int = 0


class Scheduler:
    def __init__(
        self, config: EngineConfig, pool: BlockPool, cache: RadixCache | None,
        drafter: PromptLookupDrafter | None = None, sessions: SessionTable | None = None,
        prefetch: TierPrefetch | None = None,
    ):
        self.config = config
        self.drafter = drafter  # proposes speculative tokens for decoding requests
        self.block_size = config.block_size
        self.kv = KVManager(pool, cache, config.block_size, sessions, prefetch,
                            max_chunk_tokens=min(config.chunked_prefill_size, config.max_num_batched_tokens))
        self.policy = SchedulePolicy(
            config.schedule_policy, self.kv, config.starvation_steps, config.policy_fcfs_threshold
        )
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.stats = SchedulerStats()

    # ---- public API -------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request; it waits as PREFETCHING while its tier pages are read in."""
        if self.kv.hold_for_prefetch(request):
            request.status = RequestStatus.PREFETCHING
        self.waiting.append(request)
        self.stats.prompt_tokens += request.num_prompt_tokens

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_runnable(self) -> bool:
        """Whether a step could compute anything (some request is not waiting on a prefetch)."""
        return bool(self.running) or any(r.status is RequestStatus.WAITING for r in self.waiting)

    def num_decoding(self) -> int:
        """Running requests past their prompt (each computes one token a step)."""
        return sum(1 for r in self.running if not r.in_prefill)

    def pending_prefills(self) -> list[tuple[float | None, int]]:
        """(arrival time, tokens left to compute) of every request with tokens to prefill:
        running prefills first (the order they are scheduled in), then the waiting by arrival.
        The arrival time is None for a request whose first token is out already (preempted,
        now recomputed): it has no TTFT to meet, but is computed before those behind it."""
        pending = [r for r in self.running if r.in_prefill]
        pending += sorted(self._runnable_waiting(), key=lambda r: r.arrival_time)
        return [(r.arrival_time if r.first_token_time is None else None, r.num_tokens - r.num_computed_tokens)
                for r in pending]

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens this engine still has to compute (cache hits of the waiting not counted)."""
        return sum(left for _, left in self.pending_prefills())

    def schedule(self, prefill_token_budget: int | None = None) -> StepPlan:
        """Plan the next step. A step in which requests decode computes at most
        max_prefill_tokens_decoding prompt tokens, and at most `prefill_token_budget` (the
        engine sizes it to a step-time target); a step with no decodes gives prefill the
        whole max_num_batched_tokens."""
        plan = StepPlan()
        if self._release_prefetched() and not self.has_runnable():
            return plan  # every request waits on its tier pages: not a step
        self.kv.begin_step()
        budget = self.config.max_num_batched_tokens
        prefill = budget
        if self.num_decoding() > 0:
            prefill = min(budget, self.config.max_prefill_tokens_decoding or budget)
            if prefill_token_budget is not None:
                prefill = max(0, min(prefill, prefill_token_budget))
        budget, prefill = self._schedule_running(plan, budget, prefill)
        if not plan.preempted:
            self._admit_waiting(plan, min(budget, prefill))
        for request in self._runnable_waiting():
            request.waited_steps += 1
        self.stats.steps += 1
        return plan

    def commit(self, plan: StepPlan) -> None:
        """The step ran: advance each request and publish finished prefill chunks to the cache."""
        for chunk in plan.chunks:
            request = chunk.request
            verified = chunk.num_tokens - len(chunk.draft)  # draft tokens count once accepted
            request.num_computed_tokens += verified
            self.stats.computed_tokens += chunk.num_tokens
            if verified > 1:
                self.kv.insert_computed(request)
        self.kv.trim_windows(self.running)

    def accept_draft_token(self, request: Request) -> None:
        """The token just appended to the request was a draft token that verification
        accepted: its K/V, computed this step, now counts."""
        request.num_computed_tokens += 1

    def release_unverified(self, request: Request) -> None:
        """After verification: drop the blocks that only rejected draft tokens used (tail
        first). Their slots were never published to the cache; the rest get overwritten."""
        self.kv.shrink(request)

    def finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            node = self.kv.release(request)
            if self.kv.sessions is not None and node is not None and reason != "abort":
                self.kv.sessions.apply_hints(request.cache_salt, request.session_id, node, request.hints,
                                             self.config.hint_priority_ttl_s)
        elif request.status is RequestStatus.PREFETCHING:
            self.waiting.remove(request)
            self.kv.unhold(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason

    def flush_cache(self, namespace: str | None = None) -> int:
        return self.kv.flush(namespace)

    def check_integrity(self) -> None:
        """Raise AssertionError unless every block reference and node lock is accounted for."""
        self.kv.check_integrity(self.running, self.waiting)

    # ---- scheduling -------------------------------------------------------------

    def _schedule_running(self, plan: StepPlan, budget: int, prefill: int) -> tuple[int, int]:
        # Decodes go first so that prefill chunks never crowd them out of the budget;
        # the last request in this order is the first to be preempted.
        queue = [r for r in self.running if not r.in_prefill] + [r for r in self.running if r.in_prefill]
        decoding: list[ScheduledChunk] = []
        i = 0
        while i < len(queue) and budget > 0:
            request = queue[i]
            n = min(request.num_tokens - request.num_computed_tokens, self.config.chunked_prefill_size, budget)
            if request.in_prefill:
                n = self.kv.chunk_limit(request, min(n, prefill))
                if n == 0:  # the prefill budget is spent: it waits for the next step
                    i += 1
                    continue
            if self.kv.grow(request, request.num_computed_tokens + n):
                plan.chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
                budget -= n
                if request.in_prefill:
                    prefill -= n
                else:
                    decoding.append(plan.chunks[-1])
                i += 1
                continue
            victim = queue.pop()
            self.running.remove(victim)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                break
        return self._add_drafts(decoding, budget), prefill

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        admitted: list[Request] = []
        inflight = self._inflight_block_hashes()
        reserved = sum(self._expected_growth(r) for r in self.running)
        for request in self.policy.order(self._runnable_waiting()):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self._should_wait_for_sharing(request, inflight):
                self.stats.deferred_for_sharing += 1
                continue
            chunk = self._try_admit(request, budget, reserved)
            if chunk is None:
                break  # the pool is full: later requests would not fit either
            reserved += self._expected_growth(request)
            admitted.append(request)
            plan.chunks.append(chunk)
            budget -= chunk.num_tokens
            if self.kv.caching:
                inflight.update(self._uncomputed_block_hashes(request))
        if admitted:
            chosen = {id(r) for r in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in chosen]

    def _try_admit(self, request: Request, budget: int, reserved: int = 0) -> ScheduledChunk | None:
        bs = self.block_size
        match = self.kv.match_and_lock(request)
        tier_blocks = match.num_tier_blocks
        cached = (len(match.blocks) + tier_blocks) * bs
        n = min(request.num_tokens - cached, self.config.chunked_prefill_size, budget)
        if not self.kv.fits(request, match, self._expected_output(request), reserved, alone=not self.running):
            self.kv.unlock(match)
            return None
        if self.kv.sessions is not None:
            self.kv.sessions.holds.refresh(match.node)  # a hit on a held prefix starts its TTL again
        self.kv.adopt_match(request, match)
        request.num_computed_tokens = cached
        n = self.kv.chunk_limit(request, n)  # a recurrent model's chunk stops where its state is saved
        if not self.kv.grow(request, cached + n):
            raise RuntimeError("admission control admitted a request the pool cannot hold")
        if not request.admitted_once:
            request.admitted_once = True
            request.cached_tokens = cached
            request.restored_tokens = tier_blocks * bs
            self.stats.cached_prompt_tokens += min(cached, request.num_prompt_tokens)
            self.stats.restored_prompt_tokens += min(tier_blocks * bs, request.num_prompt_tokens)
        request.status = RequestStatus.RUNNING
        request.waited_steps = 0
        self.running.append(request)
        return ScheduledChunk(request, cached, n)

    def _add_drafts(self, decoding: list[ScheduledChunk], budget: int) -> int:
        """Speculative tokens for the decoding chunks, chosen together (the drafter weighs
        what a row costs at this batch), after every request's own growth: new blocks for
        them come from free blocks only (never by evicting), leaving one free block per
        running request; without them a draft is cut to its request's last block. The
        budget left."""
        if self.drafter is None or not decoding or len(decoding) > self.config.speculative_max_batch:
            return budget
        asks = [(c.request, c.request.max_total_tokens - c.request.num_tokens - 1) for c in decoding]
        drafts = self.drafter.propose_step(asks, len(decoding), budget)
        for chunk, draft in zip(decoding, drafts):
            request = chunk.request
            spare = len(request.block_table) * self.block_size - request.num_tokens  # slots its blocks have left
            if len(draft) > spare and not self.kv.grow_from_free(request, request.num_tokens + len(draft),
                                                                 keep_free=len(self.running)):
                draft = draft[:spare]
            if draft:
                chunk.draft = draft
                parents = (self.drafter.parents_of(request) or [])[:len(draft)]
                chunk.draft_parents = [] if is_chain(parents) else parents  # a tree cut to its chain is one
                chunk.num_tokens += len(draft)
                budget -= len(draft)
        return budget

    def _expected_output(self, request: Request) -> int:
        """Tokens the request is expected to generate from now (its osl hint; else 1)."""
        osl = request.hints.osl
        if osl is None:
            return 1
        return max(1, min(osl - request.num_output_tokens, request.max_total_tokens - request.num_tokens))

    def _expected_growth(self, request: Request) -> int:
        """Blocks a request with an osl hint is still expected to add to its table."""
        if request.hints.osl is None:
            return 0
        end = request.num_tokens + self._expected_output(request)
        return max(0, -(-end // self.block_size) - len(request.block_table))

    def _preempt(self, request: Request) -> None:
        self.kv.release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.insert(0, request)

    def _runnable_waiting(self) -> list[Request]:
        return [r for r in self.waiting if r.status is RequestStatus.WAITING]

    def _release_prefetched(self) -> bool:
        """Held requests whose tier pages are in become WAITING (with nothing else to run,
        first wait a moment for one); False when no request was held."""
        if not any(r.status is RequestStatus.PREFETCHING for r in self.waiting):
            return False
        ready = set(self.kv.prefetched(wait_s=0.0 if self.has_runnable() else _HELD_POLL_S))
        for request in self.waiting:
            if request.request_id in ready and request.status is RequestStatus.PREFETCHING:
                request.status = RequestStatus.WAITING
        return True

    # ---- in-batch sharing -------------------------------------------------------

    def _should_wait_for_sharing(self, request: Request, inflight: set[int]) -> bool:
        """True when the first block this request would compute is being computed by a
        running request: a step later it will be in the cache."""
        if not self.kv.caching or not inflight or request.waited_steps >= self.config.starvation_steps:
            return False
        next_block = self.kv.cached_prefix_len(request) // self.block_size
        hashes = self._block_hashes(request)
        return next_block < len(hashes) and hashes[next_block] in inflight

    def _inflight_block_hashes(self) -> set[int]:
        if not self.kv.caching:
            return set()
        inflight: set[int] = set()
        for request in self.running:
            if request.in_prefill:
                inflight.update(self._uncomputed_block_hashes(request))
        return inflight

    def _uncomputed_block_hashes(self, request: Request) -> list[int]:
        return self._block_hashes(request)[request.num_computed_tokens // self.block_size:]

    def _block_hashes(self, request: Request) -> list[int]:
        return extend_block_hashes(request.block_hashes, request.token_ids, self.block_size, request.cache_salt)
