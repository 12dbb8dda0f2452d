"""The gated delta rule's decode step in C (csrc/delta_rule.c) against the model's torch step
and a float64 reference: the states of the given pool slots advanced in place, no other slot
touched, a bad slot refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.native_build import load_kernel
from radixserve.kernels.native_ops import delta_rule_step_
from radixserve.model.gated_deltanet import delta_rule_step

needs_kernel = pytest.mark.skipif(load_kernel("delta_rule_step_f32") is None, reason="no C compiler here")


def _inputs(slots_in_pool, requests, heads, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(slots_in_pool, heads, dk, dv, generator=gen)
    slots = torch.randperm(slots_in_pool, generator=gen)[:requests]
    q = torch.randn(requests, heads, dk, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(requests, heads, dk, generator=gen), dim=-1)
    v = torch.randn(requests, heads, dv, generator=gen)
    g = -torch.rand(requests, heads, generator=gen) * 2
    beta = torch.rand(requests, heads, generator=gen)
    return pool, slots, q, k, v, g, beta


def _float64_step(state, q, k, v, g, beta):
    s, q, k, v, g, beta = (t.double() for t in (state, q, k, v, g, beta))
    decay = g.exp()[..., None, None]
    u = (v - torch.einsum("dhk,dhkv->dhv", k, s * decay)) * beta[..., None]
    s = s * decay + k[..., :, None] * u[..., None, :]
    return torch.einsum("dhk,dhkv->dhv", q, s), s


@needs_kernel
@pytest.mark.parametrize("requests, heads, dk, dv", [(1, 2, 16, 16), (3, 4, 16, 24), (8, 16, 128, 128), (5, 3, 8, 40)])
def test_the_c_step_advances_the_slots_states_as_the_torch_step_does(requests, heads, dk, dv):
    pool, slots, q, k, v, g, beta = _inputs(requests + 3, requests, heads, dk, dv, seed=requests)
    want_out, want_states = _float64_step(pool[slots], q, k, v, g, beta)
    torch_pool = pool.clone()
    states = torch_pool[slots]
    torch_out = delta_rule_step(states, q, k, v, g, beta)
    torch_pool[slots] = states
    before = pool.clone()
    out = delta_rule_step_(pool, slots, q, k, v, g, beta)
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pool[slots].double(), want_states, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, torch_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pool, torch_pool, atol=2e-5, rtol=2e-5)
    others = torch.ones(pool.shape[0], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(pool[others], before[others])


@needs_kernel
def test_a_slot_outside_the_pool_is_refused_before_anything_is_written():
    pool, slots, q, k, v, g, beta = _inputs(6, 2, 2, 8, 8, seed=1)
    before = pool.clone()
    with pytest.raises(IndexError, match="outside the pool"):
        delta_rule_step_(pool, torch.tensor([slots[0].item(), 6]), q, k, v, g, beta)
    assert torch.equal(pool, before)


def test_what_the_kernel_cannot_take_is_left_to_the_torch_step():
    pool, slots, q, k, v, g, beta = _inputs(6, 2, 2, 8, 8, seed=2)
    assert delta_rule_step_(pool.double(), slots, q, k, v, g, beta) is None
    assert delta_rule_step_(pool, slots.int(), q, k, v, g, beta) is None
    assert delta_rule_step_(pool, slots, q[:, :1], k, v, g, beta) is None
