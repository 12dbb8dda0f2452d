"""Quantized weights (--weight-dtype auto on a GGUF, int8, int4) against the same weights in float32.

    .venv/bin/python -m bench.bench_weights                      # accuracy and speed, the default model
    .venv/bin/python -m bench.bench_weights --quick              # fewer positions and repetitions
    .venv/bin/python -m bench.bench_weights --parts speed --plot weights.png
    .venv/bin/python -m bench.bench_weights --llama-server PATH  # plus llama.cpp's server on the same GGUF
    .venv/bin/python -m bench.bench_weights --json out.json
    .venv/bin/python -m bench.bench_weights --parts speed --model gemma3-270m --llama-server PATH
    .venv/bin/python -m bench.bench_weights --parts accuracy --model gemma3-270m
    .venv/bin/python -m bench.bench_weights --parts memory --model gemma3-270m --llama-server PATH

  accuracy  teacher-forced next-token distributions over real text (bench/lib/kv_quant_prompts.py's
            prompts and their float32 greedy continuations, >= --positions positions), fed in
            chunks of --chunk tokens so that every matmul takes the integer kernel (steps that
            large run it, as decodes and small prompt chunks do): top-1 agreement and mean
            KL(float32 || quantized) in nats, for the default model's own Q4_1 file and for
            GGUF files of other types made from its float32 weights by the `gguf` package's
            quantizer (Q4_0, Q5_0, Q5_1, Q8_0), and int8 / int4 quantized at load. The reference
            is each file's own weights dequantized to float32: only activation rounding differs.
  speed     the default model served from its Q4_1 file (auto) and in float32, in turns, one
            engine each: decode tokens/s at batch 1 and 8 (--new-tokens, EOS ignored), prompt
            tokens/s at 512 and 2,048 tokens, and each engine's weight bytes; with --llama-server,
            llama.cpp's server on the same GGUF file takes the same requests (its /completion with
            token ids), and the resident memory of each serving process at the same KV budget.
  memory    resident memory only: radixserve from the GGUF and llama.cpp's server (--llama-server
            or $LLAMA_SERVER) on the same file, each after one run of every speed workload and the
            KV written through. Both hold the KV bytes llama.cpp's server holds at 8 slots of 2,304
            tokens (Gemma 3: its window layers keep a window and a ubatch per slot, 348 MiB; the
            default model 810 MiB); targets <= 1.25x (default model) and <= 1.5x (Gemma 3).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from bench.lib.kv_quant_prompts import BLOCK, CHAT, RAW, attention_metadata, tokenized_prompts
from bench.lib.cli import apply_quick, bench_parser, write_json
from bench.lib.peers import add_llama_server
from radixserve import Engine, SamplingParams
from radixserve.attention.cpu_backend import CpuAttentionBackend
from radixserve.attention.kv_pool import KVPool
from radixserve.model.default_model import default_gguf_path
from radixserve.model.gguf_repack import HALF_SCALED

TARGETS = {"top1": 0.995, "kl": 0.005, "decode_b1": 1.0, "decode_b8": 1.5, "prompt": 1.0, "memory": 1.25}
MEMORY_TARGETS = {"default": 1.25, "gemma3-270m": 1.5}  # resident memory against llama.cpp's server (issue 58)
PROMPT_CHUNK = 256  # > the integer kernel's 128 rows: quantized weights are dequantized to float32
MADE_TYPES = ("Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
VARIANTS = ("Q4_1", *MADE_TYPES, "int8", "int4")


def main() -> None:
    args = _args()
    torch.manual_seed(0)
    report: dict = {}
    if "accuracy" in args.parts:
        report["accuracy"] = accuracy(args)
    if "speed" in args.parts:
        from bench.lib.weights_speed import speed

        report["speed"] = speed(args)
    if "memory" in args.parts:
        from bench.lib.weights_speed import memory

        report["memory"] = memory(args)
    report["layout_7b"] = layout_7b()
    _print(report)
    if args.json:
        write_json(args.json, report, args)
    if args.plot:
        _plot(args.plot, report)


# ---- accuracy -----------------------------------------------------------------------------------


def accuracy(args) -> list[dict]:
    if args.model != "default":  # another packaged model: its own file against its weights in float32
        reference = Engine(args.model, weight_dtype="float32", num_kv_blocks=64)
        sequences = _sequences(reference, args)
        quant = Engine(args.model, num_kv_blocks=64)
        return [_compare(f"{args.model} (its own file)", quant, reference, sequences, args)]
    reference = Engine(weight_dtype="float32", num_kv_blocks=64)
    sequences = _sequences(reference, args)
    rows = []
    variants = [("Q4_1", "Q4_1 (the default model's file)", {}, None)]
    variants += [(t, f"{t} (made from its float32 weights{_K_NOTE if t.endswith('_K') else ''})", None, t)
                 for t in MADE_TYPES]
    variants += [("int8", "int8 at load (per channel)", {"weight_dtype": "int8"}, None),
                 ("int4", "int4 at load (groups of 32)", {"weight_dtype": "int4"}, None)]
    variants = [v[1:] for v in variants if v[0] in args.types]
    with tempfile.TemporaryDirectory() as work:
        for label, options, made in variants:
            if made is not None:
                options = {"model": str(_made_gguf(made, Path(work)))}
            if made is not None:
                options["model_cache_dir"] = work
            quant = Engine(num_kv_blocks=64, **options)
            if "weight_dtype" in options:  # int8 / int4: their own weights, dequantized (steps past the kernel's rows)
                rows.append(_compare(label, quant, quant, sequences, args, base_chunk=PROMPT_CHUNK))
                rows.append(_compare(f"{label} vs the float32 checkpoint", quant, reference, sequences, args))
            else:
                base = reference if made is None else Engine(weight_dtype="float32", num_kv_blocks=64, **options)
                rows.append(_compare(label, quant, base, sequences, args))
                del base
            del quant
    return rows


def _sequences(engine: Engine, args) -> list[list[int]]:
    """Prompts and their float32 greedy continuations until --positions tokens in all."""
    try:
        prompts = tokenized_prompts(engine, args.prompts)
    except ValueError:  # a base model without a chat template (Gemma 3 270M): every prompt as plain text
        prompts = [engine.tokenizer.encode(p) for p in (RAW + CHAT)[: args.prompts]]
    greedy = SamplingParams(max_tokens=args.tf_tokens, temperature=0.0, ignore_eos=True)
    out, total = [], 0
    for prompt, o in zip(prompts, engine.generate(prompts, greedy, use_tqdm=False)):
        out.append(prompt + o.token_ids)
        total += len(out[-1])
        if total >= args.positions:
            break
    return out


def _compare(label: str, quant: Engine, base: Engine, sequences: list[list[int]], args,
             base_chunk: int | None = None) -> dict:
    """Teacher-forced distributions of `quant` (chunks the integer kernel takes) against `base`
    (float32 weights; or the same engine in chunks of `base_chunk`, past the kernel's rows,
    where the weight is dequantized and multiplied in float32)."""
    agree = kl = positions = 0
    for seq in sequences:
        q = forced_logits(quant, seq, args.chunk)
        f = forced_logits(base, seq, base_chunk or args.chunk)
        p, r = torch.log_softmax(f.double(), -1), torch.log_softmax(q.double(), -1)
        agree += int((f.argmax(-1) == q.argmax(-1)).sum())
        kl += float((p.exp() * (p - r)).sum())
        positions += len(seq)
        print(f"  accuracy {label}: {positions} positions, top-1 {agree / positions:.2%}", end="\r", flush=True)
    print()
    return {"label": label, "weights": quant.loaded.weight_dtype, "weight_mib": quant.loaded.weight_bytes / 2**20,
            "float_mib": base.loaded.weight_bytes / 2**20 if base is not quant else None, "positions": positions, "top1": agree / positions,
            "kl": kl / positions}


def forced_logits(engine: Engine, tokens: list[int], chunk: int) -> torch.Tensor:
    """Next-token logits at every position of `tokens`, computed `chunk` tokens a call over a
    fresh float32 pool (each chunk extends the KV the earlier chunks wrote)."""
    model, spec = engine.runner.model, engine.loaded.spec
    n, blocks = len(tokens), -(-len(tokens) // BLOCK)
    pool = KVPool(spec.num_layers, blocks, BLOCK, spec.num_kv_heads, spec.head_dim, torch.float32,
                  torch.device("cpu"))
    backend = CpuAttentionBackend(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.attention_scale,
                                  torch.float32, pool.pages)
    out = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        meta = attention_metadata(0, [0, end - start], [end], [list(range(blocks))], list(range(start, end)))
        ids, positions = torch.tensor(tokens[start:end]), torch.arange(start, end)
        out.append(model(ids, positions, backend, pool, backend.prepare(meta), torch.arange(end - start)))
    return torch.cat(out)


_K_NOTE = "; ffn_down only: the model's other matrices have 576 columns, not whole 256-value blocks"


def _made_gguf(kind: str, work: Path) -> Path:
    """The default GGUF with its Q4_1 tensors requantized to `kind` from their float32 values
    (the gguf package's quantizer; bench/lib/gguf_kquants.py for K types, which take only rows of
    whole 256-value blocks), the Q8_0 embedding and float tensors kept; written under `work`."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

    from bench.lib.gguf_kquants import quantize_k

    source = GGUFReader(default_gguf_path())
    path = work / f"smollm2-{kind}.gguf"
    writer = GGUFWriter(str(path), arch="llama")
    for field in source.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1]
                             if field.types[0].name == "ARRAY" else None)
    target = GGMLQuantizationType[kind]
    for t in source.tensors:
        shape = [int(d) for d in reversed(t.shape)]
        k_type = kind.endswith("_K")
        if t.tensor_type.name == "Q4_1" and (not k_type or shape[-1] % 256 == 0):
            values = np.ascontiguousarray(quants.dequantize(t.data, t.tensor_type).reshape(shape), dtype=np.float32)
            data = quantize_k(values, kind) if k_type else quants.quantize(values, target)
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=target)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- a 7B model's layout ------------------------------------------------------------------------

# GGUF bytes per weight, and radixserve's (kernels/quant_linear.py: codes, a scale and an offset per
# group, float32 for the K types, float16 for the legacy ones; gguf_repack.py says which layout each type takes)
GGUF_BYTES = {"Q4_K": 144 / 256, "Q6_K": 210 / 256}
SCALE_BYTES = {kind: 2 if kind in HALF_SCALED else 4 for kind in GGUF_BYTES}
OUR_BYTES = {"Q4_K": 0.5 + 2 * SCALE_BYTES["Q4_K"] / 32, "Q6_K": 1 + SCALE_BYTES["Q6_K"] / 16}


def layout_7b() -> dict:
    """A Llama-2-7B-shaped model (32 layers, hidden 4096, MLP 11008, vocab 32000) quantized as
    llama.cpp's Q4_K_M mixes types (Q6_K for attn_v and ffn_down in the layers its
    use_more_bits rule picks, and for the output; Q4_K elsewhere): bytes as the GGUF holds
    them, as radixserve holds them, and as float32."""
    layers, hidden, inter, vocab = 32, 4096, 11008, 32000
    tensors = [("Q4_K", vocab * hidden), ("Q6_K", vocab * hidden)]  # token_embd, output
    for i in range(layers):
        more = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        tensors += [("Q4_K", 3 * hidden * hidden), ("Q6_K" if more else "Q4_K", hidden * hidden)]  # q, k, o; v
        tensors += [("Q4_K", 2 * hidden * inter), ("Q6_K" if more else "Q4_K", inter * hidden)]  # gate, up; down
    weights = sum(n for _, n in tensors)
    return {"weights": weights, "gguf_gib": sum(GGUF_BYTES[t] * n for t, n in tensors) / 2**30,
            "radixserve_gib": sum(OUR_BYTES[t] * n for t, n in tensors) / 2**30, "float32_gib": 4 * weights / 2**30}


# ---- report -------------------------------------------------------------------------------------


def _verdict(ok: bool) -> str:
    return "[meets target]" if ok else "[BELOW target]"


def _print(report: dict) -> None:
    print("\n" + "=" * 100)
    print(f"Quantized weights against the same weights in float32 (torch threads {torch.get_num_threads()})")
    print("=" * 100)
    for row in report.get("accuracy", []):
        ok = row["top1"] >= TARGETS["top1"] and row["kl"] <= TARGETS["kl"]
        verdict = "(the quantization of the weights themselves: no target)" if "checkpoint" in row["label"] \
            else _verdict(ok)
        against = f"float32 {row['float_mib']:.1f} MiB" if row["float_mib"] else "its own weights in float32"
        print(f"  {row['label']:<36} {row['weights']:<18} {row['weight_mib']:7.1f} MiB ({against})"
              f"  {row['positions']} positions: top-1 {row['top1']:.2%} (>= {TARGETS['top1']:.1%}), KL "
              f"{row['kl']:.2g} nats (<= {TARGETS['kl']}) {verdict}")
    if "speed" in report:
        from bench.lib.weights_speed import print_speed

        print_speed(report["speed"], {**TARGETS, "memory": MEMORY_TARGETS[report["speed"]["model"]]})
    if "memory" in report:
        from bench.lib.weights_speed import print_memory

        print_memory(report["memory"], MEMORY_TARGETS[report["memory"]["model"]])
    lay = report["layout_7b"]
    print(f"a 7B Llama-shaped model as Q4_K_M ({lay['weights'] / 1e9:.2f}B weights), computed from the layouts: "
          f"GGUF {lay['gguf_gib']:.2f} GiB, radixserve {lay['radixserve_gib']:.2f} GiB "
          f"({lay['radixserve_gib'] / lay['gguf_gib']:.2f}x), float32 {lay['float32_gib']:.1f} GiB")


def _plot(path: str, report: dict) -> None:
    from bench.lib.report import plot_bars

    if "speed" in report:
        rows = report["speed"]["rows"]
        systems = list(rows[0]["rate"])
        plot_bars(path, f"tokens/s by workload ({report['speed']['model']} model)", [r["workload"] for r in rows],
                  {s: [r["rate"][s] for r in rows] for s in systems}, "tokens/s")
    elif "accuracy" in report:
        rows = report["accuracy"]
        plot_bars(path, "top-1 agreement with float32 weights", [r["label"].split(" ")[0] for r in rows],
                  {"top-1 %": [100 * r["top1"] for r in rows]}, "%")


def _args():
    p = bench_parser(__doc__, quick="2,000 positions, 128 forced tokens, 64 new tokens, one repetition")
    p.add_argument("--parts", nargs="+", default=["accuracy", "speed"], choices=["accuracy", "speed", "memory"])
    p.add_argument("--model", default="default", choices=["default", "gemma3-270m"],
                   help="the model served (accuracy: the default model's variants, or another model's own file)")
    p.add_argument("--types", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="accuracy variants")
    p.add_argument("--positions", type=int, default=10_000, help="teacher-forced positions per variant")
    p.add_argument("--prompts", type=int, default=52)
    p.add_argument("--tf-tokens", type=int, default=256, help="float32 greedy tokens after each prompt")
    p.add_argument("--chunk", type=int, default=64, help="tokens per forced call (<= 128: the integer kernel)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kv-memory-mb", type=int, default=256, help="the KV budget every server gets")
    add_llama_server(p, "a llama.cpp llama-server binary (or $LLAMA_SERVER): served side by side")
    p.add_argument("--llama-threads", type=int, default=2)
    args = p.parse_args()
    apply_quick(p, args, positions=2_000, tf_tokens=128, new_tokens=64, reps=1)
    return args


if __name__ == "__main__":
    main()
