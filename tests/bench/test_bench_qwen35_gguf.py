"""bench/lib/qwen35_gguf.py's random-weight Qwen3.5 file, at a tiny shape (more value heads than
key heads, so the tiled order is in play): radixserve reads its config from the header as the
shape says and serves its Q4_0 blocks as stored, through a prefix hit on the kept state.
(Correctness of the qwen35 layout against transformers: tests/model/test_qwen3_5_gguf.py.)"""

from __future__ import annotations

from bench.lib.qwen35_gguf import Qwen35Shape, random_qwen35_gguf
from radixserve import Engine, SamplingParams

TINY = Qwen35Shape("qwen35-tiny", hidden=64, layers=4, heads=4, kv_heads=2, head_dim=32, ffn=128, k_heads=2,
                   v_heads=4, head_k=32, vocab=512)


def test_the_random_file_is_served_as_its_shape_says(tmp_path):
    path = random_qwen35_gguf(TINY, tmp_path / "tiny.gguf")
    engine = Engine(str(path), block_size=4, num_kv_blocks=64)
    spec, config = engine.loaded.spec, engine.loaded.spec.hf_config
    assert engine.stats()["weight_dtype"] == "gguf:Q4_0" and spec.family == "qwen3_5"
    assert spec.recurrent_layers == (0, 1, 2) and TINY.attention == (3,)
    assert (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (64, 4, 2, 32, 512)
    assert (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_value_head_dim) == (2, 4, 32)
    assert engine.runner.model.lm_head is None  # tied
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [300 + (7 * i) % 200 for i in range(19)]
    (first,) = engine.generate([prompt], params, use_tqdm=False)
    (again,) = engine.generate([prompt], params, use_tqdm=False)
    assert again.cached_tokens == 16 and list(again.token_ids) == list(first.token_ids)
    engine.check_integrity()
