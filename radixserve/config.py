"""EngineConfig: every engine option in one frozen, validated dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import os
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
SPECULATIVE_METHODS = ("prompt-lookup", "suffix")
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
PREFILL_ATTENTION_DTYPES = ("float32", "bfloat16")
PREFILL_MATMUL_DTYPES = ("float32", "bfloat16")
QUANTIZED_PROMPT_MATMULS = ("integer", "float32")
WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "int8", "int4")
KV_EVENT_HASHES = ("chained", "chained64")
KV_EVENT_FORMATS = ("map", "array")  # engine/kv_events.py: vLLM's current form, or the older arrays


@dataclass(frozen=True)
class EngineConfig:
    """Options of an Engine. Values the model decides (context length, pool size when
    `num_kv_blocks` is None) are resolved by the Engine once the model is loaded."""

    model: str | None = None  # None: the default SmolLM2-135M-Instruct; or a HF dir / .gguf file
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    # How the weights are held. auto: a GGUF's quantized tensors as stored (CPU: Q4_0, Q4_1,
    # Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K repacked once, multiplied on int8 dot products), other
    # checkpoints as they are; float32 / bfloat16: dequantized to that dtype (the model's
    # dtype too); int8 (per output channel) / int4 (groups of 32): a float checkpoint quantized
    # at load. Quantized weights run on CPU with float32 activations.
    weight_dtype: str = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    attention_backend: str = "auto"  # auto: triton on CUDA; on CPU cpu (C kernels), else torch
    block_size: int = 16  # tokens per KV block
    # auto: the model's dtype; int8: symmetric int8 codes with one float32 scale per token and
    # KV head, inside each block (~3.8x the blocks at the same kv_cache_memory, CPU and GPU);
    # fp8_e4m3: float8 e4m3 codes in the same page (the same blocks as int8): Triton kernels on
    # GPUs of compute capability 8.9+, or the torch attention backend (on CPU: torch only)
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for the KV pool; None: a share of free memory
    # CPU: commit the KV pool's pages when it is made, so the process holds its whole KV budget
    # from the start instead of growing into it as blocks are first written (`serve` turns it on)
    prefault_kv_pool: bool = False
    max_model_len: int | None = None  # None: the model's own context length
    max_num_batched_tokens: int = 2048  # tokens computed per step, all requests together
    chunked_prefill_size: int = 512  # most prompt tokens one request computes in one step
    # Prompt tokens a step may compute while requests decode (None: no cap beyond
    # max_num_batched_tokens). A cap spreads a burst of prompts over several steps: shorter
    # stalls of every stream, but more of them (measured here: gap p95 and TTFT p95 rose).
    max_prefill_tokens_decoding: int | None = None
    max_num_seqs: int = 128  # most requests running at once
    enable_prefix_cache: bool = True
    schedule_policy: str = "lpm"
    starvation_steps: int = 64  # a waiting request passed over this many steps goes first
    policy_fcfs_threshold: int = 256  # longer waiting queues are served fcfs (sorting costs more)
    seed: int = 0  # seeds the sampler of requests that set no seed of their own
    model_cache_dir: str | None = None  # where the default model is converted to; None: user cache
    num_threads: int | None = None  # a step's CPU threads, fixed; None: the usable cores less those others take (cpu_share.py)
    # CPU, float32: run a decode step's layers in one C call where the step allows, and lay a
    # small step's prompt chunks out as single-query rows so that it takes those steps too
    # (their attention then runs the decode kernel instead of SDPA: same math, other rounding);
    # off: every step layer by layer from Python, prompt chunks through SDPA, to compare.
    native_decoder: bool = True
    # CPU, float32: matmuls too large for the skinny kernel (prefill chunks) run on oneDNN,
    # ~2x torch's MKL on the dev machine's AMD CPU (AVX-512); off: MKL, to compare.
    onednn_linear: bool = True
    # CPU, float32: prompt chunks (whole prompts, extends over a cached prefix) attend through
    # the tiled C kernel over the paged pool; off: torch's SDPA over gathered pages, to compare.
    tiled_prefill_attention: bool = True
    # CPU, tiled kernel: bfloat16 runs prompt attention's two products (q.k and P.V) on
    # AVX512_BF16's bf16 dot products, inputs rounded to bf16 and sums, softmax and output
    # in float32: about half the kernel's time, at about int8 KV's accuracy; refused where the
    # CPU lacks AVX512_BF16. float32: exact, what greedy equality with transformers is tested on.
    prefill_attention_dtype: str = "float32"
    # CPU, float32 model, oneDNN on: bfloat16 runs the layers' matmuls of prompt rows in steps
    # too large for the skinny kernel on bf16 inputs through a bf16 copy of the weights (+half
    # their bytes), float32 sums and activations between: ~1.8x their rate, at a larger accuracy
    # cost than bf16 attention; refused where the CPU lacks native bf16 (AVX512_BF16 or AMX).
    # Decode rows (alone or sharing a step with prompts) and the logits stay float32.
    prefill_matmul_dtype: str = "float32"
    # CPU, quantized weights (a GGUF's, int8/int4): integer multiplies a step's prompt rows past
    # the skinny kernel's on AVX512-VNNI integer dot products against the weight's own codes
    # (kernels/quant_linear.py's lanes layout: the activations rounded to ~16 bits, as every
    # decode row's already are), ~1.2-1.4x the float32 rate on Gemma 3's shapes; float32
    # dequantizes the weight and multiplies in float32 (oneDNN), to compare. Without VNNI: float32.
    quantized_prompt_matmul: str = "integer"
    # Second KV tier: blocks evicted from the pool move there and are restored on a hit.
    kv_offload_memory: int | None = None  # bytes for the tier; None: no tier (2 GiB when a directory is set)
    kv_offload_dir: str | None = None  # the tier is a file here (mmap; alone: a 2 GiB tier); None: anonymous memory
    kv_persist_dir: str | None = None  # keep the tier and its index here across restarts
    session_ttl_s: int = 600  # an agent session idle this long releases its hold on the cache
    hint_max_ttl_s: int = 3600  # agent hints' ttl_s is capped at this (a hold, never reserved memory)
    hint_priority_ttl_s: int = 60  # a finished request with priority > 0 (and no ttl_s) holds its prefix this long
    # Step-time target while requests decode: each step's prefill tokens are sized by a cost
    # model fitted to measured step times so that the step stays under it; 0: no target.
    max_step_ms: int = 0
    # With max_step_ms: a prompt's first token is due this long after it arrived. A step
    # takes more prompt tokens than max_step_ms allows when fewer would miss that (steps
    # with decodes stretch then, but the prompt's TTFT holds); 0: steps stay under target.
    ttft_target_ms: int = 0
    # Append one JSON line per step here: when it ended (time.monotonic, which every process
    # on the machine shares), its ms and its decode and prompt tokens; to study latency.
    step_trace: str | None = None
    # KV cache events for external routers (engine/kv_events.py: vLLM's wire format): a ZMQ PUB
    # endpoint to bind (tcp://127.0.0.1:5557), a ROUTER endpoint that replays buffered batches,
    # and how blocks are named (chained: the cache's 128-bit chained hash as 16 bytes; chained64:
    # its low 64 bits), in which form (map: vLLM's current named fields, with cache groups;
    # array: the older positional arrays). None: no events (the default).
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_hash: str = "chained"
    kv_events_format: str = "map"
    # Models with sliding-window layers (Gemma 2/3, Mistral): "auto" keeps those layers' KV
    # apart (core/window_pages.py), only within a window of where a request reads or a cached
    # prefix ends, with `window_pages_ratio` window pages per block (the second tier and its
    # persistence keep them too); "off" keeps every layer's KV for every token.
    hybrid_kv: str = "auto"
    window_pages_ratio: float = 0.25
    # "prompt-lookup": draft from the request's own tokens; "suffix": from them and from the
    # prefix cache's stored sequences of the request's namespace, scored by frequency; None: off
    speculative: str | None = None
    num_speculative_tokens: int = 8  # most draft tokens per request and step (drafts start at 4 and double)
    prompt_lookup_max: int = 4  # longest n-gram matched against the request's earlier tokens
    prompt_lookup_min: int = 2  # shortest n-gram that may propose a draft
    speculative_max_batch: int = 8  # speculate only while at most this many requests decode
    # drafts as long as the step times measured here by rows and the request's acceptance make
    # pay, none where no length does (core/draft_length.py); off: the acceptance rule alone
    # (drafts that do not depend on timing: reproducible counts)
    speculative_adaptive: bool = True
    # suffix drafting: most candidates a draft-tree node branches into (core/draft_tree.py), all
    # verified in one step; 1: one chain (extra rows cost nearly a row's step each on the AVX2
    # dev machine, so branches rarely pay there: docs/speculative.md)
    speculative_tree_width: int = 1
    jump_forward: bool = True  # constrained requests draft the text their grammar forces (verified in one step)

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("weight_dtype", self.weight_dtype, WEIGHT_DTYPES)
        _check_choice("kv_events_hash", self.kv_events_hash, KV_EVENT_HASHES)
        _check_choice("kv_events_format", self.kv_events_format, KV_EVENT_FORMATS)
        _check_choice("hybrid_kv", self.hybrid_kv, ("auto", "off"))
        if not 0 < self.window_pages_ratio <= 1:
            raise ValueError(f"window_pages_ratio must be in (0, 1], got {self.window_pages_ratio}")
        if (self.kv_events_replay_endpoint or self.kv_events_hash != "chained" or self.kv_events_format != "map") \
                and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint, kv_events_hash and kv_events_format work with "
                             "kv_events_endpoint: set it too")
        if self.kv_events_endpoint and not self.enable_prefix_cache:
            raise ValueError("kv_events_endpoint publishes the prefix cache's blocks: enable_prefix_cache is off")
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("prefill_attention_dtype", self.prefill_attention_dtype, PREFILL_ATTENTION_DTYPES)
        _check_choice("prefill_matmul_dtype", self.prefill_matmul_dtype, PREFILL_MATMUL_DTYPES)
        _check_choice("quantized_prompt_matmul", self.quantized_prompt_matmul, QUANTIZED_PROMPT_MATMULS)
        _check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        if not (self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        _check_positive("block_size", self.block_size)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive("chunked_prefill_size", self.chunked_prefill_size)
        if self.max_prefill_tokens_decoding is not None:
            _check_positive("max_prefill_tokens_decoding", self.max_prefill_tokens_decoding)
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("starvation_steps", self.starvation_steps)
        _check_positive("policy_fcfs_threshold", self.policy_fcfs_threshold)
        if self.speculative is not None:
            _check_choice("speculative", self.speculative, SPECULATIVE_METHODS)
        for name in ("max_step_ms", "ttft_target_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer (0: off), got {value!r}")
        if self.ttft_target_ms and not self.max_step_ms:
            raise ValueError("ttft_target_ms works with the step budget: set max_step_ms too")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "speculative_max_batch",
                     "speculative_tree_width"):
            _check_positive(name, getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )
        _check_positive("session_ttl_s", self.session_ttl_s)
        _check_positive("hint_max_ttl_s", self.hint_max_ttl_s)
        if self.hint_priority_ttl_s < 0:
            raise ValueError(f"hint_priority_ttl_s must be >= 0, got {self.hint_priority_ttl_s}")
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len", "num_threads", "kv_offload_memory"):
            value = getattr(self, name)
            if value is not None:
                _check_positive(name, value)
        if self.step_trace is not None:
            trace = Path(self.step_trace)
            if trace.is_dir() or not trace.parent.is_dir():
                raise ValueError(f"step_trace must be a file in an existing directory, got {self.step_trace!r}")
        _check_takes_effect(self)
        if self.prefill_attention_dtype == "bfloat16" and (
                not self.tiled_prefill_attention or self.attention_backend not in ("auto", "cpu")):
            raise ValueError("prefill_attention_dtype bfloat16 is the cpu attention backend's tiled prompt kernel: "
                             "it needs attention_backend auto or cpu and tiled_prefill_attention on")
        if self.prefill_matmul_dtype == "bfloat16" and (not self.onednn_linear or self.dtype not in ("auto", "float32")
                                                         or self.device.startswith("cuda")):
            raise ValueError("prefill_matmul_dtype bfloat16 is oneDNN's matmuls of a float32 model on CPU: "
                             "it needs onednn_linear on, dtype auto or float32 and device auto or cpu")
        if self.kv_cache_dtype == "fp8_e4m3" and self.attention_backend == "cpu":
            raise ValueError("kv_cache_dtype fp8_e4m3 is not read by the cpu attention backend (its C kernels read "
                             "float32 and int8 pages): use --attention-backend torch, or --kv-cache-dtype int8")
        if self.chunked_prefill_size > self.max_num_batched_tokens:
            raise ValueError(
                f"chunked_prefill_size ({self.chunked_prefill_size}) must not exceed "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


_SPECULATIVE_KNOBS = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "speculative_max_batch",
                      "speculative_adaptive", "speculative_tree_width")
_CACHE_KNOBS = ("session_ttl_s", "kv_offload_memory", "kv_offload_dir", "kv_persist_dir")


def _check_takes_effect(config: EngineConfig) -> None:
    """Refuse options set to something other than their default where they would do
    nothing (an option that is silently ignored changes a deployment's meaning)."""
    if config.speculative is None:
        _refuse_changed(config, _SPECULATIVE_KNOBS, "take effect with speculative decoding: set speculative too")
    elif config.speculative != "suffix":
        _refuse_changed(config, ("speculative_tree_width",), "shapes suffix drafting's trees: set speculative suffix")
    if not config.enable_prefix_cache:
        _refuse_changed(config, _CACHE_KNOBS, "need the prefix cache: drop --no-enable-prefix-cache")
        if config.schedule_policy != "fcfs" and config.schedule_policy != _default("schedule_policy"):
            raise ValueError(f"schedule_policy {config.schedule_policy!r} orders by cached prefixes: it needs "
                             "the prefix cache")
    if config.schedule_policy == "fcfs" or not config.enable_prefix_cache:
        _refuse_changed(config, ("policy_fcfs_threshold",), "applies to the cache-aware policies (lpm, dfs-weight)")
    if config.model is not None and not str(config.model).endswith(".gguf"):
        _refuse_changed(config, ("model_cache_dir",), "is where the default model or a .gguf file is converted to: "
                        "it does nothing with a model directory")


def _refuse_changed(config: EngineConfig, names: tuple[str, ...], why: str) -> None:
    changed = [n for n in names if getattr(config, n) != _default(n)]
    if changed:
        raise ValueError(f"{', '.join(changed)} {why}")


def _default(name: str) -> object:
    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def cache_root(cache_dir: str | None = None) -> Path:
    """Where converted models and built kernels live: the argument, else
    $RADIXSERVE_CACHE_DIR, else $XDG_CACHE_HOME/radixserve, else ~/.cache/radixserve."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("RADIXSERVE_CACHE_DIR"):
        return Path(os.environ["RADIXSERVE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "radixserve"
