"""Agent loops on a tiny random-weight model with recurrent layers (Qwen3.5's Gated DeltaNet,
LFM2's short convolutions, or Granite 4.0-H's Mamba2), as messages: the workload of bench_recurrent_agents (issue 60).

Agents share one long tool prompt (a system message listing tools), each has its own task;
every turn the agent's whole conversation is rendered again through the chat template (the
earlier replies as message text, their generated ids spliced back as a server with
--reply-token-reuse does), the agent answers greedily, and a tool result is appended. All
agents of a turn are sent at once. The model is built here: a tiny config of the family with
random weights and the default model's tokenizer and chat template (ChatML), so no weights are
downloaded and the output's quality does not matter (only what is computed and reused).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

WORDS = ("city unit celsius result query value string integer number optional list returns the of a for "
         "with when order status table file path line range match first last count limit page token").split()
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@dataclass(frozen=True)
class AgentLoops:
    agents: int
    turns: int
    tool_prompt: int  # tokens of the shared system message (at least)
    task: int  # words of each agent's task
    tool_result: int  # words of each tool result
    answer: int  # tokens of each reply (max_tokens; greedy, never stopping early)
    seed: int = 0

    def describe(self) -> str:
        return (f"{self.agents} agents x {self.turns} turns; shared tool prompt >= {self.tool_prompt} tokens, task "
                f"{self.task} words, tool result {self.tool_result} words, reply {self.answer} tokens; "
                "the full history re-rendered as messages each turn")


FULL = AgentLoops(agents=8, turns=6, tool_prompt=2048, task=40, tool_result=60, answer=32)
QUICK = AgentLoops(agents=4, turns=3, tool_prompt=512, task=24, tool_result=32, answer=16)


def build_tiny_model(kind: str, directory: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny random-weight `kind` ("qwen3_5", "lfm2" or "granite_hybrid") with the vocabulary, tokenizer and chat
    template of `tokenizer_dir` (the default model's), saved to `directory`."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=8192, initializer_range=0.5,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if kind == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        config = Qwen3_5TextConfig(**common, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
                                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                   linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
    elif kind == "lfm2":
        from transformers import Lfm2Config

        config = Lfm2Config(**common, num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"],
                            conv_L_cache=3, norm_eps=1e-6)
    elif kind == "granite_hybrid":  # Mamba2 layers beside one attention layer (no RoPE), 4 experts
        from transformers import GraniteMoeHybridConfig

        config = GraniteMoeHybridConfig(**{**common, "intermediate_size": 64}, num_hidden_layers=4,
                                        layer_types=["mamba", "mamba", "attention", "mamba"],
                                        shared_intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                                        mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
                                        mamba_expand=2, rms_norm_eps=1e-6)
    else:
        raise ValueError(f"no tiny {kind!r}: qwen3_5, lfm2 or granite_hybrid")
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


def tool_prompt(tokenizer, tokens: int, seed: int) -> str:
    """A system message listing tools, at least `tokens` tokens long."""
    rng = random.Random(seed)
    lines = ["You are an operations agent. You can call these tools; answer with one JSON call per turn."]
    while len(tokenizer.encode("\n".join(lines))) < tokens:
        args = ", ".join(f"{rng.choice(WORDS)}_{k}: {rng.choice(('string', 'integer', 'boolean'))}" for k in range(3))
        lines.append(f"- tool_{len(lines)}({args}): " + " ".join(rng.choice(WORDS) for _ in range(12)))
    return "\n".join(lines)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class StoredReplies:
    """The replies generated so far, by the exact prompt ids they followed (a ReplyLookup,
    engine/reply_ids.py): their ids go back in where a conversation re-sends them."""

    def __init__(self) -> None:
        self.after: dict[tuple[int, ...], tuple[str, Sequence[int]]] = {}

    def add(self, prompt_ids: Sequence[int], text: str, ids: Sequence[int]) -> None:
        self.after[tuple(prompt_ids)] = (text, list(ids))

    def may_begin(self, text: str) -> bool:
        return bool(self.after)

    def replies_after(self, prompt_ids: Sequence[int]) -> list[tuple[str, Sequence[int]]]:
        hit = self.after.get(tuple(prompt_ids))
        return [hit] if hit is not None else []


@dataclass
class TurnRecord:
    agent: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ideal_tokens: int  # whole blocks of the longest prefix any earlier request computed (never the last token)
    output: list[int]


def run_loops(engine, workload: AgentLoops, block_size: int, progress=print) -> list[TurnRecord]:
    """Run the agent loops on `engine`, turn by turn (all agents of a turn at once)."""
    from radixserve import SamplingParams

    from bench.lib.swarm import ideal_cached, remember

    rng = random.Random(workload.seed)
    system = tool_prompt(engine.tokenizer, workload.tool_prompt, workload.seed)
    conversations = [[{"role": "system", "content": system},
                      {"role": "user", "content": f"Task {a}: " + words(rng, workload.task)}]
                     for a in range(workload.agents)]
    replies, seen, records = StoredReplies(), set(), []
    params = SamplingParams(max_tokens=workload.answer, temperature=0.0, ignore_eos=True)
    for turn in range(workload.turns):
        prompts = [engine.apply_chat_template(c, replies=replies) for c in conversations]
        ideals = [ideal_cached(p, seen, block_size) for p in prompts]
        outs = engine.generate(prompts, params, use_tqdm=False)
        for agent, (prompt, ideal, out) in enumerate(zip(prompts, ideals, outs)):
            records.append(TurnRecord(agent, turn, len(prompt), out.cached_tokens, ideal, list(out.token_ids)))
            remember((prompt + list(out.token_ids))[:-1], seen, block_size)  # the last sampled token is never computed
            replies.add(prompt, out.text, out.token_ids)
            conversations[agent] += [{"role": "assistant", "content": out.text},
                                     {"role": "user", "content": "Tool result: " + words(rng, workload.tool_result)}]
        done = [r for r in records if r.turn == turn]
        progress(f"  turn {turn + 1}/{workload.turns}: {sum(r.prompt_tokens for r in done)} prompt tokens, "
                 f"{sum(r.cached_tokens for r in done)} cached, {sum(r.ideal_tokens for r in done)} ideal")
    return records
