"""The default model served from its own Q4_1 file as it is (weight_dtype auto): no float32
copy of its weights, the repacked layout cached beside the conversion, next-token
distributions within the accuracy bar of the same weights in float32, and the engine's
features (prefix cache, native decoder) intact on it."""

from __future__ import annotations

import os

import pytest
import torch

from radixserve import Engine, SamplingParams

pytestmark = pytest.mark.real_model

CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
        "List three prime numbers and say why they are prime."]


@pytest.fixture(scope="module")
def quantized():
    return Engine(num_kv_blocks=256)


@pytest.fixture(scope="module")
def full(real_model_dir):
    return Engine(str(real_model_dir), num_kv_blocks=256)


def test_the_default_model_keeps_its_quantized_weights_and_no_float_copy(quantized, full):
    model = quantized.runner.model
    assert quantized.loaded.weight_dtype == "gguf:Q4_1+Q8_0"
    assert full.loaded.weight_dtype == "float32"
    assert model.embed_tokens.weight is None and model.embed_tokens.quant.kind == "Q8_0"
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight is None and m.quant.kind == "Q4_1" for m in linears)
    stats = quantized.stats()
    assert stats["weight_dtype"] == "gguf:Q4_1+Q8_0"
    assert stats["weight_bytes"] == quantized.loaded.weight_bytes
    assert quantized.loaded.weight_bytes < 0.25 * full.loaded.weight_bytes


def test_the_repacked_layout_is_cached_beside_the_conversion(quantized, real_model_dir):
    from radixserve.model.loader import REPACKED_FILE

    cached = real_model_dir / REPACKED_FILE
    assert cached.is_file()
    before = os.stat(cached).st_mtime_ns
    again = Engine(num_kv_blocks=16)
    assert os.stat(cached).st_mtime_ns == before, "a second load reads the cache, it does not repack"
    prompt = quantized.apply_chat_template([{"role": "user", "content": CHAT[0]}])
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    assert again.generate([prompt], greedy)[0].token_ids == quantized.generate([prompt], greedy)[0].token_ids


def _forced_logits(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """Next-token logits at every position, prompt logprobs style: one chunk of each request
    per step is the engine's own path; here 64 tokens a call over a fresh pool so that every
    matmul takes the integer kernel (as decode steps do)."""
    from radixserve.attention.cpu_backend import CpuAttentionBackend
    from radixserve.attention.kv_pool import KVPool
    from radixserve.attention.metadata import AttentionMetadata

    model, spec, block = engine.runner.model, engine.loaded.spec, 16
    n, blocks = len(tokens), -(-len(tokens) // block)
    pool = KVPool(spec.num_layers, blocks, block, spec.num_kv_heads, spec.head_dim, torch.float32, torch.device("cpu"))
    backend = CpuAttentionBackend(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim**-0.5,
                                  torch.float32, pool.pages)
    out = []
    for start in range(0, n, 64):
        end = min(n, start + 64)
        meta = AttentionMetadata(
            num_decodes=0, block_size=block, query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=torch.tensor([list(range(blocks))], dtype=torch.int32),
            slot_mapping=torch.arange(start, end, dtype=torch.int64),
            query_start_loc_list=[0, end - start], seq_lens_list=[end],
        )
        ids, positions = torch.tensor(tokens[start:end]), torch.arange(start, end)
        out.append(model(ids, positions, backend, pool, backend.prepare(meta), torch.arange(end - start)))
    return torch.cat(out)


def test_next_token_distributions_match_the_same_weights_in_float32(quantized, full):
    prompts = [full.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]
    greedy = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    sequences = [p + o.token_ids for p, o in zip(prompts, full.generate(prompts, greedy))]
    agree = positions = 0
    kl = 0.0
    for seq in sequences:
        q, f = _forced_logits(quantized, seq), _forced_logits(full, seq)
        p, r = torch.log_softmax(f.double(), -1), torch.log_softmax(q.double(), -1)
        agree += int((f.argmax(-1) == q.argmax(-1)).sum())
        kl += float((p.exp() * (p - r)).sum())
        positions += len(seq)
    assert positions > 400
    assert agree / positions >= 0.99, f"top-1 agreement {agree / positions:.4f}"
    assert kl / positions <= 0.001, f"mean KL {kl / positions:.6f} nats"


def test_prefix_hits_and_integrity_on_quantized_weights(quantized):
    system = "You are a careful assistant. Answer in one short sentence. " * 4
    prompts = [quantized.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": c}]) for c in CHAT]
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    first = quantized.generate(prompts[:1], greedy)[0]
    rest = quantized.generate(prompts, greedy)
    shared = len(os.path.commonprefix([prompts[0], prompts[1]]))
    assert rest[0].cached_tokens == (len(prompts[0]) - 1) // 16 * 16  # all whole blocks but the last token's
    assert all(o.cached_tokens == shared // 16 * 16 for o in rest[1:])
    assert rest[0].token_ids == first.token_ids
    quantized.check_integrity()
