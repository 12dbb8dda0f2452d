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
    with pytest.raises(ValueError, match="unsupported model type 'gpt2'.*llama.*gemma3 \\(model types gemma3_text, gemma3\\)"):
        load_model(str(tmp_path))


def test_a_model_type_transformers_does_not_know_is_refused_naming_what_runs(tmp_path):
    import time

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "frobnicator", "architectures": ["FrobLM"]}))
    start = time.monotonic()
    with pytest.raises(ValueError, match="unsupported model type 'frobnicator'.*radixserve runs llama"):
        load_model(str(tmp_path))
    assert time.monotonic() - start < 1.0
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="is not a JSON object"):
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

    def convert(gguf, target, **options):  # stands in for transformers' 30 s dequantization
        converted.append(target)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(b"")
        return target

    monkeypatch.setattr(default_model, "convert_gguf", convert)
    gguf = tmp_path / "tiny.Q8_0.gguf"
    _write_gguf(gguf, 1.0)
    first = default_model.ensure_converted_gguf(gguf, str(tmp_path / "cache"))
    assert default_model.ensure_converted_gguf(gguf, str(tmp_path / "cache")) == first
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("tiny.Q8_0-")
    _write_gguf(gguf, 2.0, rows=2)  # a new file at the same path
    second = default_model.ensure_converted_gguf(gguf, str(tmp_path / "cache"))
    assert converted == [first, second] and second != first


def _write_gguf(path, value: float, rows: int = 1) -> None:
    """A valid GGUF file holding one small float tensor (its header is checked before conversion)."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch="llama")
    writer.add_tensor("output_norm.weight", np.full((rows, 8), value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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


def test_weight_dtypes_on_a_float_checkpoint(tiny_model_dir):
    from radixserve.kernels.quant_linear import QuantWeight, lanes_preferred

    path = str(tiny_model_dir("qwen2"))  # tied embeddings, q/k/v biases
    full = load_model(path, device="cpu")
    assert full.weight_dtype == "float32" and full.model.embed_tokens.quant is None
    for weight_dtype, bits in (("int8", 8), ("int4", 4)):
        loaded = load_model(path, device="cpu", weight_dtype=weight_dtype)
        model = loaded.model
        assert loaded.weight_dtype == weight_dtype
        assert isinstance(model.embed_tokens.quant, QuantWeight) and model.embed_tokens.weight is None
        qkv = model.layers[0].self_attn.qkv_proj
        assert qkv.weight is None and qkv.quant.bits == bits and qkv.bias is not None
        assert qkv.quant.lanes == model.embed_tokens.quant.lanes == lanes_preferred()  # the kernel's layout
        assert loaded.weight_bytes < full.weight_bytes * (0.5 if bits == 8 else 0.35)
        want = full.model.layers[0].self_attn.qkv_proj.weight
        step = qkv.quant.to_rows().scale.repeat_interleave(qkv.quant.group, dim=1)
        assert ((qkv.quant.dequantize() - want).abs() <= step / 2 + 1e-6).all()
    bf16 = load_model(path, device="cpu", weight_dtype="bfloat16")
    assert bf16.weight_dtype == "bfloat16" and bf16.model.norm.weight.dtype == torch.bfloat16


def test_weight_dtypes_that_cannot_run_are_refused_before_loading(tiny_model_dir, tmp_path):
    from radixserve import Engine

    path = str(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="float32 activations"):
        load_model(path, device="cpu", dtype="bfloat16", weight_dtype="int8")
    with pytest.raises(ValueError, match="weights are the model's dtype"):
        load_model(path, device="cpu", dtype="float32", weight_dtype="bfloat16")
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        Engine(path, weight_dtype="int3")
