"""A step-count simulation of bench_hybrid_kv's agent swarm, for what reuse a hybrid KV
budget allows: the real engine (scheduler, radix cache, window pages) on a tiny random
Gemma 3 shaped like Gemma 3 270M where the cache sees it (block 16, a 512-token window on
five of every six layers), the bench's KV budget in blocks and window pages, the bench's
seeded agents, and a virtual clock advanced by each step's tokens (arrivals, tool pauses and
overlap follow the same script as the bench's). It tells reuse and memory, never time; a run
takes seconds.

    python -m bench.hybrid_swarm_sim [--swarm-workload short|long] [--memory-share 0.4]
        [--blocks N --window-pages N] [--max-num-seqs 8] [--seeds 0,1,2,3] [--quick] [--json F] [--plot F]
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from bench.lib.cli import bench_parser
from bench.lib.report import plot_bars
from bench.lib.swarm import SWARMS, AgentSwarm, SwarmAgent, ideal_cached, remember

BLOCK, WINDOW, VOCAB = 16, 512, 128
LAYERS, WINDOW_LAYERS = 18, 15  # Gemma 3 270M: five of every six layers attend to a window
FULL_LAYERS = LAYERS - WINDOW_LAYERS
STEP_S, PREFILL_TOKEN_S, DECODE_TOKEN_S = 0.05, 0.0013, 0.002  # ~Gemma 3 270M on two cores


@dataclass
class SimResult:
    seed: int
    blocks: int
    window_pages: int
    memory_share: float  # of full caching's (1.25x the working set, every layer)
    credited: int = 0
    ideal: int = 0
    preemptions: int = 0
    evicted_blocks: int = 0
    trimmed_pages: int = 0
    virtual_s: float = 0.0

    @property
    def reuse(self) -> float:
        return self.credited / self.ideal if self.ideal else 0.0


def tiny_gemma3(directory: Path) -> Path:
    """A random 6-layer Gemma 3 (5 window layers of 512, 1 full), saved once."""
    if (directory / "config.json").exists():
        return directory
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                              layer_types=["sliding_attention"] * 5 + ["full_attention"],
                              max_position_embeddings=16384)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def budget(workload: AgentSwarm, share: float, ratio: float = 0.25) -> tuple[int, int]:
    """Blocks and window pages that share of full caching's KV buys at `ratio` pages a block."""
    full = 1.25 * workload.working_set_tokens() * LAYERS
    blocks = int(share * full / (BLOCK * (FULL_LAYERS + ratio * WINDOW_LAYERS)))
    return blocks, int(blocks * ratio)


def memory_share(workload: AgentSwarm, blocks: int, pages: int) -> float:
    return BLOCK * (blocks * FULL_LAYERS + pages * WINDOW_LAYERS) / (1.25 * workload.working_set_tokens() * LAYERS)


def simulate(model: Path, workload: AgentSwarm, blocks: int, pages: int, max_num_seqs: int) -> SimResult:
    from radixserve import Engine, SamplingParams

    engine = Engine(str(model), block_size=BLOCK, num_kv_blocks=blocks, window_pages_ratio=pages / blocks,
                    max_num_seqs=max_num_seqs)
    result = SimResult(workload.seed, blocks, engine.pool.window.num_pages,
                       memory_share(workload, blocks, engine.pool.window.num_pages))
    rng = random.Random(workload.seed)
    tool = [rng.randrange(VOCAB) for _ in range(workload.tool_prompt)]
    agents = [SwarmAgent(i, workload, tool, 0, VOCAB) for i in range(workload.agents)]
    ready = {a.index: a.start for a in agents}  # agents between turns, and when they come back
    left = {a.index: workload.turns for a in agents}
    inflight: dict[str, tuple[SwarmAgent, list[int], int]] = {}
    seen: set[int] = set()
    params = SamplingParams(max_tokens=workload.answer, temperature=0.0, ignore_eos=True)
    now = 0.0
    while ready or inflight:
        for agent in [a for a in agents if a.index in ready and ready[a.index] <= now]:
            del ready[agent.index]
            prompt = list(agent.context)
            ideal = ideal_cached(prompt, seen)
            remember(prompt[:-1], seen)
            inflight[engine.add_request(prompt, params)] = (agent, prompt, ideal)
        if not inflight:
            now = min(ready.values())
            continue
        outputs = engine.step()
        decoded, prefilled = engine.last_step_tokens
        now += STEP_S + PREFILL_TOKEN_S * prefilled + DECODE_TOKEN_S * decoded
        for out in (o for o in outputs if o.finished):
            agent, prompt, ideal = inflight.pop(out.request_id)
            result.credited += min(out.cached_tokens, ideal)
            result.ideal += ideal
            remember((prompt + out.token_ids)[:-1], seen)
            agent.context = prompt + out.token_ids + agent.tokens(workload.tool_result)
            left[agent.index] -= 1
            if left[agent.index]:
                ready[agent.index] = now + agent.rng.uniform(*workload.latency)
    stats = engine.stats()
    result.preemptions, result.evicted_blocks = stats["preemptions"], stats["evicted_blocks"]
    result.trimmed_pages, result.virtual_s = engine.pool.window.trimmed, now
    engine.close()
    return result


def main() -> None:
    parser = bench_parser(__doc__, quick="the swarm workload's quick size", plot="write each seed's reuse here (PNG)",
                          json_help="write each seed's result here (JSON)")
    parser.add_argument("--swarm-workload", choices=sorted(SWARMS), default="short")
    parser.add_argument("--memory-share", type=float, default=0.4, help="of full caching's KV (bench_hybrid_kv's)")
    parser.add_argument("--blocks", type=int, default=None, help="instead of --memory-share: blocks ...")
    parser.add_argument("--window-pages", type=int, default=None, help="... and window pages")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "radixserve-sim-gemma3"))
    args = parser.parse_args()
    workload = SWARMS[args.swarm_workload][1 if args.quick else 0]
    blocks, pages = budget(workload, args.memory_share)
    blocks, pages = args.blocks or blocks, args.window_pages or pages
    model = tiny_gemma3(Path(args.model_dir))
    results = [simulate(model, replace(workload, seed=int(s)), blocks, pages, args.max_num_seqs)
               for s in args.seeds.split(",")]
    print(f"{args.swarm_workload}: {workload.describe()}; max_num_seqs {args.max_num_seqs}")
    for r in results:
        print(f"  seed {r.seed}: {r.blocks} blocks + {r.window_pages} window pages ({r.memory_share:.2f}x full "
              f"caching's KV): {r.reuse:.1%} of ideal reuse ({r.credited} of {r.ideal}); {r.preemptions} "
              f"preemptions, {r.evicted_blocks} blocks evicted, {r.trimmed_pages} window pages trimmed; "
              f"{r.virtual_s:.1f} virtual s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**vars(r), "reuse": r.reuse} for r in results], f, indent=2)
    if args.plot:
        plot_bars(args.plot, f"simulated swarm ({args.swarm_workload}): share of ideal reuse",
                  [f"seed {r.seed}" for r in results], {"reuse": [r.reuse for r in results]}, "share of ideal")


if __name__ == "__main__":
    main()
