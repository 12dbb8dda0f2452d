"""ShortConv: a gated short causal convolution (LFM2's `conv` layers) over a flat batch.

    B, C, h = in_proj(x) in three;  y[t] = sum_k w[k] * (B * h)[t - L + 1 + k];  out_proj(C * y)

A depthwise convolution of width L over the sequence of B * h: a request's state is the last
L - 1 of those inputs (zeros before its first token), [channels, L - 1] per layer. Every chunk
is convolved over its request's state followed by its own inputs, the same op transformers runs
(F.conv1d, groups = channels), so a prompt split into chunks gives what one pass gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.layers import Linear
from radixserve.model.recurrent_step import RecurrentStep, StateShape


class DepthwiseConv(nn.Module):
    """A depthwise conv's parameters, named as nn.Conv1d names them (weight [C, 1, L])."""

    def __init__(self, channels: int, width: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None


class ShortConv(nn.Module):
    def __init__(self, hidden_size: int, width: int, bias: bool, layer_index: int):
        super().__init__()
        if width < 2:
            raise ValueError(f"a short convolution of width {width}: radixserve runs widths of 2 or more")
        self.layer_index = layer_index
        self.hidden_size = hidden_size
        self.width = width
        self.in_proj = Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.conv = DepthwiseConv(hidden_size, width, bias)
        self.out_proj = Linear(hidden_size, hidden_size, bias=bias)

    def state_shapes(self) -> tuple[StateShape, ...]:
        """One request's state: the last width - 1 inputs of every channel (the model's dtype)."""
        return (((self.hidden_size, self.width - 1), None),)

    keeps_inner_states = True  # honours Segment.keep_after

    def forward(self, x: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        b, c, h = self.in_proj(x).split(self.hidden_size, dim=-1)
        return self.out_proj(c * self.convolve(b * h, step))

    def convolve(self, inputs: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        (state,) = step.layer_states(self.layer_index)
        kept: dict[int, torch.Tensor] = {}
        y, history = causal_conv(inputs, state, self.conv.weight, self.conv.bias, step, kept)
        for slot, states in history.items():
            step.history[(self.layer_index, slot)] = (states,)
        for slot, conv in kept.items():
            step.kept[(self.layer_index, slot)] = (conv,)
        return y


def causal_conv(inputs: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                step: RecurrentStep, kept: dict[int, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """y [T, C] of inputs [T, C] by a depthwise causal conv (weight [C, 1, width]), each request's
    state [slots, C, width - 1] advanced past its rows in place. Also, per drafted segment's
    slot, its states after each of its rows: [n + 1, C, width - 1]; and into `kept`, per
    segment with keep_after, a copy of its state after that many rows."""
    channels, keep = inputs.shape[1], weight.shape[-1] - 1
    out = torch.empty_like(inputs)
    history: dict[int, torch.Tensor] = {}
    if step.single_rows.numel():
        rows, slots = step.single_rows, step.single_slots
        seq = torch.cat((state[slots], inputs[rows].unsqueeze(-1)), dim=-1)  # [D, C, width]
        out[rows] = F.conv1d(seq, weight, bias, groups=channels)[..., 0]
        state[slots] = seq[..., 1:]
    for seg in step.segments:
        rows = slice(seg.first_row, seg.first_row + seg.num_rows)
        seq = torch.cat((state[seg.slot], inputs[rows].t()), dim=-1)  # [C, width - 1 + n]
        out[rows] = F.conv1d(seq.unsqueeze(0), weight, bias, groups=channels)[0].t()
        state[seg.slot] = seq[:, -keep:]
        if seg.keep_history:  # the state after k rows: seq[:, k : k + width - 1]
            history[seg.slot] = seq.unfold(1, keep, 1).transpose(0, 1).clone()
        if seg.keep_after and kept is not None:
            kept[seg.slot] = seq[:, seg.keep_after:seg.keep_after + keep].clone()
    return out, history
