"""RoPE tables keep one half of head_dim; a step's lookup gives exactly the full-width values
transformers' cat((freqs, freqs)) makes, for every RoPE kind a model has."""

from __future__ import annotations

import pytest
import torch

from radixserve.model.layers import _rope_inv_freq
from radixserve.model.loader import load_model


def _full_width(rotary, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq, scaling = _rope_inv_freq(rotary.spec, rotary.layer_type)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_lookup_is_the_full_width_table_from_half_of_it(tiny_model_dir, kind):
    model = load_model(str(tiny_model_dir(kind)), device="cpu").model
    tables = [model.rotary] + ([model.rotary_local] if kind == "gemma3" else [])
    positions = torch.tensor([0, 1, 7, 100, 255, 3])
    for rotary in tables:
        head_dim = rotary.spec.head_dim
        assert tuple(rotary.cos.shape) == tuple(rotary.sin.shape) == (256, head_dim // 2)
        cos, sin = rotary.lookup(positions, torch.float32)
        want_cos, want_sin = _full_width(rotary, 256)
        assert cos.shape == (6, 1, head_dim)
        assert torch.equal(cos[:, 0], want_cos[positions]) and torch.equal(sin[:, 0], want_sin[positions])
        assert rotary.lookup(positions, torch.bfloat16)[0].dtype == torch.bfloat16
