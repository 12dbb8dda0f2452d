"""TritonAttentionBackend against the torch backend: one mixed step by hand, and whole
greedy generations on a tiny random model (mixed batches, a prefix-cache hit).

On CPU the kernels run in Triton's interpreter; RADIXSERVE_TEST_DEVICE=cuda runs them
compiled on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from radixserve.kernels.triton import configure_triton  # imports no triton

DEVICE = torch.device(os.environ.get("RADIXSERVE_TEST_DEVICE", "cpu"))
configure_triton(DEVICE)  # before triton's first import
pytest.importorskip("triton")

from radixserve import Engine, SamplingParams  # noqa: E402
from radixserve.attention.metadata import AttentionMetadata  # noqa: E402
from radixserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from radixserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


# ---- one step, by hand -------------------------------------------------------------------


def _metadata(requests: list[tuple[int, int, list[int]]], block_size: int) -> AttentionMetadata:
    """requests: (context length after the step, new tokens, block table), decodes first."""
    starts, slots = [0], []
    for context, new, table in requests:
        starts.append(starts[-1] + new)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(context - new, context)]
    width = max(len(t) for _, _, t in requests)
    tables = [t + [0] * (width - len(t)) for _, _, t in requests]
    seq_lens = [context for context, _, _ in requests]
    return AttentionMetadata(
        num_decodes=sum(1 for _, new, _ in requests if new == 1),
        block_size=block_size,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc_list=starts,
        seq_lens_list=seq_lens,
    )


def test_mixed_step_matches_torch_backend():
    torch.manual_seed(0)
    num_heads, kv_heads, head_dim, block_size = 6, 2, 16, 4
    shared = [7, 3]  # two cached blocks every request but the last starts with
    requests = [
        (9, 1, shared + [11, 12, 13]),  # decodes
        (1, 1, [20]),
        (5, 1, [7, 21]),  # a decode sharing one block
        (8 + 6, 6, shared + [14, 15]),  # prefix entirely cached
        (8 + 2 + 5, 5, shared + [16, 17]),  # prefix partly cached: 2 tokens of its own came earlier
        (6, 6, [18, 19]),  # no prefix
    ]
    meta = _metadata(requests, block_size)
    tokens = meta.query_start_loc_list[-1]
    q = torch.randn(tokens, num_heads, head_dim, device=DEVICE)
    k, v = (torch.randn(tokens, kv_heads, head_dim, device=DEVICE) for _ in range(2))
    pool = torch.randn(2, 24, block_size, kv_heads, head_dim, device=DEVICE)
    outputs, pools = [], []
    for backend_class in (TorchAttentionBackend, TritonAttentionBackend):
        backend = backend_class(num_heads, kv_heads, head_dim, head_dim**-0.5)
        caches = pool.clone()
        plan = backend.prepare(meta)
        outputs.append(backend.forward(q, k, v, caches[0], caches[1], plan))
        pools.append(caches)
    assert torch.equal(pools[0], pools[1])
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)


# ---- whole generations --------------------------------------------------------------------


def _engine(model_dir, backend: str, **options) -> Engine:
    options = dict(block_size=4, num_kv_blocks=200, **options)
    return Engine(str(model_dir), attention_backend=backend, device=str(DEVICE), dtype="float32", **options)


def _record_step_shapes(engine: Engine) -> list[tuple[int, int]]:
    """(num_decodes, num_requests) of every step the engine runs from now on."""
    shapes: list[tuple[int, int]] = []
    backend = engine.runner.backend
    prepare = backend.prepare

    def recording_prepare(meta):
        shapes.append((meta.num_decodes, meta.num_requests))
        return prepare(meta)

    backend.prepare = recording_prepare
    return shapes


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_mixed_batches_match_torch_backend(tiny_model_dir, kind):
    model_dir = tiny_model_dir(kind)
    prompts = [[(7 * i + j) % 97 for j in range(n)] for i, n in enumerate([3, 11, 20, 9])]
    chunked = dict(chunked_prefill_size=7, max_num_batched_tokens=16)
    expected = [o.token_ids for o in _engine(model_dir, "torch", **chunked).generate(prompts, GREEDY)]
    engine = _engine(model_dir, "triton", **chunked)
    shapes = _record_step_shapes(engine)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
    assert any(0 < decodes < requests for decodes, requests in shapes), "no step mixed decodes and prefill chunks"


def test_shared_prefix_hit_matches_torch_backend(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    common = [(5 * j + 1) % 97 for j in range(12)]
    first, second = common + [3, 1, 4, 1, 5], common + [9, 2, 6, 5, 3, 5]
    results = {}
    for backend in ("torch", "triton"):
        engine = _engine(model_dir, backend, enable_prefix_cache=True)
        outs = [engine.generate([prompt], GREEDY)[0] for prompt in (first, second)]
        results[backend] = [(o.token_ids, o.cached_tokens) for o in outs]
    assert results["triton"] == results["torch"]
    assert results["triton"][1][1] == len(common), "the second prompt should reuse the first's 12 cached tokens"


# ---- packaging ---------------------------------------------------------------------------


def test_package_imports_without_triton():
    code = (
        "import radixserve, sys; from radixserve import Engine; "
        "import radixserve.attention.triton_backend, radixserve.kernels.triton; "
        "assert 'triton' not in sys.modules, 'triton imported eagerly'"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
