"""NativeDecoder: a decode step's layers in one C call give the layer-by-layer path's logits bit
for bit (decodes and speculative draft rows, with and without biases, q/k norms, Gemma 3's
layers over a hybrid pool's window pages), every other step keeps
that path, bad slots are refused before anything is written, and the build digest covers the
sources that decoder_layers.c includes; its workspace goes at a heap trim."""

from __future__ import annotations

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.attention.cpu_backend import CpuPlan
from radixserve.model.native_decoder import HeadRows, NativeDecoder
from radixserve.kernels.native_ops import max_rows

needs_kernel = pytest.mark.skipif(max_rows() == 0, reason="no skinny matmul kernel for this CPU")

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _recording(engine: Engine) -> tuple[list[torch.Tensor], list[bool]]:
    """Every step's logits, and for each step whether the native decoder ran it."""
    logits: list[torch.Tensor] = []
    native: list[bool] = []
    model = engine.runner.model
    model.register_forward_hook(lambda module, args, out: logits.append(out.clone()))
    decoder = model.native
    if decoder is None:
        model.register_forward_hook(lambda *_: native.append(False))
        return logits, native
    run = decoder.run

    def recorded(*args, **kwargs):
        out = run(*args, **kwargs)
        native.append(out is not None)
        return out

    decoder.run = recorded
    return logits, native


def _twin_engines(path, **config) -> tuple[Engine, Engine]:
    """The same model twice: one with the native decoder, one that keeps the layer path."""
    fused, layers = Engine(str(path), **config), Engine(str(path), **config)
    layers.runner.model.native = None  # same row layout, layer by layer
    return fused, layers


def _same_logits(fused: Engine, layers: Engine, prompts: list[list[int]], max_tokens: int) -> list[bool]:
    """Both engines generate the prompts greedily: the same tokens and every step's logits bit
    for bit, the layer path never native. Returns, for each of the fused engine's steps, whether
    the native decoder ran it."""
    runs = []
    for engine in (fused, layers):
        logits, native = _recording(engine)
        outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY))
        runs.append((logits, native, [o.token_ids for o in outputs]))
    (fused_logits, fused_native, fused_tokens), (layer_logits, layer_native, layer_tokens) = runs
    assert fused_tokens == layer_tokens
    assert len(fused_logits) == len(layer_logits)
    assert all(torch.equal(a, b) for a, b in zip(fused_logits, layer_logits))
    assert not any(layer_native)
    return fused_native


@needs_kernel
@pytest.mark.parametrize("kind, kv_cache_dtype, weight_dtype, hybrid_kv", [
    ("llama", "auto", "auto", "auto"), ("mistral", "auto", "auto", "auto"), ("qwen2", "auto", "auto", "auto"),
    ("llama", "int8", "auto", "auto"),
    ("llama", "auto", "int4", "auto"), ("qwen2", "int8", "int8", "auto"),  # quantized weights: the same kernel on both paths
    ("qwen3", "auto", "auto", "auto"),  # q/k norms
    # Gemma 3: q/k norms, norms on each block's output, GELU-tanh, its window layers' own RoPE
    # table and (hybrid KV) their own pages, tables and slots
    ("gemma3", "auto", "auto", "auto"), ("gemma3", "auto", "auto", "off"), ("gemma3", "int8", "int8", "auto"),
    ("mistral_window", "auto", "auto", "auto"),
])
def test_decode_steps_give_the_layer_paths_logits_bit_for_bit(tiny_model_dir, kind, kv_cache_dtype, weight_dtype,
                                                              hybrid_kv):
    hybrid = kind in ("gemma3", "mistral_window") and hybrid_kv == "auto"
    sized = dict(num_kv_blocks=96) if hybrid else {}
    fused, layers = _twin_engines(tiny_model_dir(kind), kv_cache_dtype=kv_cache_dtype, weight_dtype=weight_dtype,
                                  hybrid_kv=hybrid_kv, **sized)
    assert fused.runner.pool.hybrid == hybrid
    if hybrid:  # 45 blocks through 35 window pages: after them pages are numbered unlike blocks
        warm_up = [[j + 1] + [7 + i % 50 for i in range(239)] for j in range(3)]
        for engine in (fused, layers):
            for prompt in warm_up:
                engine.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))
        window = fused.runner.window
        assert any(window.page_of[b] not in (b, -1) for b in range(len(window.page_of)))
    # 1-10 blocks, decodes cross block ends; the first step (172 tokens) is too big for the
    # native decoder, the second prompt's later steps are not
    fused_native = _same_logits(fused, layers, [[5, 9, 2, 7], [3 + i % 90 for i in range(149)], [11] * 19], 24)
    assert fused_native[0] is False, "the 172-token prefill step keeps the layer path"
    assert len(fused_native) == 24 and all(fused_native[1:]), "the decode steps ran natively"
    fused.check_integrity()


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("kind, kv_cache_dtype, weight_dtype", [
    ("llama", "auto", "int4"), ("qwen2", "int8", "int8"),  # biases, int8 pages
    ("gemma3", "auto", "int8"),  # norms on each block's output, GELU-tanh, window layers on their own pages
])
def test_one_parallel_region_for_every_layer_gives_the_same_bits(tiny_model_dir, threads, kind, kv_cache_dtype,
                                                                 weight_dtype):
    """With every projection quantized and a team of threads, a step of up to 8 rows runs all its
    layers in one parallel region (decodes, and draft rows of several lengths): the layer path's
    logits bit for bit, at each team size."""
    config = dict(kv_cache_dtype=kv_cache_dtype, weight_dtype=weight_dtype, num_threads=threads,
                  speculative="prompt-lookup", prompt_lookup_min=1, speculative_adaptive=False)
    fused, layers = _twin_engines(tiny_model_dir(kind), **config)
    rows = []
    fused.runner.model.register_forward_hook(lambda module, args, out: rows.append(out.shape[0]))
    native = _same_logits(fused, layers, [[3, 4, 5, 6, 7, 8] * 6, [3 + i % 90 for i in range(149)], [11] * 19], 20)
    assert sum(native) >= 10 and any(took and n > 1 for took, n in zip(native, rows)), "draft rows ran natively"
    fused.check_integrity()


@needs_kernel
def test_speculative_draft_rows_run_natively_and_match(tiny_model_dir):
    # drafts of a length that does not depend on the two engines' step times
    config = dict(speculative="prompt-lookup", prompt_lookup_min=1, speculative_adaptive=False)
    fused, layers = _twin_engines(tiny_model_dir("llama"), **config)
    prompt = [3, 4, 5, 6, 7, 8] * 6
    runs = []
    for engine in (fused, layers):
        logits, native = _recording(engine)
        out = engine.generate([prompt], SamplingParams(max_tokens=40, **GREEDY))[0]
        runs.append((logits, native, out.token_ids, engine.stats()))
    (fused_logits, native, fused_tokens, stats), (layer_logits, _, layer_tokens, _) = runs
    assert stats["spec_draft_tokens"] > 0, "some steps verified drafts"
    assert fused_tokens == layer_tokens
    assert all(torch.equal(a, b) for a, b in zip(fused_logits, layer_logits))
    multi_row = [n for n, logits in zip(native, fused_logits) if logits.shape[0] > 1]
    assert multi_row and all(multi_row), "verify steps (several rows of one request) ran natively"


@needs_kernel
def test_small_steps_lay_prefill_chunks_out_as_single_query_rows(tiny_model_dir):
    from radixserve.core.plan import ScheduledChunk
    from radixserve.core.request import Request
    from radixserve.execution.runner import ROWS_ATTENTION_WORK

    runner = Engine(str(tiny_model_dir("llama"))).runner

    def chunk(start: int, tokens: int) -> ScheduledChunk:
        request = Request("r", list(range(start + tokens)), SamplingParams(max_tokens=1), start + tokens + 1)
        return ScheduledChunk(request, start, tokens)

    limit = runner.row_limit  # 128 on AVX-512, 32 on AVX2
    decodes = [chunk(300, 1) for _ in range(8)]
    assert runner._as_single_query_rows(decodes + [chunk(0, limit - 8)])
    assert not runner._as_single_query_rows(decodes + [chunk(0, limit - 7)]), "too many rows"
    rows = limit // 2
    longest = ROWS_ATTENTION_WORK // rows - rows
    assert runner._as_single_query_rows([chunk(longest, rows)])
    assert not runner._as_single_query_rows([chunk(longest + 1, rows)]), "too much attention for the rows"


@needs_kernel
def test_a_step_mixing_decodes_and_a_prompt_chunk_matches_and_scores_prompts(tiny_model_dir):
    """A short prompt (with prompt logprobs) arriving while others decode: its chunk runs as
    single-query rows in the native decoder's step, bit for bit the layer path's with the
    same layout, and within float rounding of SDPA's (--no-native-decoder)."""
    path = tiny_model_dir("llama")
    fused, layers = _twin_engines(path)
    sdpa = Engine(str(path), native_decoder=False)
    greedy = SamplingParams(max_tokens=12, **GREEDY)
    scored = SamplingParams(max_tokens=6, prompt_logprobs=3, **GREEDY)
    runs = {}
    for name, engine in (("fused", fused), ("layers", layers), ("sdpa", sdpa)):
        logits, native = _recording(engine)
        for prompt in ([5, 9, 2, 7, 1], [8] * 21):
            engine.add_request(prompt, greedy)
        engine.step()
        engine.step()  # both now decode
        engine.add_request([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], scored, request_id="scored")
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
        runs[name] = (logits, native, outputs)
        engine.check_integrity()
    (fused_logits, native, fused_out), (layer_logits, _, layer_out) = runs["fused"], runs["layers"]
    assert all(native), "every step, the mixed one included, ran natively"
    assert all(torch.equal(a, b) for a, b in zip(fused_logits, layer_logits))
    sdpa_out = runs["sdpa"][2]
    for rid, out in fused_out.items():
        assert out.token_ids == layer_out[rid].token_ids == sdpa_out[rid].token_ids
    fused_scores, sdpa_scores = fused_out["scored"].prompt_logprobs, sdpa_out["scored"].prompt_logprobs
    assert fused_scores[0] is None and len(fused_scores) == 14
    for a, b in zip(fused_scores[1:], sdpa_scores[1:]):
        assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


@needs_kernel
def test_the_workspace_is_let_go_at_a_trim_and_made_again(tiny_model_dir):
    """Kept from step to step on the engine's thread; a trim (an idle engine) lets it go and the
    next native step makes it again, with the same tokens."""
    from radixserve.kernels.heap import return_freed_memory
    from radixserve.model import native_decoder

    engine = Engine(str(tiny_model_dir("llama")))
    _, native = _recording(engine)
    params = SamplingParams(max_tokens=6, **GREEDY)
    first = engine.generate([[5, 6, 7, 8]], params)[0].token_ids
    assert any(native) and native_decoder._scratch.workspace is not None
    return_freed_memory()
    assert native_decoder._scratch.workspace is None
    engine.flush_cache()
    assert engine.generate([[5, 6, 7, 8]], params)[0].token_ids == first
    assert native_decoder._scratch.workspace is not None


def test_the_native_decoder_can_be_switched_off(tiny_model_dir):
    engine = Engine(str(tiny_model_dir("llama")), native_decoder=False)
    assert engine.runner.model.native is None and engine.runner.row_limit == 0
    on = Engine(str(tiny_model_dir("llama")))
    greedy = SamplingParams(max_tokens=8, **GREEDY)
    assert engine.generate([[4, 5, 6]], greedy)[0].token_ids == on.generate([[4, 5, 6]], greedy)[0].token_ids


@needs_kernel
def test_steps_it_does_not_take_leave_x_untouched(tiny_model_dir):
    engine = Engine(str(tiny_model_dir("llama")))
    decoder, pool = engine.runner.model.native, engine.runner.pool
    assert isinstance(decoder, NativeDecoder)
    spec = engine.runner.spec
    rope = _tables(spec, 300)
    x = torch.randn(2, spec.hidden_size)
    before, positions, ids = x.clone(), torch.tensor([5, 6]), torch.tensor([7, 8])
    kv_before = pool.kv.clone()
    with_prefill = _plan(num_decodes=1, rows=2)
    for given in (x, None):  # the embedded rows, or the decoder's own lookup
        assert decoder.run(ids, positions, rope, pool, with_prefill, x=given) is None
        too_many = max_rows() + 1
        assert decoder.run(torch.arange(too_many), torch.arange(too_many), rope, pool, _plan(too_many, too_many),
                           x=None if given is None else torch.randn(too_many, spec.hidden_size)) is None
        assert decoder.run(ids, positions, rope, pool, object(), x=given) is None  # another backend's plan
        full_width = (torch.ones(300, spec.head_dim), torch.ones(300, spec.head_dim))  # not a table of half rows
        assert decoder.run(ids, positions, full_width, pool, _plan(2, 2), x=given) is None
        assert decoder.run(ids, positions.int(), rope, pool, _plan(2, 2), x=given) is None
        assert decoder.run(ids.int(), positions, rope, pool, _plan(2, 2), x=given) is None
    assert decoder.run(ids, positions, rope, pool, _plan(2, 2), x=x[:1]) is None  # rows of another shape
    assert torch.equal(x, before) and torch.equal(pool.kv, kv_before)


@needs_kernel
def test_a_slot_outside_the_pool_is_refused_before_anything_is_written(tiny_model_dir):
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=64)  # a small pool: the test copies all of it
    decoder, pool, spec = engine.runner.model.native, engine.runner.pool, engine.runner.spec
    num_slots = pool.kv.shape[2] * pool.kv.shape[3]
    x = torch.randn(1, spec.hidden_size)
    before, kv_before = x.clone(), pool.kv.clone()
    plan = _plan(1, 1, slot=num_slots)
    with pytest.raises(ValueError, match="outside the KV pool"):
        decoder.run(torch.tensor([3]), torch.tensor([0]), _tables(spec, 8), pool, plan, x=x)
    assert torch.equal(x, before) and torch.equal(pool.kv, kv_before)


@needs_kernel
@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_a_token_id_outside_the_embedding_is_refused_before_anything_is_written(tiny_model_dir, weights):
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=64, weight_dtype=weights)
    decoder, pool, spec = engine.runner.model.native, engine.runner.pool, engine.runner.spec
    assert decoder.has_embedding
    kv_before = pool.kv.clone()
    for bad in (spec.vocab_size, -1):
        with pytest.raises(ValueError, match="a token id outside the embedding"):
            decoder.run(torch.tensor([3, bad]), torch.tensor([0, 1]), _tables(spec, 8), pool, _plan(2, 2))
    assert torch.equal(pool.kv, kv_before)
    engine.check_integrity()


@needs_kernel
@pytest.mark.parametrize("position", [8, -1])
def test_a_position_outside_the_rope_table_is_refused_before_anything_is_written(tiny_model_dir, position):
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=64)
    decoder, pool, spec = engine.runner.model.native, engine.runner.pool, engine.runner.spec
    x = torch.randn(2, spec.hidden_size)
    before, kv_before = x.clone(), pool.kv.clone()
    with pytest.raises(ValueError, match="a position outside the RoPE table"):
        decoder.run(torch.tensor([4, 5]), torch.tensor([3, position]), _tables(spec, 8), pool, _plan(2, 2), x=x)
    assert torch.equal(x, before) and torch.equal(pool.kv, kv_before)
    engine.check_integrity()


@needs_kernel
def test_a_logits_row_outside_the_step_is_refused_before_anything_is_written(tiny_model_dir):
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=64, weight_dtype="int8")  # a quantized head
    decoder, pool, spec = engine.runner.model.native, engine.runner.pool, engine.runner.spec
    assert decoder.has_head
    x = torch.randn(1, spec.hidden_size)
    before, kv_before = x.clone(), pool.kv.clone()
    head = HeadRows(torch.tensor([1]))  # the step has one row: row 1 is not in it
    with pytest.raises(ValueError, match="logits row outside the step"):
        decoder.run(torch.tensor([3]), torch.tensor([0]), _tables(spec, 8), pool, _plan(1, 1), head=head, x=x)
    assert torch.equal(x, before) and torch.equal(pool.kv, kv_before) and head.logits is None
    engine.check_integrity()


def test_build_digest_covers_included_sources(tmp_path, monkeypatch):
    from radixserve.kernels import native_build

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "main.c").write_text('#include "part.c"\nint f(void) { return g(); }\n')
    (tmp_path / "part.c").write_text("static int g(void) { return 1; }\n")
    before = native_build.build_path(tmp_path / "main.c", "cc", "cpu")
    (tmp_path / "part.c").write_text("static int g(void) { return 2; }\n")
    assert native_build.build_path(tmp_path / "main.c", "cc", "cpu") != before


def _plan(num_decodes: int, rows: int, slot: int = 0) -> CpuPlan:
    return CpuPlan(
        num_decodes,
        torch.full((rows,), slot, dtype=torch.int64),
        torch.zeros(num_decodes, 1, dtype=torch.int32),
        torch.ones(num_decodes, dtype=torch.int32),
        [],
    )


def test_the_module_imports_on_its_own():
    """native_decoder imports in a fresh interpreter (the model package imports it, it imports model.spec)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import radixserve.model.native_decoder"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _tables(spec, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [positions, head_dim / 2] as RotaryEmbedding.tables gives them."""
    angles = torch.arange(positions, dtype=torch.float32)[:, None] / (1 + torch.arange(spec.head_dim // 2))
    return angles.cos(), angles.sin()
