"""NativeDecoder: all decoder layers of a decode step in one C call (csrc/decoder_layers.c).

A decode step's layers are ~15 small kernel calls each, and at a few rows the Python and
dispatch between them cost a fifth of the step (6-8 ms of 27-40 ms on the 2-core dev
machine). For a step whose rows are all single-query attention rows (decodes, speculative
draft rows, and the prompt chunks of small steps, which the runner lays out that way) and
few enough for the skinny matmul kernel, the C side runs the
same kernels in the same order, so the logits are bit for bit those of the layer-by-layer
path; any other step, model or device keeps that path. A layer's MLP may be a mixture of
experts that model/moe.py would run in its one C call (quantized experts, no shared expert:
Qwen3-MoE); the C side computes the router's logits and makes that call. The pool may hold float32 or int8
pages (the store quantizes, attention dequantizes, as the cpu backend's kernels do). Each
layer has its sliding window (`windows`, 0: full attention), as the backend's forward takes it.
Where the model's head is quantized (CausalLM.native_head), the same call also gives the step's
logits (the final norm, then the head's product by the kernel the model's logits use).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass

import torch
from torch import nn

from radixserve.attention.backend import AttentionPlan, plan_for
from radixserve.attention.cpu_backend import CpuPlan
from radixserve.attention.kv_pool import KVPool
from radixserve.kernels.heap import on_trim
from radixserve.kernels.native_build import load_kernel
from radixserve.kernels.native_ops import max_rows, model_ops_enabled
from radixserve.kernels.quant_linear import QuantWeight
from radixserve.model.moe import SparseMoE
from radixserve.model.spec import ModelSpec


class _Weight(ctypes.Structure):
    """A projection's weight: float32 (w) or quantized codes (kernels/quant_linear.py)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("w", "codes", "scale", "offset")]
    _fields_ += [(name, ctypes.c_int64) for name in ("bits", "group", "zero", "half", "lanes")]


_WEIGHTS = (("input_norm", ctypes.c_void_p), ("qkv", _Weight), ("qkv_bias", ctypes.c_void_p), ("o", _Weight),
            ("o_bias", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("gate_up", _Weight),
            ("gate_up_bias", ctypes.c_void_p), ("down", _Weight), ("down_bias", ctypes.c_void_p))


_NORMS = (("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("attn_out_norm", ctypes.c_void_p),
          ("mlp_out_norm", ctypes.c_void_p))


# A mixture of experts in place of the dense MLP (experts 0: none): the router's weight, then
# moe_experts_f32's arguments (kernels/moe_experts.py's QuantExperts).
_EXPERTS = (("router", _Weight), ("experts", ctypes.c_int64), ("top_k", ctypes.c_int64),
            ("normalize", ctypes.c_int64), *((name, ctypes.c_void_p) for name in
                                             ("gate_up_ptrs", "gate_up_meta", "down_ptrs", "down_meta")))


class _Layer(ctypes.Structure):
    _fields_ = [*_WEIGHTS, ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("window", ctypes.c_int64),
                *_NORMS, ("alt_rope", ctypes.c_int64), ("alt_pages", ctypes.c_int64), *_EXPERTS]


class _Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in
                ("hidden", "intermediate", "num_heads", "num_kv_heads", "head_dim", "num_blocks", "block_size",
                 "page_bytes", "code_bytes", "kv_int8", "rotate_keys", "activation")]
    _fields_ += [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _Second(ctypes.Structure):
    """A step's second RoPE table and page set (Gemma 3's window layers; a hybrid pool's window pages)."""

    _fields_ = [("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("rope_rows", ctypes.c_int64),
                ("positions", ctypes.c_void_p), ("slots", ctypes.c_void_p), ("tables", ctypes.c_void_p)]
    _fields_ += [(name, ctypes.c_int64) for name in ("table_stride", "table_width", "num_blocks")]


class _Head(ctypes.Structure):
    """The final norm and the head, and the rows of the step that get logits (decoder_layers.c)."""

    _fields_ = [("norm", ctypes.c_void_p), ("w", _Weight), ("vocab", ctypes.c_int64), ("rows", ctypes.c_void_p),
                ("count", ctypes.c_int64), ("logits", ctypes.c_void_p)]


RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos and sin [positions, head_dim / 2], float32
EmbeddingRows = tuple[torch.Tensor | QuantWeight, float | None]  # [vocab, hidden] rows, and a scale or None


class _Embed(ctypes.Structure):
    """The embedding and the step's token ids, x's first value (decoder_layers.c)."""

    _fields_ = [("w", _Weight), ("vocab", ctypes.c_int64), ("ids", ctypes.c_void_p), ("scale", ctypes.c_float),
                ("scaled", ctypes.c_int64)]


def _is_table(tables: RopeTables, half: int) -> bool:
    return all(t.dtype == torch.float32 and t.dim() == 2 and t.shape[1] == half and t.is_contiguous()
               and t.device.type == "cpu" for t in tables) and tables[0].shape == tables[1].shape


@dataclass
class HeadRows:
    """The rows of a step that want logits; `logits` [rows, vocab] float32 once the native decoder
    has computed them (None: the model computes them itself)."""

    indices: torch.Tensor  # int64
    logits: torch.Tensor | None = None


class NativeDecoder:
    """Holds the layers' weight pointers (the weights are never reallocated after loading),
    the pool's, and a workspace reused across steps."""

    def __init__(self, kernel, spec: ModelSpec, layers: nn.ModuleList, windows: list[int] | None = None,
                 head: tuple[torch.Tensor, QuantWeight] | None = None, embedding: EmbeddingRows | None = None):
        if windows is not None and len(windows) != len(layers):
            raise ValueError(f"{len(windows)} sliding windows for {len(layers)} layers")
        self._kernel = kernel
        self._head = head  # the final norm's weight and the quantized head (kept alive: pointers below)
        self._head_weight = _quant_weight(head[1]) if head is not None else None
        self._embedding = embedding if _embedding_ok(embedding, spec) else None  # kept alive: pointers below
        self._embed_weight = _embedding_weight(self._embedding[0]) if self._embedding is not None else None
        self._spec = spec
        self._weights = [_layer_weights(layer) for layer in layers]
        self._norms = [_layer_norms(layer) for layer in layers]
        self._experts = [_layer_experts(layer.mlp) for layer in layers]
        self._max_experts = max((mlp.num_experts for mlp in (layer.mlp for layer in layers)
                                 if isinstance(mlp, SparseMoE)), default=0)
        self._activation = int(getattr(layers[0].mlp, "native_activation", 0)) if len(layers) else 0
        self._windows = [max(int(w), 0) for w in windows] if windows is not None else [0] * len(layers)
        self._keep = layers  # the pointers above stay valid while the modules live
        self._layers: ctypes.Array | None = None
        self._pool_key: tuple[int, int] | None = None
        self._shape: _Shape | None = None
        self._tables_seen: list[RopeTables] = []  # the latest that passed _is_table (kept alive: `is` below)

    @classmethod
    def for_model(cls, spec: ModelSpec, layers: nn.ModuleList, windows: list[int] | None = None,
                  head: tuple[torch.Tensor, QuantWeight] | None = None,
                  embedding: EmbeddingRows | None = None) -> NativeDecoder | None:
        """The decoder for these layers (windows: each layer's sliding window, 0 or None for
        full attention; head: the final norm's weight and the quantized head, or None: the
        model computes the logits; embedding: the rows a token's id looks up and their scale,
        or None: the model embeds), or None where the C path does not apply (another device or
        dtype, sizes the matmul kernel refuses, kernels disabled or not buildable)."""
        if not all(_dense(layer.mlp) or _native_experts(layer.mlp) for layer in layers):
            return None  # a layer with an MLP the C side does not run: layer by layer
        params = list(layers.parameters())
        q_size = spec.num_heads * spec.head_dim
        if not (
            not spec.recurrent  # its layers are attention layers only
            and not spec.attention_sinks  # its attention takes no sinks
            and model_ops_enabled() and max_rows() > 0
            and all(p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous() for p in params)
            and all(m.quant is None or m.quant.codes.device.type == "cpu" for m in layers.modules()
                    if hasattr(m, "quant"))
            and spec.hidden_size % 8 == 0 and q_size % 8 == 0 and spec.intermediate_size % 8 == 0
        ):
            return None
        kernel = _kernel()
        return None if kernel is None else cls(kernel, spec, layers, windows, head, embedding)

    @property
    def has_head(self) -> bool:
        return self._head is not None

    @property
    def has_embedding(self) -> bool:
        return self._embedding is not None

    def run(self, ids: torch.Tensor, positions: torch.Tensor, rope: RopeTables, pool: KVPool, plan: AttentionPlan,
            local: RopeTables | None = None, head: HeadRows | None = None,
            x: torch.Tensor | None = None) -> torch.Tensor | None:
        """Every layer of the step over its tokens `ids` [T] int64: the hidden states [T, hidden]
        after the last layer, or None (nothing done) where the step is not one this path takes:
        prefill chunks laid out as chunks (not single-query rows), more rows than the matmul
        kernel takes, or another attention backend's plan. `x`: the tokens' embedded rows,
        updated in place and returned, where this decoder does not hold the embedding (None
        where it does: it writes them). `positions` [T] int64; `rope`: float32 cos and sin
        tables [positions, head_dim / 2] covering them (layers.RotaryEmbedding.tables).
        `local`: the window layers' own tables (Gemma 3), else they take `rope`; a hybrid pool's
        window layers read their pages through the plan's window plan. `head`: the rows that
        want logits, given them here where this decoder holds the model's head."""
        rows = ids.shape[0]
        full, window = plan_for(plan, 0), plan_for(plan, 1)
        if not (isinstance(full, CpuPlan) and isinstance(window, CpuPlan) and full.num_decodes == rows
                and window.num_decodes == rows and 0 < rows <= max_rows()
                and (pool.kv.dtype == torch.float32 or pool.pages is not None)):
            return None
        local = rope if local is None else local
        if not (ids.dtype == torch.int64 and ids.shape == (rows,) and ids.is_contiguous()
                and positions.dtype == torch.int64 and positions.shape == (rows,) and positions.is_contiguous()
                and self._known_tables(rope) and self._known_tables(local)):
            return None
        if x is None:
            if self._embedding is None:
                raise ValueError("this native decoder does not hold the embedding: pass the embedded rows")
            x = torch.empty(rows, self._spec.hidden_size)
            scale = self._embedding[1]
            embed = _Embed(self._embed_weight, self._embedding[0].shape[0], ids.data_ptr(),
                           0.0 if scale is None else scale, scale is not None)
        elif x.shape == (rows, self._spec.hidden_size) and x.is_contiguous() and x.dtype == torch.float32:
            embed = None
        else:
            return None
        tables, seq_lens = full.decode_block_tables, full.decode_seq_lens
        (cos, sin), (local_cos, local_sin) = rope, local
        wtables = window.decode_block_tables
        second = _Second(local_cos.data_ptr(), local_sin.data_ptr(), local_cos.shape[0], positions.data_ptr(),
                         window.slot_mapping.data_ptr(), wtables.data_ptr(), wtables.stride(0), wtables.shape[1],
                         pool.window_kv.shape[2] if pool.hybrid else pool.kv.shape[2])
        layers, shape = self._layer_array(pool)
        workspace = self._workspace_for(rows)
        logits, head_call = self._head_call(head, rows)
        status = self._kernel(
            x.data_ptr(), rows, layers, len(self._weights), ctypes.byref(shape),
            cos.data_ptr(), sin.data_ptr(), cos.shape[0], positions.data_ptr(), full.slot_mapping.data_ptr(),
            tables.data_ptr(), tables.stride(0), tables.shape[1], seq_lens.data_ptr(), workspace.data_ptr(),
            ctypes.byref(second),
            None if full.decode_tree_masks is None else full.decode_tree_masks.data_ptr(),
            None if head_call is None else ctypes.byref(head_call), None if embed is None else ctypes.byref(embed),
        )
        if status == -2:
            raise ValueError("a slot, context length or block id is outside the KV pool, a position outside the RoPE "
                             "table, a token id outside the embedding, or a logits row outside the step")
        if status:  # after some layers: x and the pool's slots of this step are partly written
            raise RuntimeError("the native decoder could not allocate its scratch memory (step left half done)")
        if head is not None:
            head.logits = logits
        return x

    def _known_tables(self, tables: RopeTables) -> bool:
        """Whether these are RoPE tables this path reads (checked once per table: the model's
        stay the same tensors until they grow)."""
        cos, sin = tables
        if any(cos is c and sin is s for c, s in self._tables_seen):
            return True
        if not _is_table(tables, self._spec.head_dim // 2):
            return False
        self._tables_seen = [*self._tables_seen[-1:], (cos, sin)]  # a step's own tables and its second
        return True

    def _head_call(self, head: HeadRows | None, rows: int) -> tuple[torch.Tensor | None, _Head | None]:
        """The logits' tensor and the C side's head for these rows, or (None, None): no head here,
        or rows it does not take."""
        if self._head is None or head is None:
            return None, None
        indices = head.indices
        if not (indices.dtype == torch.int64 and indices.dim() == 1 and 0 < indices.numel() <= rows
                and indices.is_contiguous() and indices.device.type == "cpu"):
            return None, None
        norm, weight = self._head
        logits = torch.empty(indices.numel(), weight.shape[0], dtype=torch.float32)
        return logits, _Head(norm.data_ptr(), self._head_weight, weight.shape[0], indices.data_ptr(),
                             indices.numel(), logits.data_ptr())

    def _layer_array(self, pool: KVPool) -> tuple[ctypes.Array, _Shape]:
        """Every layer's weight and cache pointers, and the shapes, for this pool (made once)."""
        key = (id(pool), pool.kv.data_ptr())
        if key != self._pool_key:
            caches = [pool.layer(i) for i in range(len(self._weights))]
            # a window layer's K/V in a hybrid pool: pages of their own (not views of pool.kv)
            apart = [pool.hybrid and _inside(k, pool.window_kv) for k, _ in caches]
            self._layers = (_Layer * len(caches))(*[
                _Layer(*weights, k.data_ptr(), v.data_ptr(), window, *norms, int(window > 0), int(alt), *experts)
                for weights, (k, v), window, norms, alt, experts in zip(self._weights, caches, self._windows,
                                                                       self._norms, apart, self._experts)
            ])
            spec, pages = self._spec, pool.pages
            kv = pool.kv if pool.kv.shape[0] else pool.window_kv
            page_bytes = kv[0, 0, 0].numel() * kv.element_size()  # one layer's K (or V) of a block
            self._shape = _Shape(spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads,
                                 spec.head_dim, pool.kv.shape[2], pool.block_size, page_bytes,
                                 pages.code_bytes if pages else 0, pages is not None, pool.rotate_keys,
                                 self._activation, spec.rms_norm_eps, spec.attention_scale)
            self._pool_key = key
        return self._layers, self._shape

    def _workspace_for(self, rows: int) -> torch.Tensor:
        """This thread's workspace, grown to the step's rows and kept from step to step (every
        decoder on the thread shares it); let go when the engine trims its heap (kernels/heap.py),
        4 MiB for the default model's 128 rows."""
        spec = self._spec
        q = spec.num_heads * spec.head_dim
        qkv = q + 2 * spec.num_kv_heads * spec.head_dim
        need = rows * (2 * spec.hidden_size + qkv + 2 * q + 3 * spec.intermediate_size + self._max_experts)
        workspace = getattr(_scratch, "workspace", None)
        if workspace is None or workspace.numel() < need:
            workspace = _scratch.workspace = torch.empty(need, dtype=torch.float32)
        return workspace


_scratch = threading.local()


@on_trim
def _release_workspace() -> None:
    _scratch.workspace = None


@functools.cache
def _kernel():
    return load_kernel("decoder_layers_f32")


def _dense(mlp: nn.Module) -> bool:
    return isinstance(getattr(mlp, "gate_up_proj", None), nn.Linear)


def _native_experts(mlp: nn.Module) -> bool:
    """A mixture of experts the C side runs as model/moe.py does at decode sizes: quantized experts
    in the one C call, softmax-then-top-k routing, no shared expert."""
    return (isinstance(mlp, SparseMoE) and mlp.native is not None and mlp.shared_expert is None
            and type(mlp).forward is SparseMoE.forward and type(mlp).routed is SparseMoE.routed
            and type(mlp).route is SparseMoE.route and isinstance(mlp.gate, nn.Linear) and mlp.gate.bias is None)


def _layer_weights(layer: nn.Module) -> tuple[int | _Weight | None, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    pre_mlp = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm
    parts = (layer.input_layernorm.weight, attn.qkv_proj, attn.qkv_proj.bias, attn.o_proj, attn.o_proj.bias,
             pre_mlp.weight)
    weights = tuple(_projection(p) if isinstance(p, nn.Linear) else _ptr(p) for p in parts)
    if not _dense(mlp):  # experts in its place (_layer_experts)
        return (*weights, _Weight(), None, _Weight(), None)
    return (*weights, _projection(mlp.gate_up_proj), _ptr(mlp.gate_up_proj.bias), _projection(mlp.down_proj),
            _ptr(mlp.down_proj.bias))


def _layer_experts(mlp: nn.Module) -> tuple:
    """The C side's experts fields: none for a dense MLP."""
    if not isinstance(mlp, SparseMoE):
        return (_Weight(), 0, 0, 0, None, None, None, None)
    native = mlp.native
    return (_projection(mlp.gate), mlp.num_experts, mlp.top_k, int(mlp.normalize), native.gate_up_ptrs.data_ptr(),
            native.gate_up_meta.data_ptr(), native.down_ptrs.data_ptr(), native.down_meta.data_ptr())


def _layer_norms(layer: nn.Module) -> tuple[int | None, ...]:
    """q_norm, k_norm, attn_out_norm, mlp_out_norm: a Gemma 3 layer's post-attention norm is on
    the attention block's output and its pre-feedforward norm before the MLP (the C side's
    post_norm, Llama's post_attention_layernorm), its post-feedforward norm on the MLP's output."""
    attn = layer.self_attn
    q_norm = attn.q_norm.weight if attn.q_norm is not None else None
    k_norm = attn.k_norm.weight if attn.k_norm is not None else None
    if hasattr(layer, "pre_feedforward_layernorm"):
        return (_ptr(q_norm), _ptr(k_norm), _ptr(layer.post_attention_layernorm.weight),
                _ptr(layer.post_feedforward_layernorm.weight))
    return _ptr(q_norm), _ptr(k_norm), None, None


def _embedding_ok(embedding: EmbeddingRows | None, spec: ModelSpec) -> bool:
    """Rows this path looks up: quantized, or float32 contiguous on the host, [vocab, hidden]."""
    if embedding is None:
        return False
    weight = embedding[0]
    if isinstance(weight, QuantWeight):
        return weight.codes.device.type == "cpu" and weight.shape[1] == spec.hidden_size
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
            and weight.dim() == 2 and weight.shape[1] == spec.hidden_size)


def _embedding_weight(weight: torch.Tensor | QuantWeight) -> _Weight:
    if isinstance(weight, QuantWeight):
        return _quant_weight(weight)
    return _Weight(weight.data_ptr(), None, None, None, 0, 0, 0, 0, 0)


def _inside(view: torch.Tensor, base: torch.Tensor) -> bool:
    start = base.data_ptr()
    return start <= view.data_ptr() < start + base.numel() * base.element_size()


def _projection(linear: nn.Linear) -> _Weight:
    quant = getattr(linear, "quant", None)
    if quant is None:
        return _Weight(linear.weight.data_ptr(), None, None, None, 0, 0, 0, 0, 0)
    return _quant_weight(quant)


def _quant_weight(quant: QuantWeight) -> _Weight:
    return _Weight(None, quant.codes.data_ptr(), quant.scale.data_ptr(), _ptr(quant.offset), quant.bits,
                   quant.group, quant.zero, int(quant.half_scales), int(quant.lanes))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
