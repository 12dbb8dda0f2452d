"""Qwen3_5MoeForCausalLM: Qwen3.5-MoE (Qwen3.5-35B-A3B and its kin; qwen3_5_moe_text, the text
tower of qwen3_5_moe): Qwen3.5's layers (model/qwen3_5.py: Gated DeltaNet beside gated full
attention) with a sparse mixture of experts in place of every MLP (model/moe.py): the top k of
the routed experts, renormalised, plus a shared expert gated per row by sigmoid of its own
one-output gate. Its experts load through moe.ExpertLoading.
"""

from __future__ import annotations

from torch import nn

from radixserve.model.llama import MLP
from radixserve.model.moe import ExpertLoading, SparseMoE
from radixserve.model.qwen3_5 import Qwen3_5ForCausalLM
from radixserve.model.spec import ModelSpec


class Qwen3_5MoeForCausalLM(ExpertLoading, Qwen3_5ForCausalLM):
    gguf_layer_names = {**Qwen3_5ForCausalLM.gguf_layer_names, "ffn_gate_inp": "mlp.gate",
                        "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
                        "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                        "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
                        "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
    gguf_model_type = "qwen3_5_moe_text"

    @classmethod
    def text_config(cls, config):
        """Qwen3_5MoeForConditionalGeneration's text tower (its vision tower is not run)."""
        text = getattr(config, "text_config", None)
        return text if getattr(config, "model_type", None) == "qwen3_5_moe" and text is not None else config

    @classmethod
    def spec_fields(cls, config) -> dict:
        """The shared expert is the MLP of the spec's width (its fused gate/up split by it)."""
        return {"qk_norm": True, "intermediate_size": config.shared_expert_intermediate_size}

    def make_mlp(self, spec: ModelSpec, layer_index: int) -> nn.Module:
        config = spec.hf_config
        return SparseMoE(spec.hidden_size, config.moe_intermediate_size, config.num_experts,
                         config.num_experts_per_tok, True, shared_expert=MLP(spec))
