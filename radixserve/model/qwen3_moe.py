"""Qwen3MoeForCausalLM: Qwen3-MoE (Qwen3-30B-A3B and its kin): Qwen3's attention (q/k norms,
no biases) with a sparse mixture of experts in place of the MLP (model/moe.py) in every layer
but the `mlp_only_layers` (and those off `decoder_sparse_step`), which keep Llama's dense MLP.
It is the Llama model (constructor, layers, layer loop) with `make_mlp` as the difference, and
the loading of the checkpoint's expert tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.kernels.quant_linear import QuantWeight
from radixserve.model.causal_lm import CausalLM
from radixserve.model.llama import MLP, LlamaForCausalLM
from radixserve.model.moe import SparseMoE, expert_weights
from radixserve.model.spec import ModelSpec


def num_experts(config) -> int:
    """config.num_experts (saved as num_local_experts, which the config read back from JSON holds)."""
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0) or 0)


def _sparse(config, layer: int) -> bool:
    return (layer not in (getattr(config, "mlp_only_layers", None) or []) and num_experts(config) > 0
            and (layer + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    gguf_layer_names = {**CausalLM.gguf_layer_names, "ffn_gate_inp": "mlp.gate",
                        "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
                        "ffn_down_exps": "mlp.experts.down_proj"}

    @classmethod
    def spec_fields(cls, config) -> dict:
        return {"qk_norm": True}

    def make_mlp(self, spec: ModelSpec, layer_index: int) -> nn.Module:
        """The experts in place of the dense MLP, but in `mlp_only_layers` (and off `decoder_sparse_step`)."""
        config = spec.hf_config
        if not _sparse(config, layer_index):
            return MLP(spec)
        return SparseMoE(spec.hidden_size, config.moe_intermediate_size, num_experts(config),
                         config.num_experts_per_tok, bool(config.norm_topk_prob))

    @classmethod
    def gguf_config_fields(cls, metadata: dict) -> dict:
        """llama.cpp's expert_feed_forward_length, which transformers' GGUF config reading leaves out."""
        size = metadata.get("qwen3moe.expert_feed_forward_length")
        return {} if size is None else {"moe_intermediate_size": int(size)}

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
