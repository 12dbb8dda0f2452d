"""Engine throughput without shared prefixes: radixserve vs transformers' static batching.

    python -m bench.bench_engine [--num-prompts 32] [--hf-batch-size 32] [--plot engine.png]

Both run the same 32 prompts of 64-512 tokens with 32-128 new tokens each (greedy, EOS
ignored), in the same process, one after the other. Prints throughput, the ratio, and the
scheduler's own share of step time at full batch.
"""

from __future__ import annotations

import gc

from bench.lib.cli import apply_quick, bench_parser, write_json
from bench.lib.harness import run_hf_static, run_radixserve
from bench.lib.report import plot_bars, print_header, print_table, ratio_line
from bench.lib.workloads import no_sharing


def main() -> None:
    parser = bench_parser(__doc__, quick="8 prompts")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--min-output", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    apply_quick(parser, args, num_prompts=8)

    workload = no_sharing(args.num_prompts, args.min_prompt, args.max_prompt, args.min_output, args.max_output)
    print_header(
        "radixserve vs transformers generate (static batches, left padding) - no shared prefixes",
        [f"workload: {workload.description}", "greedy decoding, EOS ignored, default model, float32 on CPU"],
    )
    from radixserve import Engine

    engine = Engine()
    step_log: list = []
    ours = run_radixserve(engine, workload, step_log=step_log)
    results = [ours]
    model_path = engine.loaded.path
    del engine
    gc.collect()
    if not args.skip_hf:
        results.append(_run_static(model_path, workload, args.hf_batch_size))
    print_table(results)
    if len(results) > 1:
        print(ratio_line("radixserve / transformers-static", ours, results[1], target=1.5))
    _print_scheduler_share(step_log)
    if args.plot:
        plot_bars(args.plot, "no-sharing workload", ["generated tok/s", "total tok/s"],
                  {r.system: [r.generated_per_s, r.total_per_s] for r in results}, "tokens / s")
    if args.json:
        write_json(args.json, [r.__dict__ | {"records": None} for r in results], args)


def _run_static(model_path, workload, batch_size):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    result = run_hf_static(model, workload, batch_size, pad_token_id=model.config.eos_token_id or 0,
                           label=f"transformers-static(bs={batch_size})")
    del model
    gc.collect()
    return result


def _print_scheduler_share(step_log: list) -> None:
    if not step_log:
        return
    peak = max(n for n, _, _ in step_log)
    full = [(wall, t) for n, wall, t in step_log if n >= min(32, peak)]
    wall = sum(w for w, _ in full)
    sched = sum(t["schedule_s"] for _, t in full)
    post = sum(t["postprocess_s"] for _, t in full)
    print(
        f"scheduler share of step time over {len(full)} steps with >= {min(32, peak)} running: "
        f"schedule {sched / wall:.2%}, schedule + token bookkeeping {(sched + post) / wall:.2%} (target < 10%)"
    )


if __name__ == "__main__":
    main()
