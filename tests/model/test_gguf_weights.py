"""GGUF files read as they are: every repacked block type equals the `gguf` package's own
dequantization, the default model's file equals transformers' conversion of it, and a broken
file is refused naming its tensor, with nothing cached."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.model.gguf_repack import HALF_SCALED, REPACKED, repack

N, K = 6, 512


def _random_blocks(kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of `kind` for an [N, K] tensor, its float16 scales made finite (MXFP4's values too)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    count = N * K // block
    raw = rng.integers(0, 256, size=(count, size), dtype=np.uint8)

    def put(at: int, low: float, high: float) -> None:
        raw[:, at:at + 2] = rng.uniform(low, high, count).astype(np.float16).view(np.uint8).reshape(count, 2)

    if kind == "MXFP4":  # E8M0 exponents, 0 and 1 (subnormal scales) among them; past 248 a code x scale overflows
        raw[:, 0] = rng.integers(0, 249, count, dtype=np.uint8)
        raw[:2, 0] = [0, 1]
    elif kind == "Q6_K":
        put(208, 0.001, 0.02)
    elif kind.endswith("_K"):
        put(0, 0.001, 0.02), put(2, 0.001, 0.02)
    else:
        put(0, -0.05, 0.05)
        if kind in ("Q4_1", "Q5_1"):
            put(2, -0.1, 0.1)
    return raw.reshape(N, -1)


@pytest.mark.parametrize("kind", REPACKED)
def test_every_repacked_type_is_exactly_the_gguf_dequantization(kind):
    from gguf import GGMLQuantizationType, quants

    raw = _random_blocks(kind, np.random.default_rng(len(kind) * 7 + ord(kind[1])))
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(N, K))
    weight = repack(kind, raw, N, K)
    assert weight.kind == kind and weight.shape == (N, K)
    assert weight.half_scales == (kind in HALF_SCALED)  # the legacy types' float16 d and m as stored
    assert torch.equal(weight.dequantize(), want)
    assert torch.equal(weight._dequantize_torch(None), want)


def test_types_that_cannot_be_repacked_are_refused():
    with pytest.raises(ValueError, match="cannot be served quantized"):
        repack("Q2_K", np.zeros((1, 84), dtype=np.uint8), 1, 256)
    with pytest.raises(ValueError, match="multiple of 64"):
        repack("Q8_0", np.zeros((1, 34), dtype=np.uint8), 1, 32)


@pytest.mark.real_model
def test_the_default_file_read_as_it_is_equals_transformers_conversion(real_model_dir):
    from safetensors.torch import load_file

    from radixserve.model.default_model import default_gguf_path
    from radixserve.model.gguf_file import read_weights

    converted = load_file(str(real_model_dir / "model.safetensors"))
    quantized = read_weights(default_gguf_path(), quantized=True)
    assert set(quantized) == set(converted)
    kinds = {w.kind for w in quantized.values() if not isinstance(w, torch.Tensor)}
    assert kinds == {"Q4_1", "Q8_0"}
    for name, want in converted.items():
        got = quantized[name]
        got = got if isinstance(got, torch.Tensor) else got.dequantize()
        assert torch.equal(got, want), name  # q/k rows un-permuted as transformers does


def test_the_repacked_cache_keeps_float16_scales_and_an_older_layout_is_rebuilt(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from radixserve.model.loader import REPACKED_FILE, repacked_weights

    path, directory = _valid(tmp_path / "m.gguf"), tmp_path / "converted"
    directory.mkdir()
    first = repacked_weights(path, directory)["model.embed_tokens.weight"]
    cached = directory / REPACKED_FILE
    again = repacked_weights(path, directory)["model.embed_tokens.weight"]
    assert first.scale.dtype == again.scale.dtype == torch.float16
    assert torch.equal(again.dequantize(), first.dequantize())
    with safe_open(str(cached), "pt") as f:
        meta = f.metadata()
    old = {k: v.float() if k.endswith("::scale") else v for k, v in load_file(str(cached)).items()}
    save_file(old, str(cached), metadata={**meta, "format": "radixserve-repacked-1"})  # float32 scales, as before
    rebuilt = repacked_weights(path, directory)["model.embed_tokens.weight"]
    assert rebuilt.scale.dtype == torch.float16 and torch.equal(rebuilt.dequantize(), first.dequantize())
    with safe_open(str(cached), "pt") as f:
        assert f.metadata()["format"] == meta["format"] != "radixserve-repacked-1"


# ---- broken files ---------------------------------------------------------------------------------


def _tiny_gguf(path, tensors: dict[str, tuple[np.ndarray, object]]) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch="llama")
    writer.add_block_count(1)
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _valid(path):
    from gguf import GGMLQuantizationType, quants

    q8 = quants.quantize(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32),
                         GGMLQuantizationType.Q8_0)
    _tiny_gguf(path, {"token_embd.weight": (q8, GGMLQuantizationType.Q8_0),
                      "output_norm.weight": (np.ones(64, dtype=np.float32), GGMLQuantizationType.F32)})
    return path


def _tensor_info_offset(data: bytes, name: str) -> int:
    """Where the tensor's info (after its name) starts in the header: n_dims u32, dims u64..."""
    return data.index(name.encode()) + len(name)


def _load_refused(path, cache, match):
    from radixserve.model.loader import load_model

    with pytest.raises(ValueError, match=match):
        load_model(str(path), cache_dir=str(cache))
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())


def test_a_truncated_file_is_refused_naming_its_tensor(tmp_path):
    path = _valid(tmp_path / "m.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    _load_refused(path, tmp_path / "cache", "truncated: tensor 'output_norm.weight'")
    path.write_bytes(data[:40])
    _load_refused(path, tmp_path / "cache", "header runs past the end of the file")


def test_a_shape_disagreeing_with_the_bytes_is_refused(tmp_path):
    path = _valid(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    at = _tensor_info_offset(data, "token_embd.weight") + 4  # ne0 of a [64, 8] Q8_0 tensor
    data[at:at + 8] = (48).to_bytes(8, "little")  # not whole 32-value blocks
    path.write_bytes(bytes(data))
    _load_refused(path, tmp_path / "cache", "token_embd.weight")


def test_an_absurd_dimension_and_an_unknown_type_are_refused(tmp_path):
    path = _valid(tmp_path / "m.gguf")
    clean = path.read_bytes()
    data = bytearray(clean)
    at = _tensor_info_offset(data, "token_embd.weight") + 4 + 8  # ne1
    data[at:at + 8] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    _load_refused(path, tmp_path / "cache", "token_embd.weight")
    data = bytearray(clean)
    at = _tensor_info_offset(data, "output_norm.weight") + 4 + 8  # its type follows one dimension
    data[at:at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    _load_refused(path, tmp_path / "cache", "output_norm.weight")


def test_an_architecture_radixserve_does_not_serve_is_refused_from_the_header(tmp_path):
    import time

    from gguf import GGUFWriter

    path = tmp_path / "phi3.gguf"
    writer = GGUFWriter(str(path), arch="phi3")
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    start = time.monotonic()
    _load_refused(path, tmp_path / "cache", "a 'phi3' GGUF model is not supported; radixserve runs the GGUF "
                  "architectures llama, mistral, qwen2, qwen3, gemma3")
    assert time.monotonic() - start < 1.0
