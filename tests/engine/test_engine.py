"""Engine on tiny random models: token-for-token equality with transformers, continuous
batching (staggered arrivals, chunked prefill, preemption), sampling, bad input."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve import Engine, SamplingParams
from tiny_models import hf_greedy, hf_logprobs

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts_of(lengths, seed=0, vocab=97):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def assert_all_free(engine):
    engine.check_integrity()
    engine.flush_cache()
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert engine.pool.window is None or engine.pool.window.num_attached == 0
    assert not engine.has_unfinished_requests()


def small_engine(directory, **options):
    defaults = dict(block_size=4, num_kv_blocks=256, chunked_prefill_size=7, max_num_batched_tokens=16)
    return Engine(str(directory), **{**defaults, **options})


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "mistral_window", "gemma3"])
def test_greedy_equals_transformers(tiny_model_dir, kind):
    directory = tiny_model_dir(kind)
    prompts = prompts_of([1, 5, 17, 40, 64])
    engine = small_engine(directory)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(directory, prompt, 12)
        assert out.finish_reason == "length"
    assert_all_free(engine)


def test_requests_join_and_leave_at_every_step(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prompts = prompts_of([23, 3, 31, 9, 14, 2], seed=1)
    lengths = [10, 4, 7, 12, 1, 6]
    engine = small_engine(directory)
    ids, done = {}, {}
    pending = list(zip(prompts, lengths))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:  # a new request every other step, while others decode
            prompt, n = pending.pop(0)
            ids[engine.add_request(prompt, SamplingParams(max_tokens=n, **GREEDY))] = (prompt, n)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        step += 1
    for rid, (prompt, n) in ids.items():
        assert done[rid] == hf_greedy(directory, prompt, n)
    assert_all_free(engine)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_resumes_with_the_same_output(tiny_model_dir, prefix_cache):
    directory = tiny_model_dir("qwen3")
    prompts = prompts_of([10, 11, 12, 13], seed=2)
    # Each request needs up to 6 blocks of 4; 12 blocks cannot hold all four at once.
    engine = small_engine(directory, num_kv_blocks=12, enable_prefix_cache=prefix_cache)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    assert engine.stats()["preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(directory, prompt, 12)
    assert any(o.num_preemptions for o in outs)
    assert_all_free(engine)


def test_shared_prefix_hits_and_matches_transformers(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prefix = prompts_of([24], seed=3)[0]
    prompts = [prefix + tail for tail in prompts_of([3, 5, 2, 7], seed=4)]
    engine = small_engine(directory, max_num_batched_tokens=64, chunked_prefill_size=64)
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(directory, prompt, 8)
    assert [o.cached_tokens for o in outs] == [0, 24, 24, 24]
    assert engine.stats()["cached_prompt_tokens"] == 72
    assert_all_free(engine)


def test_seeded_sampling_is_reproducible_across_batch_compositions(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prompt = prompts_of([9], seed=5)[0]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = Engine(str(directory), block_size=4, num_kv_blocks=128).generate([prompt], params)[0].token_ids
    others = prompts_of([3, 20, 7], seed=6)
    crowd = small_engine(directory)
    noisy = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    crowd.add_request(others[0], noisy)
    crowd.step()
    rid = crowd.add_request(prompt, params)
    for p in others[1:]:
        crowd.add_request(p, noisy)
    result = None
    while crowd.has_unfinished_requests():
        for out in crowd.step():
            if out.finished and out.request_id == rid:
                result = out.token_ids
    assert result == alone
    different_seed = SamplingParams(**{**params.__dict__, "seed": 99})
    assert crowd.generate([prompt], different_seed)[0].token_ids != alone
    assert_all_free(crowd)


def test_logprobs_match_transformers(tiny_model_dir):
    directory = tiny_model_dir("qwen2")
    prompt = prompts_of([11], seed=7)[0]
    engine = small_engine(directory)
    out = engine.generate([prompt], SamplingParams(max_tokens=6, logprobs=3, **GREEDY))[0]
    reference = hf_logprobs(directory, prompt, out.token_ids)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for i, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(float(reference[i, lp.token_id]), abs=1e-4)
        values, ids = reference[i].topk(3)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_repetition_penalty_equals_transformers(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prompt = prompts_of([6], seed=8)[0]
    engine = small_engine(directory)
    out = engine.generate([prompt], SamplingParams(max_tokens=10, repetition_penalty=1.7, **GREEDY))[0]
    assert out.token_ids == hf_greedy(directory, prompt, 10, repetition_penalty=1.7)


def test_stop_token_ids_min_tokens_and_max_tokens(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prompt = prompts_of([8], seed=9)[0]
    reference = hf_greedy(directory, prompt, 12)
    engine = small_engine(directory)
    stop_at = reference[3]
    first = reference.index(stop_at)
    out = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[stop_at], **GREEDY))[0]
    assert out.token_ids == reference[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)
    # min_tokens masks the stop token until enough tokens were generated
    out = engine.generate([prompt], SamplingParams(max_tokens=12, min_tokens=12, stop_token_ids=[stop_at], **GREEDY))[0]
    assert len(out.token_ids) == 12 and stop_at not in out.token_ids
    out = engine.generate([prompt], SamplingParams(max_tokens=3, **GREEDY))[0]
    assert out.token_ids == reference[:3] and out.finish_reason == "length"
    assert_all_free(engine)


def test_abort_frees_blocks_and_others_finish(tiny_model_dir):
    directory = tiny_model_dir("llama")
    engine = small_engine(directory)
    prompts = prompts_of([30, 12], seed=10)
    doomed = engine.add_request(prompts[0], SamplingParams(max_tokens=50, **GREEDY))
    keep = engine.add_request(prompts[1], SamplingParams(max_tokens=5, **GREEDY))
    for _ in range(4):
        engine.step()
    assert engine.abort(doomed) is True
    assert engine.abort(doomed) is False
    engine.check_integrity()
    result = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            result[out.request_id] = out
    assert result[keep].token_ids == hf_greedy(directory, prompts[1], 5)
    assert doomed not in result
    assert_all_free(engine)


BAD_INPUTS = [
    (lambda e: e.add_request([], SamplingParams()), "prompt is empty"),
    (lambda e: e.add_request([1, 2], SamplingParams(max_tokens=-3)), "max_tokens must be >= 0"),
    (lambda e: e.add_request([1] * 300, SamplingParams()), "context is 256 tokens"),
    (lambda e: e.add_request([1] * 200, SamplingParams(max_tokens=100)), "exceeds the model's context"),
    (lambda e: e.add_request([1, 2], SamplingParams(temperature=-1.0)), "temperature"),
    (lambda e: e.add_request([1, 2], SamplingParams(top_p=0.0)), "top_p"),
    (lambda e: e.add_request([1, 2], SamplingParams(logprobs=50)), "logprobs"),
    (lambda e: e.add_request([1, 2], SamplingParams.from_dict({"temprature": 0.5})), "unknown sampling parameter"),
    (lambda e: e.add_request([1, 97], SamplingParams()), r"token ids must be integers in \[0, 97\)"),
    (lambda e: e.add_request([1, "a"], SamplingParams()), "token ids must be integers"),
    (lambda e: e.add_request("hello", SamplingParams()), "has no tokenizer"),
    (lambda e: e.add_request([1, 2], SamplingParams(), request_id="keep"), "already in use"),
    (lambda e: e.add_request([1] * 100, SamplingParams(max_tokens=100)), "KV blocks"),
    (lambda e: e.generate([[1, 2], []], SamplingParams()), "prompt is empty"),
]


def test_bad_input_raises_and_the_engine_keeps_serving(tiny_model_dir):
    directory = tiny_model_dir("llama")
    engine = small_engine(directory, num_kv_blocks=48)
    prompt = prompts_of([10], seed=11)[0]
    engine.add_request(prompt, SamplingParams(max_tokens=40, **GREEDY), request_id="keep")
    engine.step()
    for bad, message in BAD_INPUTS:
        with pytest.raises(ValueError, match=message):
            bad(engine)
        engine.check_integrity()
        engine.step()
    assert engine.stats()["waiting"] + engine.stats()["running"] <= 1
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs["keep"].token_ids == hf_greedy(directory, prompt, 40)
    assert_all_free(engine)


def test_bfloat16_runs_and_mostly_agrees(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prompt = prompts_of([12], seed=12)[0]
    engine = small_engine(directory, dtype="bfloat16")
    assert engine.runner.pool.kv.dtype == torch.bfloat16
    out = engine.generate([prompt], SamplingParams(max_tokens=4, **GREEDY))[0]
    assert out.token_ids[0] == hf_greedy(directory, prompt, 1)[0]


def test_prompt_logprobs_match_transformers_and_reuse_the_cached_prefix(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prefix = prompts_of([16], seed=13)[0]
    choice = [5, 9, 33]
    engine = small_engine(directory, max_num_batched_tokens=64, chunked_prefill_size=64)
    engine.generate([prefix + [1]], SamplingParams(max_tokens=1, **GREEDY))  # warm the cache
    params = SamplingParams(max_tokens=1, prompt_logprobs=2, prompt_logprobs_start=16, **GREEDY)
    out = engine.generate([prefix + choice], params)[0]
    assert out.cached_tokens == 12  # blocks before the scored tokens came from the cache
    assert out.prompt_logprobs[:16] == [None] * 16
    model_logprobs = hf_logprobs(directory, prefix, choice)  # logprob of each choice token
    for i, token in enumerate(choice):
        lp = out.prompt_logprobs[16 + i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(model_logprobs[i, token]), abs=1e-4)
        assert [t for t, _ in lp.top] == model_logprobs[i].topk(2).indices.tolist()
    full = engine.generate([prefix + choice], SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY))[0]
    assert full.prompt_logprobs[0] is None and all(lp is not None for lp in full.prompt_logprobs[1:])
    assert full.cached_tokens == 0
    assert_all_free(engine)


def test_allocation_evicts_cached_blocks_before_preempting(tiny_model_dir):
    directory = tiny_model_dir("llama")
    engine = small_engine(directory, num_kv_blocks=20, max_num_batched_tokens=64, chunked_prefill_size=64)
    engine.generate(prompts_of([30, 30], seed=14), SamplingParams(max_tokens=8, **GREEDY))
    assert engine.stats()["blocks_cached"] > 10  # the finished requests left their blocks cached
    fresh = prompts_of([30, 25], seed=15)
    outs = engine.generate(fresh, SamplingParams(max_tokens=8, **GREEDY))
    stats = engine.stats()
    assert stats["evicted_blocks"] > 0 and stats["preemptions"] == 0
    for prompt, out in zip(fresh, outs):
        assert out.token_ids == hf_greedy(directory, prompt, 8)
    assert_all_free(engine)


def test_cache_salt_keeps_tenants_apart(tiny_model_dir):
    directory = tiny_model_dir("llama")
    engine = small_engine(directory, max_num_batched_tokens=64, chunked_prefill_size=64)
    prompt = prompts_of([20], seed=16)[0]
    params = SamplingParams(max_tokens=2, **GREEDY)
    runs = {}
    for salt in ("tenant-a", "tenant-b", "tenant-a", None):
        rid = engine.add_request(prompt, params, cache_salt=salt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id == rid:
                    runs.setdefault(salt, []).append(out.cached_tokens)
    assert runs == {"tenant-a": [0, 16], "tenant-b": [0], None: [0]}  # 16: whole blocks before the last token
    assert_all_free(engine)


def test_no_max_tokens_generates_up_to_what_the_pool_holds(tiny_model_dir):
    engine = small_engine(tiny_model_dir("llama"), num_kv_blocks=10)  # 40 tokens, context 256
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=None, **GREEDY))[0]
    assert len(out.token_ids) == 37 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request([1] * 40, SamplingParams(max_tokens=None))
    assert_all_free(engine)


def test_stop_string_search_covers_the_whole_new_text_and_the_seam():
    from radixserve.core.request import Request
    from radixserve.engine.output import find_stop_string

    params = SamplingParams(stop=["STOP", "xy"])
    request = Request("r", [1], params, 10)
    request.output_text = "a" * 100 + "STOP" + "b" * 100  # one long delta after 3 chars of old text
    assert find_stop_string(request, 3) == "STOP" and request.output_text == "a" * 100
    request.output_text = "...x" + "y tail"  # a stop string across the old text and the new
    assert find_stop_string(request, 4) == "xy" and request.output_text == "..."
    request.output_text = "xy" + "abc"  # entirely in text already checked: not found again
    assert find_stop_string(request, 4) is None


_STATS_KEYS = [
    "prompt_tokens", "cached_prompt_tokens", "generated_tokens", "computed_tokens", "preemptions",
    "deferred_for_sharing", "steps", "running", "waiting", "blocks_total", "blocks_free", "blocks_cached",
    "blocks_evictable", "evicted_blocks", "cache_nodes", "kv_cache_dtype", "kv_bytes_per_token", "weight_dtype",
    "weight_bytes", "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens", "spec_acceptance_rate", "spec_pauses", "spec_tree_drafts", "spec_accepted_length",
    "spec_branched_drafts", "spec_branch_hits", "spec_forced_drafts", "spec_forced_tokens", "spec_forced_accepted",
]
_CACHE_KEYS = ["restored_prompt_tokens", "tier_hits", "restored_blocks"]
_SESSION_KEYS = ["sessions_open", "pool_cached_bytes", "pins"]
_TIER_KEYS = ["tier_blocks_total", "tier_blocks_used", "tier_bytes", "tier_persist_failed",
              "tier_prefetched_blocks", "tier_prefetch_holds", "tier_warmed_blocks"]
_HINT_KEYS = [f"hint_requests_{kind}" for kind in ("priority", "latency_sensitivity", "osl", "ttl",
                                                    "speculative_prefill", "release")] + [
    "hint_ttl_held_blocks", "hint_ttl_holds", "speculative_prefills", "speculative_prefill_tokens"]
_CPU_KEYS = ["cpu_usable_cores", "cpu_threads", "cpu_others_cores", "cpu_team_reductions"]
_TIMING_KEYS = _CPU_KEYS + ["schedule_s", "model_s", "postprocess_s"]


def test_stats_keep_their_flat_shape_and_agree_with_the_snapshot(tiny_model_dir):
    """stats() (the JSON of /get_server_info and /debug/stats) is the typed snapshot, flat,
    with the keys clients read, in order: without a cache, with one, with a second tier."""
    model = str(tiny_model_dir("llama"))
    plain = Engine(model, num_kv_blocks=16, enable_prefix_cache=False)
    plain.generate([[1, 2, 3]], SamplingParams(max_tokens=2, **GREEDY))
    assert list(plain.stats()) == _STATS_KEYS + _HINT_KEYS + _TIMING_KEYS
    assert plain.snapshot().cache is None and plain.stats()["generated_tokens"] == 2
    tiered = Engine(model, num_kv_blocks=8, kv_offload_memory=4 << 20)
    for i in range(4):  # more than the pool holds: blocks move to the tier
        tiered.generate([[i + 1] * 40], SamplingParams(max_tokens=2, **GREEDY))
    stats, snap = tiered.stats(), tiered.snapshot()
    evicted = [f"evicted_blocks_{reason}" for reason in snap.cache.evictions]
    assert evicted and list(stats) == _STATS_KEYS + _CACHE_KEYS + evicted + _SESSION_KEYS + _TIER_KEYS + _HINT_KEYS + _TIMING_KEYS
    assert stats == snap.as_dict()
    assert stats["tier_blocks_used"] == snap.tier.tier_blocks_used > 0
    assert stats["blocks_total"] - stats["blocks_free"] == snap.blocks_used
    tiered.check_integrity()


def _open_files_under(directory) -> list[str]:
    """This process's open file descriptors that point into `directory` (Linux /proc)."""
    import os

    fds = "/proc/self/fd"
    return [target for target in (os.path.realpath(os.path.join(fds, fd)) for fd in os.listdir(fds))
            if target.startswith(str(directory.resolve()))]


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
def test_an_engine_refused_after_its_tier_opened_leaves_no_thread_or_file(tiny_model_dir, tmp_path, monkeypatch):
    """An option refused late (here bf16 matmuls on a CPU without them, refused by the model
    after the persisted tier started its threads and mapped its file) closes what the engine
    had opened; so does close() on a working engine; the directory then serves a new engine."""
    import threading

    import radixserve.model.causal_lm as causal_lm

    options = dict(kv_persist_dir=str(tmp_path), kv_offload_memory=1 << 24, num_kv_blocks=64)
    path = str(tiny_model_dir("llama"))
    before = set(threading.enumerate())  # others' threads may end or start meanwhile: count only ours

    def started() -> list[threading.Thread]:
        return [thread for thread in threading.enumerate()
                if thread not in before and thread.name.startswith("radixserve-")]

    monkeypatch.setattr(causal_lm, "bf16_available", lambda: False)
    for _ in range(2):
        with pytest.raises(ValueError, match="prefill_matmul_dtype bfloat16 needs"):
            Engine(path, prefill_matmul_dtype="bfloat16", **options)
    assert started() == []
    assert _open_files_under(tmp_path) == []
    engine = Engine(path, **options)
    assert _open_files_under(tmp_path) and started()  # the tier's file and threads
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
    engine.check_integrity()
    engine.close()
    assert started() == []
    assert _open_files_under(tmp_path) == []
