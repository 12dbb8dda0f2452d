"""ModelFamily: the model families radixserve runs, and how a checkpoint names each one.

Plain data, importing nothing heavy, so a model is refused from its config.json or GGUF
header before any weight is read. A new family is one module (its CausalLM subclass, which
also says how the family's GGUF tensors are named and what its ModelSpec needs) and one
entry here (docs/model-families.md lists the steps). A load looks its family up once and
hands the ModelFamily on.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_types: tuple[str, ...]  # config.json's model_type
    architectures: tuple[str, ...]  # config.json's architectures
    gguf_architectures: tuple[str, ...]  # a GGUF header's general.architecture
    activations: tuple[str, ...]  # the MLP activations its forward runs
    module: str  # where its CausalLM subclass lives (imported only when a model is built)
    class_name: str
    chat_template: str | None = None  # its built-in template (model/chat_templates/); None: by the tokenizer
    # what `auto` picks under that built-in template (any other template: what its text speaks of)
    tool_call_format: str | None = None  # tools/formats/
    reasoning_parser: str | None = None  # reasoning/registry.py
    # The tokens (by text) that end a reply in the family's chat format, as its Hugging Face
    # generation_config lists them; a GGUF header names one EOS, so a GGUF's load adds those of
    # these its vocabulary has (loader.family_stop_ids)
    stop_tokens: tuple[str, ...] = ()


CHATML_STOPS = ("<|im_end|>", "<|endoftext|>")  # Qwen's generation_config: the turn's end and the text's


# gpt-oss's harmony: the template, calls and reasoning channels a gpt_oss entry takes (**HARMONY)
# (<|call|> ends a reply that calls a tool, <|return|> the final answer; <|end|> ends a message, not the reply)
HARMONY = dict(chat_template="harmony", tool_call_format="harmony", reasoning_parser="gpt_oss",
               stop_tokens=("<|return|>", "<|call|>", "<|endoftext|>"))


FAMILIES = (
    ModelFamily("llama", ("llama", "mistral", "qwen2", "qwen3"),
                ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
                ("llama", "mistral", "qwen2", "qwen3"), ("silu", "swish"),
                "radixserve.model.llama", "LlamaForCausalLM",
                # chatml's turn end (SmolLM2, Qwen2/3); Llama 3's text, turn and tool turn (<|eom_id|>) ends;
                # not <|endoftext|>, which SmolLM2's generation_config does not stop at
                stop_tokens=("<|im_end|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>")),
    # gemma3 / Gemma3ForConditionalGeneration: the text tower of the image-text model (its
    # vision tower's weights are not loaded; images are not taken)
    ModelFamily("gemma3", ("gemma3_text", "gemma3"), ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
                ("gemma3",), ("gelu_pytorch_tanh",), "radixserve.model.gemma3", "Gemma3ForCausalLM",
                chat_template="gemma3", stop_tokens=("<eos>", "<end_of_turn>")),
    ModelFamily("qwen3_moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",), ("qwen3moe",), ("silu", "swish"),
                "radixserve.model.qwen3_moe", "Qwen3MoeForCausalLM",
                chat_template="qwen3", tool_call_format="hermes", reasoning_parser="qwen3", stop_tokens=CHATML_STOPS),
    # recurrent hybrids: their recurrent layers' state per request lives in the runner's state pool
    ModelFamily("lfm2", ("lfm2",), ("Lfm2ForCausalLM",), ("lfm2",), ("silu",), "radixserve.model.lfm2", "Lfm2ForCausalLM",
                chat_template="lfm2", tool_call_format="lfm2", reasoning_parser="qwen3", stop_tokens=("<|im_end|>",)),
    ModelFamily("qwen3_5", ("qwen3_5_text", "qwen3_5"), ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
                ("qwen35",), ("silu",), "radixserve.model.qwen3_5", "Qwen3_5ForCausalLM",
                chat_template="qwen3_5", tool_call_format="qwen3_coder", reasoning_parser="qwen3",
                stop_tokens=CHATML_STOPS),
    ModelFamily("qwen3_5_moe", ("qwen3_5_moe_text", "qwen3_5_moe"),
                ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"), ("qwen35moe",), ("silu",),
                "radixserve.model.qwen3_5_moe", "Qwen3_5MoeForCausalLM",
                chat_template="qwen3_5", tool_call_format="qwen3_coder", reasoning_parser="qwen3",
                stop_tokens=CHATML_STOPS),
    ModelFamily("granitemoehybrid", ("granitemoehybrid",), ("GraniteMoeHybridForCausalLM",), ("granitehybrid",),
                ("silu",), "radixserve.model.granite_hybrid", "GraniteHybridForCausalLM",
                stop_tokens=("<|end_of_text|>",)),
    # MoE with attention sinks, window layers on the hybrid KV; from a Hugging Face directory (float
    # experts) or a llama.cpp gpt-oss GGUF (its experts as stored, MXFP4 included)
    ModelFamily("gpt_oss", ("gpt_oss",), ("GptOssForCausalLM",), ("gpt-oss",), ("silu",), "radixserve.model.gpt_oss",
                "GptOssForCausalLM", **HARMONY),
)


def supported() -> str:
    """What is supported, for error messages."""
    return "; ".join(f"{f.name} (model types {', '.join(f.model_types)})" for f in FAMILIES)


def family_for_config(config: Any) -> ModelFamily:
    """The family of a transformers config (its model_type, else its architectures)."""
    model_type = getattr(config, "model_type", None)
    archs = getattr(config, "architectures", None) or []
    for family in FAMILIES:
        if model_type in family.model_types or any(a in family.architectures for a in archs):
            return family
    raise ValueError(f"unsupported model type {model_type!r} (architectures {archs}); radixserve runs {supported()}")


def family_for_gguf(architecture: str) -> ModelFamily:
    for family in FAMILIES:
        if architecture in family.gguf_architectures:
            return family
    names = ", ".join(a for f in FAMILIES for a in f.gguf_architectures)
    raise ValueError(f"a {architecture!r} GGUF model is not supported; radixserve runs the GGUF architectures {names}")


def model_class(family: ModelFamily) -> type:
    return getattr(importlib.import_module(family.module), family.class_name)
