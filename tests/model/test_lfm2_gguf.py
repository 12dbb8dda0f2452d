"""LFM2 from a GGUF file as llama.cpp's converter writes it (architecture lfm2: per-layer kv heads,
0 on conv layers; the conv weight squeezed to [C, L]; the final norm as token_embd_norm): greedy
equal to transformers token for token, through a prefix hit on the kept conv states; quantized
tensors served as stored."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve import Engine
from tiny_gguf import write_gguf
from tiny_models import hf_greedy, run_checked



def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


def gguf_greedy(path, prompt, n):
    """transformers on the GGUF itself (its tensors dequantized to float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def turns(engine, reference):
    """A prompt, then the next turn (prompt + reply + new tokens) resumed from the kept state."""
    prompt = tokens(21, seed=1)
    (first,) = run_checked(engine, [prompt], 8)
    assert first.cached_tokens == 0 and first.token_ids == reference(prompt, 8)
    follow = prompt + first.token_ids + tokens(6, seed=2)
    (second,) = run_checked(engine, [follow], 8)
    assert second.cached_tokens == 21 + 8 - 1  # the reply's end, where its state was kept
    assert second.token_ids == reference(follow, 8)
    assert engine.stats()["recurrent_snapshot_restores"] == 1


@pytest.mark.parametrize("kind", ["lfm2", "lfm2_bias"])
def test_a_float_gguf_is_greedy_equal_to_transformers_on_the_checkpoint(tiny_model_dir, tmp_path, kind):
    directory = tiny_model_dir(kind)
    path = write_gguf(directory, tmp_path / f"tiny-{kind}.gguf", quant="F32")
    engine = Engine(str(path), block_size=4, num_kv_blocks=128, chunked_prefill_size=9, max_num_batched_tokens=32)
    assert engine.loaded.spec.family == "lfm2" and engine.loaded.spec.recurrent_layers == (0, 1, 3)
    turns(engine, lambda p, n: hf_greedy(directory, p, n))


def test_a_q8_gguf_is_served_as_stored_and_greedy_equal_to_transformers_on_the_file(tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir("lfm2"), tmp_path / "tiny-lfm2.Q8_0.gguf", quant="Q8_0")
    engine = Engine(str(path), block_size=4, num_kv_blocks=128, chunked_prefill_size=9, max_num_batched_tokens=32)
    assert engine.stats()["weight_dtype"] == "gguf:Q8_0"
    layers = engine.runner.model.layers
    assert layers[0].conv.in_proj.quant.kind == "Q8_0" and layers[2].self_attn.qkv_proj.quant.kind == "Q8_0"
    turns(engine, lambda p, n: gguf_greedy(path, p, n))
