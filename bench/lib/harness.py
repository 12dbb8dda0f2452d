"""Run a workload through radixserve or through transformers' static batching, and measure.

Both drivers play a workload the same way: every session's first turn is ready at the
start; a later turn becomes ready when the previous one finished (its prompt includes the
previous answer). Generation is greedy with EOS ignored, so every system produces exactly
the requested number of tokens and throughputs compare like for like.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from bench.lib.workloads import LOW_ID, TokenSessions


@dataclass
class RunResult:
    system: str
    workload: str
    wall_s: float
    prompt_tokens: int
    generated_tokens: int
    ttft_s: list[float]
    # (prompt, prompt + output) of every request, in submission order
    records: list[list[list[int]]] = field(default_factory=list)
    cached_prompt_tokens: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def generated_per_s(self) -> float:
        return self.generated_tokens / self.wall_s

    @property
    def total_per_s(self) -> float:
        return (self.prompt_tokens + self.generated_tokens) / self.wall_s

    def ttft(self, q: float) -> float:
        return percentile(self.ttft_s, q)


def percentile(values: list[float | None], q: float) -> float:
    """The benches' one percentile: q in [0, 100], linear between the nearest ranks (numpy's
    default); None values are left out; nan when nothing is left."""
    data = sorted(v for v in values if v is not None)
    if not data:
        return float("nan")
    rank = (len(data) - 1) * min(max(q, 0.0), 100.0) / 100
    low = int(rank)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (rank - low)


def progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False, dynamic_ncols=True)


def seeded_prompt(seed: int, length: int) -> list[int]:
    """`length` plain token ids of the default model's vocabulary, a fixed function of `seed`."""
    return [100 + (seed * 7919 + j * 31) % 40000 for j in range(length)]


def settle(engine) -> None:
    """Step until nothing is left in prefill."""
    while engine.scheduler.waiting or any(r.in_prefill for r in engine.scheduler.running):
        engine.step()


# ---- radixserve ---------------------------------------------------------------------


def run_radixserve(engine, workload: TokenSessions, label: str = "radixserve", step_log: list | None = None) -> RunResult:
    from radixserve import SamplingParams

    _warm_up_radixserve(engine)
    before = engine.stats()
    histories = [[] for _ in workload.sessions]
    next_turn = [0] * len(workload.sessions)
    owner: dict[str, int] = {}
    record_of: dict[str, int] = {}
    submitted: dict[str, float] = {}
    ttfts, records = [], []
    prompt_tokens = generated = 0
    bar = progress(workload.num_requests, label)
    start = time.perf_counter()

    def submit(s: int) -> None:
        nonlocal prompt_tokens
        turn = workload.sessions[s].turns[next_turn[s]]
        prompt = histories[s] + turn.new_tokens
        params = SamplingParams(max_tokens=turn.max_tokens, temperature=0.0, ignore_eos=True)
        rid = engine.add_request(prompt, params)
        owner[rid], submitted[rid], record_of[rid] = s, time.perf_counter(), len(records)
        histories[s] = prompt
        prompt_tokens += len(prompt)
        records.append([prompt, prompt])

    for s in range(len(workload.sessions)):
        submit(s)
    seen_first: set[str] = set()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if step_log is not None:
            step_log.append((len(engine.scheduler.running), now - t0, dict(engine.last_step_timings)))
        for out in outputs:
            if out.request_id not in seen_first:
                seen_first.add(out.request_id)
                ttfts.append(now - submitted[out.request_id])
            if not out.finished:
                continue
            s = owner.pop(out.request_id)
            histories[s] = histories[s] + out.token_ids
            records[record_of.pop(out.request_id)][1] = histories[s]
            generated += len(out.token_ids)
            bar.update(1)
            next_turn[s] += 1
            if next_turn[s] < len(workload.sessions[s].turns):
                submit(s)
    wall = time.perf_counter() - start
    bar.close()
    after = engine.stats()
    engine.check_integrity()
    return RunResult(
        label, workload.name, wall, prompt_tokens, generated, ttfts, records,
        cached_prompt_tokens=after["cached_prompt_tokens"] - before["cached_prompt_tokens"],
        extra={"preemptions": after["preemptions"] - before["preemptions"], "steps": after["steps"] - before["steps"]},
    )


def _warm_up_radixserve(engine) -> None:
    """One tiny request before the clock starts (lazy kernel loading, first allocations),
    as transformers gets one; its cache entries are flushed so nothing carries over."""
    from radixserve import SamplingParams

    engine.generate([[LOW_ID + i for i in range(24)]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                    use_tqdm=False)
    engine.flush_cache()


# ---- transformers static batching ---------------------------------------------------------


def run_hf_static(model, workload: TokenSessions, batch_size: int, pad_token_id: int, label: str = "transformers-static"):
    """Rounds of turns (turn i of every session), each round in static batches with left padding."""
    import torch

    _hf_generate(model, [[LOW_ID + i for i in range(24)]] * 2, 2, pad_token_id, torch)  # warm-up, untimed
    histories = [[] for _ in workload.sessions]
    ttfts, records = [], []
    prompt_tokens = generated = 0
    bar = progress(workload.num_requests, label)
    start = time.perf_counter()
    rounds = max(len(s.turns) for s in workload.sessions)
    for r in range(rounds):
        ready_at = time.perf_counter()
        active = [s for s, sess in enumerate(workload.sessions) if r < len(sess.turns)]
        for b in range(0, len(active), batch_size):
            batch = active[b : b + batch_size]
            batch_prompts = [histories[s] + workload.sessions[s].turns[r].new_tokens for s in batch]
            wanted = [workload.sessions[s].turns[r].max_tokens for s in batch]
            outs, first_token_at = _hf_generate(model, batch_prompts, max(wanted), pad_token_id, torch)
            for s, prompt, out, n in zip(batch, batch_prompts, outs, wanted):
                histories[s] = prompt + out[:n]
                records.append([prompt, histories[s]])
                prompt_tokens += len(prompt)
                generated += n
                ttfts.append(first_token_at - ready_at)
                bar.update(1)
    wall = time.perf_counter() - start
    bar.close()
    return RunResult(label, workload.name, wall, prompt_tokens, generated, ttfts, records)


def _hf_generate(model, prompts: list[list[int]], max_new: int, pad_token_id: int, torch):
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    first = []

    class FirstToken:  # a logits processor is called once per step, the first time right after prefill
        def __call__(self, input_ids, scores):
            if not first:
                first.append(time.perf_counter())
            return scores

    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
            pad_token_id=pad_token_id, eos_token_id=None, logits_processor=[FirstToken()],
        )
    return out[:, longest:].tolist(), first[0]


# ---- ideal reuse --------------------------------------------------------------------------


def ideal_cached_tokens(result: RunResult, block_size: int) -> int:
    """What an unbounded cache could reuse: for each request, the longest block-aligned common
    prefix of its prompt with any earlier request's tokens (prompt and answer), leaving at
    least the last prompt token to compute."""
    from radixserve.core.hashing import extend_block_hashes

    known: set[int] = set()
    total = 0
    for prompt, sequence in result.records:
        hashes = extend_block_hashes([], prompt[: len(prompt) - 1], block_size, None)
        hit = 0
        while hit < len(hashes) and hashes[hit] in known:
            hit += 1
        total += hit * block_size
        known.update(extend_block_hashes([], sequence, block_size, None))
    return total
