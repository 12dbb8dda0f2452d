"""CausalLM: what every model family's forward shares: a flat batch of the step's tokens in,
the sampled rows' logits out, and the machinery around the layers (weight loading with
q/k/v and gate/up fused, quantized weights, oneDNN and bf16 matmul switches).

Every op works on [T, ...] rows where T is all the step's tokens from all requests
(prefill chunks and decodes together); only attention needs to know which row belongs
to which request, and it learns that from the step's AttentionPlan. A family subclass
builds `embed_tokens`, `layers`, `norm` and `lm_head` (None when tied) and runs its layers
in `run_layers`. Its class also says what is the family's own in a checkpoint: how llama.cpp
names its tensors (`gguf_layer_names`), what its ModelSpec takes from the config
(`spec_fields`), and how a transformers checkpoint's values become the ones it holds
(`from_hf_checkpoint`).
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.attention.backend import AttentionBackend, AttentionPlan
from radixserve.attention.kv_pool import KVPool
from radixserve.kernels.onednn_linear import bf16_available
from radixserve.kernels.quant_linear import QuantWeight, concat_rows, lanes_preferred
from radixserve.model.layers import Embedding, Linear, RMSNorm, StepRows, linear, quantized_linear
from radixserve.model.native_decoder import EmbeddingRows, HeadRows, RopeTables
from radixserve.model.spec import ModelSpec

# How llama.cpp names a block's tensors (blk.N.<stem>.weight) -> transformers' name under model.layers.N.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


class CausalLM(nn.Module):
    gguf_layer_names: dict[str, str] = GGUF_LAYER_NAMES
    gguf_interleaved_qk: tuple[str, ...] = ()  # GGUF architectures whose q/k rows llama.cpp interleaved

    @classmethod
    def spec_fields(cls, config) -> dict:
        """What the family's ModelSpec takes from `config` beyond the shared fields (spec.py)."""
        return {}

    @classmethod
    def gguf_config_fields(cls, metadata: dict) -> dict:
        """Config fields a GGUF header holds that transformers' reading of it leaves out."""
        return {}

    @classmethod
    def gguf_config(cls, header) -> dict | None:
        """config.json's fields from a GGUF header (gguf_file.GGUFHeader) where transformers
        cannot read the file's architecture; None: transformers reads it."""
        return None

    @classmethod
    def text_config(cls, config):
        """The config of the text model to run (an image-text model's text tower), or config."""
        return config

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.onednn_linear = True
        self.integer_prompt = True  # quantized weights' prompt-sized rows by the integer kernel
        self.step_rows = StepRows()
        self.native = None  # a NativeDecoder where the family and the step allow one (the runner sets it)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        pool: KVPool,
        plan: AttentionPlan,
        logits_indices: torch.Tensor,
        decodes: int = 0,
    ) -> torch.Tensor:
        """Run the step's tokens; return logits [len(logits_indices), vocab] in float32.
        `plan` is what `backend.prepare` made of the step's metadata; the first `decodes`
        tokens are single-query rows (decodes, drafts), kept float32 under bf16 matmuls."""
        self.step_rows.decodes = decodes
        x = None if self.native is None or self.native.has_embedding else self.embed(input_ids)
        rope = self.native_rope(positions) if self.native is not None else None
        if rope is not None:
            head = HeadRows(logits_indices) if self.native.has_head else None
            out = self.native.run(input_ids, positions, rope[0], pool, plan, local=rope[1], head=head, x=x)
            if out is not None:
                return head.logits if head is not None and head.logits is not None else self.logits(
                    self.norm(out[logits_indices]))
        x = self.run_layers(self.embed(input_ids) if x is None else x, positions, backend, pool, plan)
        return self.logits(self.norm(x[logits_indices]))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend, pool: KVPool,
                   plan: AttentionPlan) -> torch.Tensor:
        raise NotImplementedError

    def native_rope(self, positions: torch.Tensor) -> tuple[RopeTables, RopeTables | None] | None:
        """The RoPE tables the native decoder reads for these positions (the step's own, and the
        window layers' where they have their own), or None: this family's layers do not run in
        the native decoder (the default)."""
        return None

    def native_embedding(self) -> EmbeddingRows | None:
        """The rows the native decoder looks a token's id up in and their scale, where `embed`
        is that lookup (the default: the embedding, unscaled); None where it is not."""
        if type(self).embed is not CausalLM.embed:
            return None
        return self._embedding_rows(), None

    def _embedding_rows(self) -> torch.Tensor | QuantWeight:
        return self.embed_tokens.quant if self.embed_tokens.quant is not None else self.embed_tokens.weight

    def build_rotary(self, max_positions: int, device: torch.device) -> None:
        """Compute the RoPE tables once the model is placed (they are not in checkpoints)."""
        self.rotary.build(max_positions, device)

    def native_head(self) -> tuple[torch.Tensor, QuantWeight] | None:
        """The final norm's weight and the quantized head, where the native decoder may give a
        step's logits as `logits` would (the norm in C on float32 CPU rows, no further change
        to the logits); None where it may not."""
        if type(self).logits is not CausalLM.logits:
            return None
        return self._plain_head()

    def _plain_head(self) -> tuple[torch.Tensor, QuantWeight] | None:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        norm = getattr(self.norm, "weight", None)
        if (type(self.norm) is not RMSNorm or head.quant is None or norm is None or norm.dtype != torch.float32
                or norm.device.type != "cpu" or not norm.is_contiguous()):
            return None
        return norm, head.quant

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if head.quant is not None:
            return quantized_linear(x, head.quant, onednn=self.onednn_linear,
                                    integer_prompt=self.integer_prompt).float().contiguous()
        return linear(x, head.weight, onednn=self.onednn_linear).float().contiguous()

    def use_onednn_linear(self, on: bool) -> None:
        """Route float32 CPU matmuls too large for the skinny kernel through oneDNN (on) or
        torch's BLAS (off)."""
        self.onednn_linear = on
        for module in self.modules():
            if isinstance(module, Linear):
                module.onednn = on

    def use_integer_prompt_matmuls(self, on: bool) -> None:
        """Multiply quantized layers' prompt rows (more than the skinny kernel's) by the integer
        kernel on the weight's codes (on), or dequantize to float32 and take oneDNN (off); the
        logits' rows too (prompt logprobs)."""
        self.integer_prompt = on
        for module in self.modules():
            if isinstance(module, Linear):
                module.integer_prompt = on

    def use_bf16_matmuls(self, on: bool) -> None:
        """Multiply a step's prompt rows, where they take oneDNN (more rows than the skinny
        kernel's), on bfloat16 inputs through a bfloat16 copy of each layer's weights (on; +half
        the layers' weight bytes), or in float32 (off: the copies are dropped). Its decode rows
        (forward's `decodes`) and the logits' matmul stay float32.
        Refused, changing nothing, where it cannot run: float32 CPU weights, oneDNN on, and a
        CPU that multiplies bf16 natively."""
        if on:
            norm = self.norm.weight
            missing = [need for need, ok in (
                ("float32 weights on CPU", norm.dtype == torch.float32 and norm.device.type == "cpu"),
                ("onednn_linear on", self.onednn_linear),
                ("a CPU with native bf16 matmuls in oneDNN (AVX512_BF16 or AMX)", bf16_available()),
            ) if not ok]
            if missing:
                raise ValueError(f"prefill_matmul_dtype bfloat16 needs {'; '.join(missing)}: use float32")
        for module in self.layers.modules():  # not the lm head: the logits stay float32
            if isinstance(module, Linear) and module.quant is None:  # quantized: dequantized to float32
                module.weight_bf16 = module.weight.detach().to(torch.bfloat16).contiguous() if on else None
                module.step = self.step_rows

    def quantized_layers(self) -> dict[str, Linear | Embedding]:
        """The modules whose weights a checkpoint may hold quantized, by their weight's name."""
        return {f"{name}.weight": m for name, m in self.named_modules() if isinstance(m, (Linear, Embedding))}

    def drop_float_weights(self, names: set[str]) -> None:
        """Before the model is materialized: the modules of `names` (as quantized_layers names
        them) will hold quantized weights, so their float weight is never allocated."""
        layers = self.quantized_layers()
        for name in names:
            layers[name].weight = None

    def load_quantized(self, weights: dict[str, QuantWeight]) -> None:
        """Quantized weights named as in transformers' checkpoints, q/k/v and gate/up fused
        (their storage made common: kernels/quant_linear.concat_rows), then moved into the
        lanes layout where this CPU's kernel reads it."""
        layers = self.quantized_layers()
        lanes = lanes_preferred()
        fused: dict[str, dict[str, QuantWeight]] = {}
        for name, weight in weights.items():
            target, part = _map_weight_name(name)
            if target not in layers or layers[target].weight is not None:
                raise ValueError(f"quantized weight {name!r} has no quantized place in the model")
            fused.setdefault(target, {})[part] = weight
        for target, parts in fused.items():
            order = _PART_ORDER.get(target.rsplit(".", 2)[-2], ("all",))
            if set(parts) != set(order):
                raise ValueError(f"{target} needs the parts {order}, the checkpoint has {sorted(parts)}")
            joined = concat_rows([parts[p] for p in order])
            module = layers[target]
            expected = (module.num_embeddings, module.embedding_dim) if isinstance(module, Embedding) else (
                module.out_features, module.in_features)
            if joined.shape != expected:
                raise ValueError(f"quantized weight {target} is {joined.shape}, the model needs {expected}")
            module.quant = joined.to_lanes() if lanes else joined
        missing = [name for name, m in layers.items() if m.weight is None and m.quant is None]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} quantized weights, e.g. {missing[:3]}")

    def weight_bytes(self) -> int:
        """Bytes the weights hold: parameters and buffers of the model, and quantized weights."""
        params = sum(p.numel() * p.element_size() for p in self.parameters())
        quant = sum(m.quant.nbytes for m in self.quantized_layers().values() if m.quant is not None)
        bf16 = sum(m.weight_bf16.numel() * 2 for m in self.modules()
                   if isinstance(m, Linear) and m.weight_bf16 is not None)
        return params + quant + bf16

    def from_hf_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A transformers checkpoint's tensors as this model holds them (a GGUF's are read as
        held already): the same here."""
        return tensors

    def load_weights(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Float weights named as in transformers' checkpoints, from a transformers checkpoint
        (`source` 'hf') or read from a GGUF file ('gguf'), q/k/v and gate/up fused."""
        if source not in ("hf", "gguf"):
            raise ValueError(f"weights come from 'hf' or 'gguf', not {source!r}")
        self.load_hf_state_dict(self.from_hf_checkpoint(tensors) if source == "hf" else tensors)

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load weights named as in transformers' checkpoints, their values as held, fusing q/k/v and gate/up."""
        own = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in tensors.items():
            target, part = _map_weight_name(name)
            if target is None:
                continue
            if target not in own:
                raise ValueError(f"checkpoint weight {name!r} has no place in the model")
            _copy_part(own[target], tensor, part, self.spec)
            loaded.add(f"{target}:{part}")
        missing = [n for n in _expected_parts(own, self.spec) if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")


# ---- weight-name mapping ------------------------------------------------------------

_PART_ORDER = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}

_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def _map_weight_name(name: str) -> tuple[str | None, str]:
    if name.startswith("model."):
        name = name[len("model."):]
    if "rotary_emb" in name:
        return None, ""
    for hf, (ours, part) in _FUSED.items():
        if f".{hf}." in name:
            return name.replace(f".{hf}.", f".{ours}."), part
    return name, "all"


def _part_slice(part: str, spec: ModelSpec) -> slice:
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    inter = spec.intermediate_size
    slices = {
        "q": slice(0, q),
        "k": slice(q, q + kv),
        "v": slice(q + kv, q + 2 * kv),
        "gate": slice(0, inter),
        "up": slice(inter, 2 * inter),
    }
    return slices[part]


def _copy_part(param: nn.Parameter, tensor: torch.Tensor, part: str, spec: ModelSpec) -> None:
    dest = param.data if part == "all" else param.data[_part_slice(part, spec)]
    if dest.shape != tensor.shape:
        raise ValueError(f"weight shape {tuple(tensor.shape)} does not fit {tuple(dest.shape)}")
    dest.copy_(tensor.to(dest.dtype))


def _expected_parts(own: dict[str, nn.Parameter], spec: ModelSpec) -> list[str]:
    out = []
    for name in own:
        if "qkv_proj" in name:
            out += [f"{name}:{p}" for p in ("q", "k", "v")]
        elif "gate_up_proj" in name:
            out += [f"{name}:{p}" for p in ("gate", "up")]
        else:
            out.append(f"{name}:all")
    return out
