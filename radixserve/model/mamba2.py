"""Mamba2Mixer: the Mamba2 (SSD) layer of the Mamba2 hybrids (Granite 4.0-H), over a flat batch.

in_proj yields a gate z, the conv inputs (x, B, C) and dt per head. A causal depthwise conv
(SiLU) runs over x, B, C; then per head h a state S [head dim, state dim] that every token
decays and writes to:

    dt_t = softplus(dt_t + dt_bias);   S <- exp(dt_t A) S + dt_t x_t B_t^T;   y_t = S C_t + D x_t

with A = -exp(A_log) (held as A, as llama.cpp's GGUF stores it), B and C shared by the heads of
a group. y is gated by SiLU(z), RMS-normed
per group and projected. A request's state: the conv's last inputs and S per head (float32,
as transformers keeps it). Decodes advance S one step, batched (`ssm_step`); a prompt chunk
runs the chunked (SSD) form (`chunked_scan`), SCAN_BLOCK tokens a block: within a block the
outputs are one masked matmul, and S is carried across blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.layers import Linear
from radixserve.model.recurrent_step import RecurrentStep, StateShape
from radixserve.model.short_conv import DepthwiseConv, causal_conv

SCAN_BLOCK = 64  # tokens per block of the chunked form


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, num_groups: int, state_size: int,
                 conv_width: int, conv_bias: bool, proj_bias: bool, eps: float, layer_index: int):
        super().__init__()
        if num_heads % num_groups:
            raise ValueError(f"{num_heads} Mamba2 heads are not a multiple of {num_groups} groups")
        self.layer_index = layer_index
        self.num_heads, self.head_dim, self.num_groups, self.state_size = num_heads, head_dim, num_groups, state_size
        self.inner = num_heads * head_dim
        self.conv_dim = self.inner + 2 * num_groups * state_size
        self.in_proj = Linear(hidden_size, self.inner + self.conv_dim + num_heads, bias=proj_bias)
        self.conv1d = DepthwiseConv(self.conv_dim, conv_width, conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.A = nn.Parameter(torch.empty(num_heads))  # -exp(A_log)
        self.D = nn.Parameter(torch.empty(num_heads))
        self.norm = GroupedGatedRMSNorm(self.inner, num_groups, eps)
        self.out_proj = Linear(self.inner, hidden_size, bias=proj_bias)

    def state_shapes(self) -> tuple[StateShape, ...]:
        """The conv's last inputs (the model's dtype), and S per head (float32)."""
        width = self.conv1d.weight.shape[-1]
        return (((self.conv_dim, width - 1), None),
                ((self.num_heads, self.head_dim, self.state_size), torch.float32))

    keeps_inner_states = True  # honours Segment.keep_after

    def forward(self, x: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        t, heads, groups = x.shape[0], self.num_heads, self.num_groups
        conv_state, ssm_state = step.layer_states(self.layer_index)
        gate, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, heads], dim=-1)
        conv_kept: dict[int, torch.Tensor] = {}
        xbc, conv_history = causal_conv(xbc, conv_state, self.conv1d.weight, self.conv1d.bias, step, conv_kept)
        xs, b, c = F.silu(xbc).float().split([self.inner, groups * self.state_size, groups * self.state_size], dim=-1)
        xs = xs.reshape(t, heads, self.head_dim)
        b, c = (m.reshape(t, groups, self.state_size).repeat_interleave(heads // groups, dim=1) for m in (b, c))
        dt = F.softplus(dt.float() + self.dt_bias.float())  # [T, H]
        a = self.A.float()
        y = self._recur(xs, dt, a, b, c, ssm_state, conv_history, conv_kept, step)
        y = y + self.D.float()[:, None] * xs
        return self.out_proj(self.norm(y.reshape(t, self.inner), gate).to(x.dtype))

    def _recur(self, xs, dt, a, b, c, ssm_state: torch.Tensor, conv_history: dict[int, torch.Tensor],
               conv_kept: dict[int, torch.Tensor], step: RecurrentStep) -> torch.Tensor:
        out = torch.empty_like(xs)  # [T, H, P] float32
        if step.single_rows.numel():
            rows, slots = step.single_rows, step.single_slots
            state = ssm_state[slots]
            out[rows] = ssm_step(state, xs[rows], dt[rows], a, b[rows], c[rows])
            ssm_state[slots] = state
        for seg in step.segments:
            rows = slice(seg.first_row, seg.first_row + seg.num_rows)
            state = ssm_state[seg.slot]
            if seg.keep_history:  # a drafted segment: token by token, keeping every state
                states = [state.clone()]
                for r in range(seg.first_row, seg.first_row + seg.num_rows):
                    one = slice(r, r + 1)
                    out[r] = ssm_step(state[None], xs[one], dt[one], a, b[one], c[one])[0]
                    states.append(state.clone())
                step.history[(self.layer_index, seg.slot)] = (conv_history[seg.slot], torch.stack(states))
            elif seg.keep_after:  # in two runs, the state between them kept
                first = seg.first_row + seg.keep_after
                for part in (slice(seg.first_row, first), slice(first, rows.stop)):
                    out[part] = chunked_scan(state, xs[part], dt[part], a, b[part], c[part])
                    if part.start == seg.first_row:
                        step.kept[(self.layer_index, seg.slot)] = (conv_kept[seg.slot], state.clone())
            else:
                out[rows] = chunked_scan(state, xs[rows], dt[rows], a, b[rows], c[rows])
        return out


def ssm_step(state: torch.Tensor, x, dt, a, b, c) -> torch.Tensor:
    """One token each of D requests: state [D, H, P, N] (float32) advanced in place; x [D, H, P],
    dt [D, H], a [H], b, c [D, H, N]. Returns y [D, H, P] (without the D x skip)."""
    state.mul_((dt * a).exp()[..., None, None])
    state.add_((dt[..., None] * x)[..., None] * b[:, :, None, :])
    return torch.einsum("dhpn,dhn->dhp", state, c)


def chunked_scan(state: torch.Tensor, x, dt, a, b, c, block: int = SCAN_BLOCK) -> torch.Tensor:
    """The rows of one request from its state [H, P, N] (advanced in place), SCAN_BLOCK tokens
    at a time; x [n, H, P], dt [n, H], b, c [n, H, N]. Returns y [n, H, P] (without the skip).

    Within a block, with G_i the cumulative log decay (sum of dt_j a up to i) and
    L_ij = exp(G_i - G_j) (j <= i):
      y_i = exp(G_i) S0 c_i + sum_{j<=i} L_ij (c_i.b_j) dt_j x_j;
      S = exp(G_n) S0 + sum_j exp(G_n - G_j) dt_j x_j b_j^T."""
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], block):
        end = min(start + block, x.shape[0])
        n = end - start
        # heads first: [H, n, ...]
        xb = (x[start:end] * dt[start:end, :, None]).transpose(0, 1)  # dt_j x_j [H, n, P]
        bb, cb = b[start:end].transpose(0, 1), c[start:end].transpose(0, 1)  # [H, n, N]
        cum = (dt[start:end] * a).t().cumsum(-1)  # [H, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # L [H, n, n]
        y = ((cb @ bb.transpose(1, 2)) * decay) @ xb  # [H, n, P]
        y = y + cum.exp()[..., None] * (cb @ state.transpose(1, 2))
        out[start:end] = y.transpose(0, 1)
        tail = (cum[:, -1:] - cum).exp()[..., None] * xb  # [H, n, P]
        state.mul_(cum[:, -1].exp()[:, None, None]).add_(tail.transpose(1, 2) @ bb)
    return out


class GroupedGatedRMSNorm(nn.Module):
    """SiLU(gate) times x, RMS-normed over each of `groups` equal slices, times weight
    (transformers' order for Mamba2: gated first, in float32; weighted in the input's dtype)."""

    def __init__(self, size: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups = groups
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        h = h.reshape(*h.shape[:-1], self.groups, -1)
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).reshape(x.shape)
        return self.weight * h.to(dtype)
