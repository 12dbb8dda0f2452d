"""RecurrentStep: what a model's recurrent layers (short convolutions, SSM and linear-attention
layers) read in one step: each request's state, and which rows of the flat batch are whose.

A step's rows are the requests' chunks side by side. A chunk of one token (a decode) is a
*single*: all singles of a step advance their states in one batched op. A longer chunk (a
prompt chunk, a decode with its draft) is a *segment*, run over its rows in order from its
request's state. The runner's state pool (execution/recurrent_state.py) builds this per step
and owns the state tensors it points at.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


# One state tensor of one request: its shape, and its dtype (None: the model's).
StateShape = tuple[tuple[int, ...], "torch.dtype | None"]


@dataclass
class Segment:
    first_row: int  # where the chunk's rows begin in the batch
    num_rows: int
    slot: int  # its request's state slot
    keep_history: bool = False  # drafted: keep the state after every row, to roll back to
    keep_after: int = 0  # > 0: also keep the state after this many rows (a snapshot inside a prompt chunk)


@dataclass
class RecurrentStep:
    # per recurrent layer: its state tensors, each [slots, ...]; updated in place by the layer
    states: dict[int, tuple[torch.Tensor, ...]]
    single_rows: torch.Tensor  # int64 rows of one-token chunks
    single_slots: torch.Tensor  # int64 their state slots
    segments: list[Segment]
    # (layer, slot) -> a drafted segment's states after each of its rows: per state tensor,
    # [num_rows + 1, ...], index k the state after its first k rows (written by the layer, read
    # by RecurrentStatePool.settle to keep the accepted rows only)
    history: dict[tuple[int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict)
    # (layer, slot) -> a segment's states after its first keep_after rows (per state tensor, a
    # copy; written by layers whose class sets keeps_inner_states, read by RecurrentStatePool)
    kept: dict[tuple[int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def layer_states(self, layer_index: int) -> tuple[torch.Tensor, ...]:
        return self.states[layer_index]


class RecurrentLayers:
    """The run_layers of a family whose layers take the step's recurrent states besides the KV
    (LFM2, Qwen3.5): mixed into its CausalLM; the runner sets recurrent_step before each forward."""

    recurrent_step: RecurrentStep | None = None

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, backend, pool, plan) -> torch.Tensor:
        step = self.recurrent_step
        if step is None:
            raise RuntimeError(f"a {type(self).__name__} step needs its requests' recurrent states "
                               "(the runner's RecurrentStatePool)")
        rope = self.rotary.lookup(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, backend, pool, plan, step)
        return x

