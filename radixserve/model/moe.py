"""SparseMoE: a mixture-of-experts MLP over a flat batch of rows [T, hidden] (Qwen3-MoE).

The router scores every expert for every row (softmax over its logits), keeps each row's top k
(renormalised to sum to 1 where the family says), and the (row, expert) pairs are grouped per
expert by one stable sort: each selected expert multiplies its own rows once, so a decode step
reads only the selected experts' weights. A row's expert outputs are summed in ascending expert
order, as transformers sums them.

A family may add a shared expert (Qwen3.5-MoE, Qwen2-MoE): a dense MLP every row goes through,
scaled by sigmoid of its own one-output gate, added to the routed sum (`shared_expert`,
`shared_expert_gate`, named as transformers names them under the MoE block).

Experts are held float ([E, 2I, H] gate/up and [E, H, I] down, from a transformers checkpoint)
or quantized as the GGUF stores them: one QuantWeight per expert and projection (gate/up fused),
multiplied by the quantized kernels. At decode sizes quantized experts take one C call a layer
(kernels/moe_experts.py: routing, grouping, every selected expert's three products and the sum);
prompt-sized steps on AVX2 and float experts go an expert at a time (`forward_per_expert`, through
layers.quantized_linear), which is also the C call's reference.

Checkpoints name experts three ways, all taken (`expert_weights`): per expert
(mlp.experts.E.gate_proj.weight: transformers' save format), fused (mlp.experts.gate_up_proj
[E, 2I, H], mlp.experts.down_proj [E, H, I]), or stacked as a GGUF stores them
(mlp.experts.gate_proj.weight, [E, I, H] float or [E * I, H] quantized).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels.moe_experts import QuantExperts
from radixserve.kernels.native_ops import max_rows, silu_mul
from radixserve.kernels.quant_linear import QuantWeight, concat_rows, lanes_preferred
from radixserve.model.layers import Linear, linear, quantized_linear

Weight = torch.Tensor | QuantWeight
_EXPERT = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.)?(gate_up_proj|gate_proj|up_proj|down_proj)"
                     r"(\.weight)?$")


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, normalize: bool,
                 shared_expert: nn.Module | None = None):
        super().__init__()
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        self.intermediate = intermediate
        self.gate = Linear(hidden, num_experts, bias=False)  # the router
        # the dense expert every row takes, gated per row by sigmoid(shared_expert_gate(x)); None: none
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if shared_expert is not None else None
        # float experts (buffers: loaded here, not by CausalLM's parameter loading); None where quantized
        self.register_buffer("gate_up", torch.empty(num_experts, 2 * intermediate, hidden), persistent=False)
        self.register_buffer("down", torch.empty(num_experts, hidden, intermediate), persistent=False)
        self.quant_gate_up: list[QuantWeight] | None = None
        self.quant_down: list[QuantWeight] | None = None
        self.native: QuantExperts | None = None  # the quantized experts' one C call, where it takes them
        self.loaded = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def routed(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The selected experts' weighted sum per row."""
        if self.native is not None and (x.shape[0] <= max(max_rows(), 1) or self.quant_gate_up[0].lanes):
            out = self.native(x, logits, self.top_k, self.normalize)  # the rows quantized_linear would round
            if out is not None:
                return out
        return self.forward_per_expert(x, logits)

    def forward_per_expert(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Routing in torch and an expert at a time: prompt-sized steps on AVX2 (an expert with
        many rows dequantizes its weight for the BLAS), float experts, and the C call's reference."""
        weights, experts = self.route(logits)
        weights = weights.to(x.dtype).reshape(-1)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows_of = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                picked = order[start:start + n]
                rows = rows_of[start:start + n]
                y = self.expert(expert, x[rows])
                out.index_add_(0, rows, y * weights[picked, None])
                start += n
        return out

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top_k experts and their weights [T, k]: a softmax over all the router's
        logits, then the top k (renormalised to sum to 1 where `normalize`). A family that
        routes otherwise (gpt-oss: top k, then a softmax over those) overrides it."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """One expert's SwiGLU MLP on its rows."""
        if self.quant_gate_up is not None:
            gate_up = quantized_linear(h, self.quant_gate_up[e])
        else:
            gate_up = linear(h, self.gate_up[e])
        hidden = silu_mul(gate_up)  # float32 on CPU, in C
        if hidden is None:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            hidden = F.silu(gate).mul_(up)
        if self.quant_down is not None:
            return quantized_linear(hidden, self.quant_down[e])
        return linear(hidden, self.down[e])

    def drop_float_experts(self) -> None:
        """Before the model is materialized: the experts will be quantized, no float copy allocated."""
        self.gate_up = None
        self.down = None

    def load_experts(self, gate: Weight, up: Weight, down: Weight) -> None:
        """Each projection for all experts: float [E, out, in] or quantized, stacked [E * out, in]."""
        e = self.num_experts
        if all(isinstance(w, QuantWeight) for w in (gate, up, down)) and self.gate_up is None:
            lanes = lanes_preferred()
            gates, ups, downs = _split(gate, e), _split(up, e), _split(down, e)
            fused = [concat_rows([g, u]) for g, u in zip(gates, ups)]
            self.quant_gate_up = [w.to_lanes() if lanes else w for w in fused]
            self.quant_down = [w.to_lanes() if lanes else w for w in downs]
            self.native = QuantExperts.build(self.quant_gate_up, self.quant_down, self.top_k)
            _check(self.quant_gate_up[0].shape, (2 * self.intermediate, self.gate.in_features), "gate/up")
            _check(self.quant_down[0].shape, (self.gate.in_features, self.intermediate), "down")
            return
        gate, up, down = (_float(w, e) for w in (gate, up, down))
        if self.gate_up is None:  # quantized storage was planned, a part came float: hold floats
            raise ValueError("experts planned quantized came as float weights")
        _check(tuple(self.gate_up.shape), (e, gate.shape[1] + up.shape[1], gate.shape[2]), "gate/up")
        _check(tuple(self.down.shape), tuple(down.shape), "down")
        self.gate_up[:, :self.intermediate].copy_(gate)
        self.gate_up[:, self.intermediate:].copy_(up)
        self.down.copy_(down)

    def weight_bytes(self) -> int:
        quant = sum(w.nbytes for ws in (self.quant_gate_up or [], self.quant_down or []) for w in ws)
        floats = sum(t.numel() * t.element_size() for t in (self.gate_up, self.down) if t is not None)
        return quant + floats


class ExpertLoading:
    """A CausalLM mixin for families with SparseMoE layers (`layers[i].mlp`): the checkpoint's
    experts are taken out of the tensors before CausalLM's loading sees them and loaded into their
    layer, float or quantized (one QuantWeight per expert and projection); every expert layer is
    checked loaded. Put it before the family's CausalLM class."""

    def _moe(self, layer: int) -> SparseMoE:
        mlp = self.layers[layer].mlp if 0 <= layer < len(self.layers) else None
        if not isinstance(mlp, SparseMoE):
            raise ValueError(f"the checkpoint has experts for layer {layer}, which has none in this model")
        return mlp

    def drop_float_weights(self, names: set[str]) -> None:
        experts = {n for n in names if ".mlp.experts." in n}
        layers = {int(n.split(".")[1]) for n in experts}
        for layer in layers:
            parts = {n.rsplit(".", 2)[-2] for n in experts if n.split(".")[1] == str(layer)}
            if parts >= {"gate_up_proj", "down_proj"}:  # all three projections quantized
                self._moe(layer).drop_float_experts()
        super().drop_float_weights(names - experts)

    def load_quantized(self, weights: dict[str, QuantWeight]) -> None:
        """Quantized weights, the experts among them; loads last (after the float ones), so every
        expert layer is checked loaded here."""
        self._load_experts(weights)
        super().load_quantized({n: w for n, w in weights.items() if ".mlp.experts." not in n})
        unloaded = [i for i, layer in enumerate(self.layers) if isinstance(layer.mlp, SparseMoE)
                    and not layer.mlp.loaded]
        if unloaded:
            raise ValueError(f"checkpoint lacks experts of layers {unloaded}")

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_hf_state_dict(self._load_experts(tensors))

    def _load_experts(self, tensors: dict) -> dict:
        """Load the experts of `tensors` (with those already taken aside); the rest returned."""
        found, rest = expert_weights(tensors)
        pending = getattr(self, "_pending_experts", {})
        for layer, parts in found.items():
            parts = {**pending.pop(layer, {}), **parts}
            if set(parts) != {"gate", "up", "down"}:
                pending[layer] = parts  # float and quantized parts come in two calls (a mixed file)
                continue
            self._moe(layer).load_experts(parts["gate"], parts["up"], parts["down"])
            self._moe(layer).loaded = True
        self._pending_experts = pending
        return rest

    def weight_bytes(self) -> int:
        return super().weight_bytes() + sum(layer.mlp.weight_bytes() for layer in self.layers
                                            if isinstance(layer.mlp, SparseMoE))


def expert_weights(tensors: dict[str, Weight]) -> tuple[dict[int, dict[str, Weight]], dict[str, Weight]]:
    """The checkpoint's expert tensors by layer and projection (gate, up, down: float [E, out, in]
    or quantized stacked [E * out, in]), and the other tensors. Per-expert tensors are stacked."""
    per_expert: dict[tuple[int, str], dict[int, Weight]] = {}
    layers: dict[int, dict[str, Weight]] = {}
    rest: dict[str, Weight] = {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            rest[name] = t
            continue
        layer, expert, proj = int(m.group(1)), m.group(2), m.group(3).removesuffix("_proj")
        if expert is not None:
            per_expert.setdefault((layer, proj), {})[int(expert)] = t
        elif proj == "gate_up":  # fused [E, 2I, H]
            gate, up = t.chunk(2, dim=1)
            layers.setdefault(layer, {}).update(gate=gate, up=up)
        else:
            layers.setdefault(layer, {})[proj] = t
    for (layer, proj), parts in per_expert.items():
        ordered = [parts[i] for i in range(len(parts))] if set(parts) == set(range(len(parts))) else None
        if ordered is None:
            raise ValueError(f"layer {layer}'s {proj} experts are numbered {sorted(parts)}, not 0..{len(parts) - 1}")
        layers.setdefault(layer, {})[proj] = (_stack_quant(ordered) if isinstance(ordered[0], QuantWeight)
                                              else torch.stack(ordered))
    return layers, rest


def _split(w: QuantWeight, experts: int) -> list[QuantWeight]:
    """A stacked [E * out, in] weight's experts, views of its storage."""
    n = w.shape[0]
    if w.lanes or n % experts:
        raise ValueError(f"a stacked expert weight of {n} rows does not split into {experts} experts")
    size = n // experts
    return [QuantWeight(w.codes[i * size:(i + 1) * size], w.scale[i * size:(i + 1) * size],
                        None if w.offset is None else w.offset[i * size:(i + 1) * size],
                        w.bits, w.group, w.zero, w.kind) for i in range(experts)]


def _stack_quant(parts: list[QuantWeight]) -> QuantWeight:
    if len({(p.bits, p.group, p.zero, p.offset is None, p.scale.dtype) for p in parts}) != 1:
        return concat_rows(parts)
    return QuantWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                       None if parts[0].offset is None else torch.cat([p.offset for p in parts]),
                       parts[0].bits, parts[0].group, parts[0].zero, parts[0].kind)


def _float(w: Weight, experts: int) -> torch.Tensor:
    t = w.dequantize() if isinstance(w, QuantWeight) else w
    return t.reshape(experts, -1, t.shape[-1]) if t.dim() == 2 else t


def _check(got: tuple[int, ...], want: tuple[int, ...], what: str) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"expert {what} weights are {tuple(got)}, the model needs {tuple(want)}")
