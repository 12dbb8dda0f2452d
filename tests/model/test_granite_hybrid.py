"""Granite 4.0-H (model/granite_hybrid.py, model/mamba2.py) beyond the recurrent families' shared
tests (test_recurrent_models.py, test_recurrent_prefix_hits.py): its multipliers (embedding,
attention, residual, logits) seen in the logprobs, equal to transformers'; the Mamba2 scan
against the step-by-step recurrence; what it does not run refused fast, naming what runs."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.model.mamba2 import chunked_scan, ssm_step
from tiny_models import hf_logprobs


def test_logprobs_equal_transformers(tiny_model_dir):
    """logits_scaling divides the logits: the logprobs (not only the argmax) must match."""
    directory = tiny_model_dir("granite_hybrid")
    prompt = [random.Random(5).randrange(97) for _ in range(30)]
    engine = Engine(str(directory), block_size=4, num_kv_blocks=64, chunked_prefill_size=16)
    params = SamplingParams(max_tokens=6, logprobs=3, temperature=0.0, ignore_eos=True)
    out = engine.generate([prompt], params)[0]
    reference = hf_logprobs(directory, prompt, out.token_ids)
    for i, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(float(reference[i, lp.token_id]), abs=1e-4)
        values, ids = reference[i].topk(3)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_chunked_scan_equals_the_recurrence_across_blocks():
    """150 tokens from a nonzero state: blocks of 64, 64 and 22, outputs and final state equal
    to 150 single steps."""
    gen = torch.Generator().manual_seed(0)
    n, heads, p, d = 150, 3, 4, 5
    x, b, c = torch.randn(n, heads, p, generator=gen), torch.randn(n, heads, d, generator=gen), torch.randn(
        n, heads, d, generator=gen)
    dt = torch.rand(n, heads, generator=gen) * 0.3
    a = -torch.rand(heads, generator=gen) * 2
    start = torch.randn(heads, p, d, generator=gen)
    scanned = start.clone()
    y = chunked_scan(scanned, x, dt, a, b, c)
    stepped = start.clone()[None]
    ys = torch.stack([ssm_step(stepped, x[i:i + 1], dt[i:i + 1], a, b[i:i + 1], c[i:i + 1])[0] for i in range(n)])
    torch.testing.assert_close(y, ys, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(scanned, stepped[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("field, value, message", [
    ("time_step_limit", [0.0, 0.1], r"time_step_limit .*runs \(0.0, inf\)"),
    ("position_embedding_type", "alibi", r"position_embedding_type 'alibi'.*runs 'rope' and none"),
])
def test_what_it_does_not_run_is_refused_fast(tiny_model_dir, tmp_path, field, value, message):
    source = tiny_model_dir("granite_hybrid")
    for f in source.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        Engine(str(tmp_path))
    assert time.perf_counter() - start < 1.0
