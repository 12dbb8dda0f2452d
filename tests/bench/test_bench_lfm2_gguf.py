"""bench/lib/lfm2_gguf.py's random-weight LFM2 file, at a tiny shape: transformers reads it as an
LFM2 (the conv layers where the per-layer kv heads are 0), radixserve serves its Q4_0 blocks as
stored, and both give the same greedy tokens."""

from __future__ import annotations

import torch

from bench.lib.lfm2_gguf import Lfm2Shape, random_lfm2_gguf
from radixserve import Engine, SamplingParams

TINY = Lfm2Shape("lfm2-tiny", hidden=64, layers=4, attention=(2,), heads=4, kv_heads=2, ffn=128, conv=3, vocab=512)


def test_the_random_file_is_an_lfm2_that_radixserve_serves_as_transformers_reads_it(tmp_path):
    from transformers import AutoModelForCausalLM

    path = random_lfm2_gguf(TINY, tmp_path / "tiny.gguf")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    assert reference.config.layer_types == ["conv", "conv", "full_attention", "conv"]
    assert reference.config.num_key_value_heads == 2 and reference.config.intermediate_size == 128
    engine = Engine(str(path), block_size=4, num_kv_blocks=64)
    assert engine.stats()["weight_dtype"] == "gguf:Q4_0" and engine.loaded.spec.recurrent_layers == (0, 1, 3)
    prompt = [300 + (7 * i) % 200 for i in range(19)]
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    ids = torch.tensor([prompt])
    want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert list(out.token_ids) == want
    engine.check_integrity()
