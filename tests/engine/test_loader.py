"""Model loading: directories, dtypes and clear errors."""

import json
import os

import pytest
import torch

from radixserve.model.loader import load_model


def test_missing_and_malformed_models_give_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_model(str(tmp_path / "missing"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_model(str(tmp_path / "weights.bin"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        load_model(str(empty))


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported model type 'gpt2'"):
        load_model(str(tmp_path))


def test_directory_without_weights(tmp_path, tiny_model_dir):
    config = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("dtype, expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                             ("float16", torch.float16), ("auto", torch.float32)])
def test_dtypes(tiny_model_dir, dtype, expected):
    loaded = load_model(str(tiny_model_dir("qwen2")), dtype=dtype, device="cpu")
    assert loaded.model.embed_tokens.weight.dtype == expected
    assert loaded.model.rotary.cos.dtype == torch.float32  # RoPE tables stay in float32
    assert loaded.tokenizer is None and loaded.max_model_len == 256


def test_max_model_len_beyond_the_model_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="exceeds the model's context"):
        load_model(str(tiny_model_dir("llama")), max_model_len=1000)


def test_a_gguf_file_is_converted_once_per_path_size_and_mtime(tmp_path, monkeypatch):
    from radixserve.model import default_model

    converted = []

    def convert(gguf, target):  # stands in for transformers' 30 s dequantization
        converted.append(target)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(b"")
        return target

    monkeypatch.setattr(default_model, "convert_gguf", convert)
    gguf = tmp_path / "tiny.Q8_0.gguf"
    gguf.write_bytes(b"GGUF one")
    first = default_model.ensure_converted_gguf(gguf, str(tmp_path / "cache"))
    assert default_model.ensure_converted_gguf(gguf, str(tmp_path / "cache")) == first
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("tiny.Q8_0-")
    gguf.write_bytes(b"GGUF two, a new file at the same path")
    second = default_model.ensure_converted_gguf(gguf, str(tmp_path / "cache"))
    assert converted == [first, second] and second != first


def test_the_default_model_is_converted_again_only_when_its_file_changes(tmp_path, monkeypatch):
    from radixserve.model import default_model

    converted = []

    def convert(gguf, target, source_key=None):  # stands in for the dequantization, not for the install
        converted.append(gguf.read_bytes())
        work = tmp_path / f"work{len(converted)}"
        work.mkdir()
        (work / "config.json").write_text(json.dumps({"from": gguf.read_text()}))
        (work / "model.safetensors").write_bytes(b"")
        (work / default_model.SOURCE_FILE).write_text(json.dumps({"content_key": source_key}))
        default_model._install(work, target, source_key)
        return target

    packaged = tmp_path / "site-packages" / default_model.DEFAULT_MODEL_FILE
    packaged.parent.mkdir()
    packaged.write_bytes(b"GGUF version one")
    monkeypatch.setattr(default_model, "convert_gguf", convert)
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: packaged)
    cache = str(tmp_path / "cache")
    first = default_model.ensure_default_model(cache)
    assert first == tmp_path / "cache" / "models" / default_model.DEFAULT_MODEL_NAME
    os.utime(packaged, ns=(1, 1))  # a reinstall of the same file: a new mtime, the same bytes
    assert default_model.ensure_default_model(cache) == first and len(converted) == 1
    packaged.write_bytes(b"GGUF version two, an upgraded package")
    assert default_model.ensure_default_model(cache) == first  # the same name, converted again in place
    assert converted == [b"GGUF version one", b"GGUF version two, an upgraded package"]
    assert json.loads((first / "config.json").read_text()) == {"from": "GGUF version two, an upgraded package"}
    assert sorted(p.name for p in first.parent.iterdir()) == [default_model.DEFAULT_MODEL_NAME]  # no stale copy
    assert default_model.ensure_default_model(cache) == first and len(converted) == 2


@pytest.mark.real_model
def test_the_packaged_gguf_loads_as_the_default_model(real_model_dir, real_engine, monkeypatch):
    from radixserve import Engine, SamplingParams
    from radixserve.model import default_model

    monkeypatch.setattr(default_model, "convert_gguf", lambda *a: pytest.fail("converted the default model again"))
    assert default_model.ensure_converted_gguf(default_model.default_gguf_path()) == real_model_dir
    engine = Engine(str(default_model.default_gguf_path()))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = "Paris is the capital of"
    assert engine.generate(prompt, params)[0].token_ids == real_engine.generate(prompt, params)[0].token_ids
