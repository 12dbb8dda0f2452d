"""The model family in one home: a load looks its family up once, reads a GGUF header once,
and holds a GGUF's values as stored (Gemma 3's norms: no 1 subtracted and added back)."""

from __future__ import annotations

import sys

import pytest
import torch

from tiny_gguf import write_gguf
from tiny_models import build_tiny_model


@pytest.fixture
def counted(monkeypatch):
    """Calls of the family lookups and of the GGUF header scan, wherever a module imported them."""
    from radixserve.model import gguf_file, registry

    calls = {"family": 0, "header": 0}
    originals = {registry.family_for_config: "family", registry.family_for_gguf: "family",
                 gguf_file.scan_header: "header"}

    def counting(fn, key):
        def wrapped(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return wrapped

    for module in [m for name, m in sys.modules.items() if name.startswith("radixserve.model")]:
        for attr, value in list(vars(module).items()):
            if callable(value) and value in originals:
                monkeypatch.setattr(module, attr, counting(value, originals[value]))
    return calls


def test_a_gemma3_gguf_load_looks_its_family_up_once_and_reads_its_header_once(tmp_path, counted):
    from gguf import GGUFReader

    from radixserve.model.loader import load_model

    hf = build_tiny_model("gemma3", tmp_path / "hf")
    path = write_gguf(hf, tmp_path / "tiny-gemma3.gguf", quant="Q8_0")
    loaded = load_model(str(path), device="cpu", cache_dir=str(tmp_path / "cache"))
    assert counted == {"family": 1, "header": 1}  # first load: the header is read, and names the family
    assert loaded.spec.family == "gemma3" and loaded.weight_dtype == "gguf:Q8_0"
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in GGUFReader(path).tensors if t.name.endswith("norm.weight")}
    held = loaded.model.layers[1]
    assert torch.equal(held.input_layernorm.weight.detach(), stored["blk.1.attn_norm.weight"])
    assert torch.equal(held.pre_feedforward_layernorm.weight.detach(), stored["blk.1.ffn_norm.weight"])
    assert torch.equal(held.self_attn.q_norm.weight.detach(), stored["blk.1.attn_q_norm.weight"])

    counted.update(family=0, header=0)
    again = load_model(str(path), device="cpu", cache_dir=str(tmp_path / "cache"))
    assert counted == {"family": 1, "header": 0}  # converted and repacked already: config.json names it
    assert torch.equal(again.model.norm.weight, loaded.model.norm.weight)


def test_a_directory_load_looks_its_family_up_once(tiny_model_dir, counted):
    from radixserve.model.loader import load_model

    loaded = load_model(str(tiny_model_dir("gemma3")), device="cpu")
    assert counted == {"family": 1, "header": 0} and loaded.spec.family == "gemma3"


def test_a_float_gguf_and_its_checkpoint_hold_the_same_norms(tmp_path):
    """The checkpoint's w gets its 1 added once at load; the GGUF stores fl(1 + w): the same bits."""
    from radixserve.model.loader import load_model

    hf = build_tiny_model("gemma3", tmp_path / "hf")
    from_hf = load_model(str(hf), device="cpu")
    from_gguf = load_model(str(write_gguf(hf, tmp_path / "f32.gguf", quant="F32")), device="cpu",
                           cache_dir=str(tmp_path / "cache"), weight_dtype="auto")
    norms = [name for name, _ in from_hf.model.named_parameters() if name.endswith("norm.weight")]
    assert len(norms) == 3 * 6 + 1
    hf_params, gguf_params = dict(from_hf.model.named_parameters()), dict(from_gguf.model.named_parameters())
    for name in norms:
        assert torch.equal(hf_params[name], gguf_params[name]), name


def test_the_family_class_says_what_is_its_own():
    """A family's GGUF tensor names, spec fields and checkpoint conversion live in its module."""
    from radixserve.model.gemma3 import Gemma3ForCausalLM
    from radixserve.model.gguf_file import hf_name
    from radixserve.model.llama import LlamaForCausalLM

    gemma_names = Gemma3ForCausalLM.gguf_layer_names
    assert hf_name("blk.2.ffn_norm.weight", "gemma3", gemma_names) == "model.layers.2.pre_feedforward_layernorm.weight"
    assert hf_name("blk.2.ffn_norm.weight", "llama") == "model.layers.2.post_attention_layernorm.weight"
    assert LlamaForCausalLM.gguf_interleaved_qk == ("llama", "mistral") and Gemma3ForCausalLM.gguf_interleaved_qk == ()
    with pytest.raises(ValueError, match="has no place in a gemma3 model"):
        hf_name("blk.0.ffn_gate_exps.weight", "gemma3", gemma_names)
