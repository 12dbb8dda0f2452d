"""GatedDeltaNet: the linear-attention layer of Qwen3.5 (and Qwen3-Next), over a flat batch.

A short causal conv (SiLU) over the concatenated q, k, v projections, then per value head a
state S [key dim, value dim] that every token decays and corrects by the delta rule:

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

with q, k L2-normalized (q also scaled by key_dim ** -0.5), g_t = A softplus(a_t + dt_bias)
(A = -exp(A_log), held as A, as llama.cpp's GGUF stores it) and beta_t = sigmoid(b_t).
With more value heads than key heads, the value heads are held in llama.cpp's tiled order
(value head i reads key head i % num_k_heads; transformers groups them by key head: a
transformers checkpoint's value-head rows and columns are reordered once at load, qwen3_5.py).
The output is RMS-normed per head, gated by SiLU(z) and
projected. A request's state: the conv's last inputs and S per head (float32, as transformers
keeps it). Decodes advance S one step, batched: in place in the state pool by the C step
(kernels/native_ops.delta_rule_step_), else `delta_rule_step` on the gathered states; a prompt chunk runs the
chunked form (`chunked_delta_rule`), 64 tokens a block: within a block the corrections solve
one unit-triangular system, and S is carried across blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels.native_ops import delta_rule_step_
from radixserve.model.layers import Linear
from radixserve.model.recurrent_step import RecurrentStep, StateShape
from radixserve.model.short_conv import DepthwiseConv, causal_conv

SCAN_BLOCK = 64  # tokens per block of the chunked form


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_width: int, eps: float, layer_index: int):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"{num_v_heads} value heads are not a multiple of {num_k_heads} key heads")
        self.layer_index = layer_index
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.eps = eps
        self.in_proj_qkv = Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = Linear(hidden_size, num_v_heads, bias=False)
        self.conv1d = DepthwiseConv(self.conv_dim, conv_width, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads))
        self.A = nn.Parameter(torch.empty(num_v_heads))  # -exp(A_log)
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden_size, bias=False)

    def state_shapes(self) -> tuple[StateShape, ...]:
        """The conv's last inputs (the model's dtype), and S per value head (float32)."""
        width = self.conv1d.weight.shape[-1]
        return (((self.conv_dim, width - 1), None),
                ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32))

    keeps_inner_states = True  # honours Segment.keep_after

    def forward(self, x: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        t = x.shape[0]
        conv_state, ssm_state = step.layer_states(self.layer_index)
        conv_kept: dict[int, torch.Tensor] = {}
        mixed, conv_history = causal_conv(self.in_proj_qkv(x), conv_state, self.conv1d.weight, None, step, conv_kept)
        q, k, v = F.silu(mixed).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (self._heads(h.reshape(t, self.num_k_heads, self.head_k_dim)) for h in (q, k))
        q = q * self.head_k_dim**-0.5
        v = v.reshape(t, self.num_v_heads, self.head_v_dim).float()
        beta = self.in_proj_b(x).sigmoid().float()
        g = self.A.float() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        out = self._recur(q, k, v, g, beta, ssm_state, conv_history, step, conv_kept)
        z = self.in_proj_z(x).reshape(t, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(out.to(x.dtype), z).reshape(t, self.value_dim))

    def _heads(self, h: torch.Tensor) -> torch.Tensor:
        """Key heads, L2-normalized in float32, tiled over the value heads (value head i: key head
        i % num_k_heads)."""
        h = h.float()
        h = h * torch.rsqrt((h * h).sum(-1, keepdim=True) + 1e-6)
        return h.repeat(1, self.num_v_heads // self.num_k_heads, 1)

    def _recur(self, q, k, v, g, beta, ssm_state: torch.Tensor, conv_history: dict[int, torch.Tensor],
               step: RecurrentStep, conv_kept: dict[int, torch.Tensor]) -> torch.Tensor:
        out = torch.empty_like(v)  # [T, H, Dv] float32
        if step.single_rows.numel():
            rows, slots = step.single_rows, step.single_slots
            fused = delta_rule_step_(ssm_state, slots, q[rows].contiguous(), k[rows].contiguous(),
                                     v[rows].contiguous(), g[rows].contiguous(), beta[rows].contiguous())
            if fused is not None:
                out[rows] = fused
            else:
                state = ssm_state[slots]
                out[rows] = delta_rule_step(state, q[rows], k[rows], v[rows], g[rows], beta[rows])
                ssm_state[slots] = state
        for seg in step.segments:
            rows = slice(seg.first_row, seg.first_row + seg.num_rows)
            state = ssm_state[seg.slot]
            if seg.keep_history:  # a drafted segment: token by token, keeping every state
                states = [state.clone()]
                for r in range(seg.first_row, seg.first_row + seg.num_rows):
                    out[r] = delta_rule_step(state[None], q[r:r + 1], k[r:r + 1], v[r:r + 1], g[r:r + 1],
                                             beta[r:r + 1])[0]
                    states.append(state.clone())
                step.history[(self.layer_index, seg.slot)] = (conv_history[seg.slot], torch.stack(states))
            elif seg.keep_after:  # in two runs, the state between them kept
                first = seg.first_row + seg.keep_after
                for part in (slice(seg.first_row, first), slice(first, rows.stop)):
                    out[part] = chunked_delta_rule(state, q[part], k[part], v[part], g[part], beta[part])
                    if part.start == seg.first_row:
                        step.kept[(self.layer_index, seg.slot)] = (conv_kept[seg.slot], state.clone())
            else:
                out[rows] = chunked_delta_rule(state, q[rows], k[rows], v[rows], g[rows], beta[rows])
        return out


def delta_rule_step(state: torch.Tensor, q, k, v, g, beta) -> torch.Tensor:
    """One token each of D requests: state [D, H, Dk, Dv] (float32) advanced in place; q, k
    [D, H, Dk], v [D, H, Dv], g, beta [D, H]. Returns o [D, H, Dv].

    S is the bulk of a decode's memory traffic (Dk x Dv floats a head), so it is read once for
    both S^T k and S^T q, then scaled and updated in place: with S' = e^g S + k u^T,
    u = beta (v - e^g S^T k) and o = S'^T q = e^g S^T q + (k.q) u."""
    d, h, dk, dv = state.shape
    decay = g.exp()[..., None]  # [D, H, 1]
    read = torch.matmul(torch.stack((k, q), dim=-2), state) * decay[..., None]  # [D, H, 2, Dv]: one pass over S
    update = (v - read[..., 0, :]) * beta[..., None]
    state.mul_(decay[..., None])
    state.view(d * h, dk, dv).baddbmm_(k.reshape(d * h, dk, 1), update.reshape(d * h, 1, dv))
    return read[..., 1, :] + (k * q).sum(-1, keepdim=True) * update


def chunked_delta_rule(state: torch.Tensor, q, k, v, g, beta, block: int = SCAN_BLOCK) -> torch.Tensor:
    """The rows of one request from its state [H, Dk, Dv] (advanced in place), SCAN_BLOCK tokens
    at a time; q, k [n, H, Dk], v [n, H, Dv], g, beta [n, H]. Returns o [n, H, Dv].

    Within a block, with G_i the cumulative log decay and D_ij = exp(G_i - G_j) (j <= i):
      corrections U solve (I + L) U = beta V - beta exp(G) K S0, L_ij = beta_i D_ij k_i.k_j (j < i);
      o_i = exp(G_i) S0^T q_i + sum_{j<=i} D_ij (q_i.k_j) u_j;
      S = exp(G_n) S0 + sum_j exp(G_n - G_j) k_j u_j^T."""
    out = torch.empty_like(v)
    for start in range(0, q.shape[0], block):
        end = min(start + block, q.shape[0])
        # heads first: [H, n, ...]
        qb, kb, vb = (x[start:end].transpose(0, 1) for x in (q, k, v))
        gb, bb = g[start:end].t(), beta[start:end].t()
        cum = gb.cumsum(-1)  # [H, n]
        n = end - start
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # D [H, n, n]
        kk = kb @ kb.transpose(1, 2)
        lower = (bb[:, :, None] * kk * decay).tril(-1)
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        rhs = bb[..., None] * (vb - (cum.exp()[..., None] * kb) @ state)
        u = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
        o = (cum.exp()[..., None] * qb) @ state + ((qb @ kb.transpose(1, 2)) * decay) @ u
        out[start:end] = o.transpose(0, 1)
        tail = (cum[:, -1:] - cum).exp()[..., None] * kb  # [H, n, Dk]
        state.mul_(cum[:, -1].exp()[:, None, None]).add_(tail.transpose(1, 2) @ u)
    return out


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output, times weight, times SiLU(gate) (transformers' order:
    normalized in float32, weighted in the input's dtype, gated in float32)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)
