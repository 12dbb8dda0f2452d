"""What a served model holds resident (issue 58): RoPE tables cover the positions steps reach,
not the model's whole context, and grow to the same bits; Gemma 3's 262k-entry embedding is
held once, quantized, and is also its (tied) head: no float copy of either."""

from __future__ import annotations

import pytest
import torch

from radixserve.model import layers
from radixserve.model.layers import RotaryEmbedding
from radixserve.model.spec import ModelSpec
from tiny_models import tiny_config


def _rotary(kind: str, max_positions: int, layer_type: str | None = None) -> RotaryEmbedding:
    spec = ModelSpec.from_hf_config(tiny_config(kind, max_position_embeddings=max_positions))
    return RotaryEmbedding(spec, max_positions, layer_type)


@pytest.mark.parametrize("kind, layer_type", [("llama", None), ("gemma3", "sliding_attention"),
                                              ("gemma3", "full_attention")])
def test_rope_tables_start_small_and_grow_to_the_bits_of_a_whole_table(kind, layer_type):
    rotary = _rotary(kind, 20_000, layer_type)
    assert rotary.cos.shape[0] == rotary.sin.shape[0] == layers._ROPE_INITIAL  # not 20,000 positions
    whole = _rotary(kind, 20_000, layer_type)
    whole._fill(20_000, None)
    early = rotary.lookup(torch.tensor([0, 5, 4095]), torch.float32)

    cos, sin = rotary.lookup(torch.tensor([3, 9000, 4096]), torch.float32)
    assert rotary.cos.shape[0] == max(9001, 2 * layers._ROPE_INITIAL)  # doubled, or as far as the step reads
    want = torch.tensor([3, 9000, 4096])
    assert torch.equal(cos[:, 0], torch.cat((whole.cos[want], whole.cos[want]), -1))
    assert torch.equal(sin[:, 0], torch.cat((whole.sin[want], whole.sin[want]), -1))
    rows = rotary.cos.shape[0]
    assert torch.equal(rotary.cos, whole.cos[:rows]) and torch.equal(rotary.sin, whole.sin[:rows])
    again = rotary.lookup(torch.tensor([0, 5, 4095]), torch.float32)  # positions read before it grew
    assert torch.equal(early[0], again[0]) and torch.equal(early[1], again[1])


def test_rope_tables_never_grow_past_the_context():
    rotary = _rotary("llama", 5000)
    rotary.lookup(torch.tensor([4999]), torch.float32)
    assert rotary.cos.shape[0] == 5000
    with pytest.raises(IndexError):
        rotary.lookup(torch.tensor([5000]), torch.float32)


@pytest.mark.real_model
@pytest.mark.slow
def test_gemma3_holds_its_embedding_once_quantized_and_no_context_long_tables():
    from radixserve.model.loader import load_model

    loaded = load_model("gemma3-270m", device="cpu")
    net, spec = loaded.model, loaded.spec
    assert spec.vocab_size == 262_144 and spec.tie_word_embeddings and net.lm_head is None
    embed = net.embed_tokens
    assert embed.weight is None and embed.quant is not None and embed.quant.kind == "Q8_0"
    # the head reads the same storage (tied): no float tensor holds even a tenth of vocab x hidden
    tenth = spec.vocab_size * spec.hidden_size // 10
    big = [name for name, t in [*net.named_parameters(), *net.named_buffers()] if t.numel() >= tenth]
    assert big == []
    assert embed.quant.nbytes == 262_144 * 640 + 262_144 * 20 * 2  # 8-bit codes, a float16 scale per 32
    for rotary in (net.rotary, net.rotary_local):
        assert rotary.max_positions == 32_768 and rotary.cos.shape[0] == layers._ROPE_INITIAL
    assert net.weight_bytes() < 270 * 2**20  # 267.4 MiB: the embedding 170, the layers 97
    tables = sum(b.numel() * b.element_size() for b in net.buffers())
    assert tables == 2 * 2 * layers._ROPE_INITIAL * 128 * 4  # cos and sin of two RoPE kinds: 8 MiB, not 64
