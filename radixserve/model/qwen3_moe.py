"""Qwen3MoeForCausalLM: Qwen3-MoE (Qwen3-30B-A3B and its kin): Qwen3's attention (q/k norms,
no biases) with a sparse mixture of experts in place of the MLP (model/moe.py) in every layer
but the `mlp_only_layers` (and those off `decoder_sparse_step`), which keep Llama's dense MLP.
It is the Llama model (constructor, layers, layer loop) with `make_mlp` as the difference; its
experts load through moe.ExpertLoading.
"""

from __future__ import annotations

from torch import nn

from radixserve.model.causal_lm import CausalLM
from radixserve.model.llama import MLP, LlamaForCausalLM
from radixserve.model.moe import ExpertLoading, SparseMoE
from radixserve.model.spec import ModelSpec


def num_experts(config) -> int:
    """config.num_experts (saved as num_local_experts, which the config read back from JSON holds)."""
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0) or 0)


def _sparse(config, layer: int) -> bool:
    return (layer not in (getattr(config, "mlp_only_layers", None) or []) and num_experts(config) > 0
            and (layer + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0)


class Qwen3MoeForCausalLM(ExpertLoading, LlamaForCausalLM):
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
