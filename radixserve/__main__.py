"""Command line: `radixserve generate|serve|prepare|convert` (also `python -m radixserve`).

`serve` runs one engine behind the HTTP server (radixserve.server), or with --replicas /
--ray-address several as Ray Serve replicas (radixserve.cluster); the choice is made here,
so the server never imports the cluster."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from typing import Any

from radixserve.config import (
    ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, PREFILL_ATTENTION_DTYPES, PREFILL_MATMUL_DTYPES, QUANTIZED_PROMPT_MATMULS,
    SCHEDULE_POLICIES,
    KV_EVENT_FORMATS, KV_EVENT_HASHES, SPECULATIVE_METHODS, WEIGHT_DTYPES, EngineConfig,
)

_CHOICES = {
    "dtype": DTYPES, "attention_backend": ATTENTION_BACKENDS, "schedule_policy": SCHEDULE_POLICIES,
    "speculative": SPECULATIVE_METHODS, "kv_cache_dtype": KV_CACHE_DTYPES,
    "prefill_attention_dtype": PREFILL_ATTENTION_DTYPES,
    "prefill_matmul_dtype": PREFILL_MATMUL_DTYPES, "weight_dtype": WEIGHT_DTYPES, "kv_events_hash": KV_EVENT_HASHES,
    "kv_events_format": KV_EVENT_FORMATS,
    "hybrid_kv": ("auto", "off"), "quantized_prompt_matmul": QUANTIZED_PROMPT_MATMULS,
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (--block-size, --enable-prefix-cache/--no-..., ...)."""
    group = parser.add_argument_group("engine options")
    defaults = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if f.type in ("bool", bool):
            group.add_argument(flag, default=default, action=argparse.BooleanOptionalAction)
            continue
        name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        kind = int if name.startswith("int") else float if name.startswith("float") else str
        group.add_argument(flag, type=kind, default=default, choices=_CHOICES.get(f.name), metavar=None)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in EngineConfig.field_names()}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_engine_args(gen)

    serve = sub.add_parser("serve", help="run the HTTP server (OpenAI-compatible and native endpoints)")
    _add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(prefault_kv_pool=True)  # a server holds its KV budget from the start

    prep = sub.add_parser("prepare", help="convert the default model once into the model cache (float32 and its "
                                          "quantized layout), build the CPU kernels")
    prep.add_argument("--model-cache-dir", default=None)
    prep.add_argument("--model", action="append", default=[], metavar="NAME",
                      help="also prepare a packaged model (assembled, its quantized layout written); repeatable")
    prep.add_argument("--float32", action="store_true",
                      help="also convert --model models to float32 safetensors (what the tests compare with)")

    conv = sub.add_parser("convert", help="convert a GGUF file into a safetensors model directory")
    conv.add_argument("gguf")
    conv.add_argument("output_dir")

    return parser


def _generate(args: argparse.Namespace) -> int:
    from radixserve import Engine, SamplingParams

    engine = Engine(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    has_template = engine.tokenizer is not None and getattr(engine.tokenizer, "chat_template", None)
    prompt: str | list[int] = args.prompt
    if has_template and not args.raw:
        prompt = engine.apply_chat_template([{"role": "user", "content": args.prompt}])
    out = engine.generate([prompt], params, use_tqdm=False)[0]
    print(out.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from radixserve.kernels.heap import use_one_arena

    use_one_arena()  # before any thread: the engine thread's freed steps go where a trim returns them
    from radixserve.cluster.launch import cluster_requested, refuse_cluster_flags_alone, serve_cluster
    from radixserve.server.launch import serve, server_options

    if cluster_requested(args):
        return serve_cluster(args, engine_kwargs(args), server_options(args))
    refuse_cluster_flags_alone(args)
    return serve(args, engine_kwargs(args))


def _prepare(args: argparse.Namespace) -> int:
    from radixserve.model.default_model import default_gguf_path, ensure_default_model
    from radixserve.model.loader import repacked_weights
    from radixserve.kernels.native_build import build_all

    directory = ensure_default_model(args.model_cache_dir)
    repacked_weights(default_gguf_path(), directory)  # the quantized layout `auto` serves, once
    print(directory)
    for name in args.model:
        print(_prepare_packaged(name, args.model_cache_dir, args.float32))
    build_all()
    return 0


def _prepare_packaged(name: str, cache_dir: str | None, float32: bool):
    from radixserve.model.default_model import ensure_converted_gguf
    from radixserve.model.loader import repacked_weights
    from radixserve.model.packaged_models import PACKAGED_MODELS, packaged_gguf

    if name not in PACKAGED_MODELS:
        raise ValueError(f"no packaged model {name!r}; packaged models: {', '.join(PACKAGED_MODELS)}")
    gguf = packaged_gguf(name, cache_dir)
    directory = ensure_converted_gguf(gguf, cache_dir, float_weights=float32)  # a float32 one replaces the other
    repacked_weights(gguf, directory)
    return directory


def _convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from radixserve.model.default_model import convert_gguf

    print(convert_gguf(Path(args.gguf), Path(args.output_dir)))
    return 0


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    from radixserve.cluster.launch import add_cluster_args
    from radixserve.server.launch import add_server_args

    add_server_args(parser)
    add_cluster_args(parser)


_COMMANDS = types.MappingProxyType(
    {"generate": _generate, "serve": _serve, "prepare": _prepare, "convert": _convert}
)

if __name__ == "__main__":
    sys.exit(main())
