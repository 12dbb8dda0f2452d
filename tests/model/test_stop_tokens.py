"""A GGUF header names one EOS, but a family's replies end at more tokens (its Hugging Face
generation_config lists them): the family's stop tokens (ModelFamily.stop_tokens, by text) are
added to a GGUF's stops where its vocabulary has them. A tiny gpt-oss GGUF whose header names
<|return|> stops at <|call|> (greedy, and after a forced call served through the official openai
client: the reply ends with the <|call|> token, finish_reason tool_calls); the real GGUFs stop
where their Hugging Face directories do (Gemma 3 at <end_of_turn>, SmolLM2 at <|im_end|> alone)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.model.loader import family_stop_ids
from radixserve.model.registry import FAMILIES
from test_gpt_oss import tiny_gpt_oss_config
from tiny_gguf import write_gguf
from tool_fixtures import SCHEMAS, TOOLS

# as gpt-oss's vocabulary names them; the header's EOS is <|return|>, as llama.cpp's converter writes it
HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
           "<|endoftext|>")
VOCAB = 256 + 1 + len(HARMONY)  # the byte alphabet, one merged pair, the specials (tests/tiny_gguf.py)
CALL, RETURN, ENDOFTEXT = (257 + HARMONY.index(t) for t in ("<|call|>", "<|return|>", "<|endoftext|>"))

# family -> its stop tokens, as its Hugging Face generation_config (and chat template) end a reply
EXPECTED = {
    "llama": ["<|im_end|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"],
    "gemma3": ["<eos>", "<end_of_turn>"],
    "qwen3_moe": ["<|im_end|>", "<|endoftext|>"],
    "lfm2": ["<|im_end|>"],
    "qwen3_5": ["<|im_end|>", "<|endoftext|>"],
    "qwen3_5_moe": ["<|im_end|>", "<|endoftext|>"],
    "granitemoehybrid": ["<|end_of_text|>"],
    "gpt_oss": ["<|return|>", "<|call|>", "<|endoftext|>"],
}


def _tokenizer(tmp_path: Path, specials: list[str]):
    from tokenizers import AddedToken, Tokenizer, models

    from radixserve.model.tokenizer import load_tokenizer

    vocab = {t: i for i, t in enumerate(["<unk>", "a", "b", *specials])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>"}))
    return load_tokenizer(tmp_path)


def test_each_family_s_stop_tokens_resolve_to_the_ids_its_vocabulary_has(tmp_path):
    every = sorted({t for f in FAMILIES for t in f.stop_tokens} | {"<|im_start|>", "<start_of_turn>", "<|end|>"})
    tokenizer = _tokenizer(tmp_path, every)
    assert {f.name: list(f.stop_tokens) for f in FAMILIES} == EXPECTED
    for family in FAMILIES:
        assert family_stop_ids(family, tokenizer) == [3 + every.index(t) for t in EXPECTED[family.name]], family.name
    (tmp_path / "some").mkdir()
    some = _tokenizer(tmp_path / "some", ["<|return|>", "<|im_end|>", "<|call|>"])  # present ones only
    gpt_oss, qwen3_moe = (next(f for f in FAMILIES if f.name == n) for n in ("gpt_oss", "qwen3_moe"))
    assert family_stop_ids(gpt_oss, some) == [3, 5]
    assert family_stop_ids(qwen3_moe, some) == [4]
    assert family_stop_ids(gpt_oss, None) == []


def test_the_real_ggufs_stop_where_their_hf_directories_do():
    """gemma-3-270m's GGUF names <eos> (1); its generation_config stops at [1, 106] (<end_of_turn>).
    SmolLM2's names <|im_end|> (2), all its generation_config lists (not <|endoftext|>, 0)."""
    from radixserve.model.loader import _eos_token_ids, open_model
    from radixserve.model.spec import ModelSpec
    from radixserve.model.hf_config import load_hf_config
    from radixserve.model.tokenizer import load_tokenizer

    for model, want in (("gemma3-270m", [1, 106]), (None, [2])):
        source = open_model(model, float_weights=False)
        family = source.family(json.loads((source.directory / "config.json").read_text()))
        tokenizer = load_tokenizer(source.directory, family)
        spec = ModelSpec.from_hf_config(load_hf_config(source.directory), family)
        assert sorted(_eos_token_ids(source.directory, spec, tokenizer, family_stop_ids(family, tokenizer))) == want


@pytest.fixture(scope="module")
def call_gguf(tmp_path_factory) -> Path:
    """A tiny gpt-oss GGUF with harmony's specials whose greedy choice is always <|call|> where it
    may be chosen: every embedding's first feature is large, so the last norm's output is ~
    sqrt(hidden) there, and only <|call|>'s output row reads that feature."""
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("gpt-oss-stops")
    torch.manual_seed(3)
    config = tiny_gpt_oss_config(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=4096,
                                 sliding_window=32)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1000.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[CALL, 0] = 50.0
    model.save_pretrained(directory / "hf")
    return write_gguf(directory / "hf", directory / "tiny-gpt-oss-stops.gguf", quant="F32", specials=HARMONY,
                      eos="<|return|>")


def test_a_gpt_oss_gguf_stops_at_call_and_serves_the_call(call_gguf, tmp_path):
    from radixserve.server import ServerOptions, create_app
    from radixserve.server.testing import BackgroundServer

    engine = Engine(str(call_gguf), max_model_len=4096, num_kv_blocks=400, model_cache_dir=str(tmp_path / "cache"))
    assert sorted(engine.eos_token_ids) == sorted([RETURN, CALL, ENDOFTEXT])  # the header names RETURN alone
    (out,) = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0))
    assert out.token_ids == [CALL] and out.finish_reason == "stop"
    with BackgroundServer(create_app(engine, ServerOptions(served_model_name="tiny", reasoning_parser="none"))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, temperature=0,
            max_tokens=200, tool_choice="required", parallel_tool_calls=False, extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    ids = choice.model_extra["token_ids"]
    assert ids[-1] == CALL and RETURN not in ids  # the call's end stops the reply, as gpt-oss's own files say
    assert reply.usage.completion_tokens == len(ids) < 200
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
