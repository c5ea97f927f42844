"""GGUF targets are served from the file itself: each family's tiny random model written as
llama.cpp writes it (benchmarks.gguf_models) gives transformers' own GGUF loading's logits
(prefill and decode through the KV cache, fp32 within 1e-3) in F32, F16 and the block types; the
cached description makes a second start parse nothing; the loader holds one float tensor at a time."""

from __future__ import annotations

import json
import os

import pytest
import torch
from support.engine import save_tiny_target

from benchmarks.gguf_models import write_gguf, write_hf_model
from tide.engine.llama import LlamaModel
from tide.gguf_tensors import dequantize
from tide.target import GGUF_INDEX, reference_gguf_path, resolve_target

from .test_families import _ids, _ours

VOCAB = 96  # the reference tokenizer's first 96 tokens, which the files carry
# The families transformers reads from GGUF, with configs its GGUF metadata can describe: its
# Qwen 3 mapping reads no head size and takes Qwen3Config's 128 (ours reads llama.cpp's
# attention.key_length), so the tiny Qwen 3 has 128.
GGUF_FAMILIES = {
    "llama": {"head_dim": 16},
    "qwen2": {},
    "qwen3": {"head_dim": 128},
    "phi3": {},
    # transformers' Gemma GGUF mapping carries no soft-caps or attention scale (its defaults here),
    # and llama.cpp's Gemma has no output tensor (tied)
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "sliding_window": 4096, "tie_word_embeddings": True},
}


def _gguf_target(tmp_path, family: str, qtype: str, **overrides):
    from gguf import GGMLQuantizationType as Q
    from transformers import AutoModelForCausalLM

    hf = save_tiny_target(tmp_path / "hf", vocab=VOCAB, layers=2, arch=family,
                          **{**GGUF_FAMILIES.get(family, {}), **overrides})
    model = AutoModelForCausalLM.from_pretrained(hf.path, dtype=torch.float32)
    path = tmp_path / f"tiny-{family}.{qtype}.gguf"
    if qtype in K_QUANT_SCALES:  # gguf-py cannot quantize to K-quants: random blocks, sane scales
        return write_gguf(path, model.config.to_dict(), [(n, tuple(t.shape), lambda t=t: t.detach().numpy())
                                                         for n, t in model.state_dict().items()],
                          Q[qtype], reference_gguf_path(), raw=_k_quant_blocks(Q[qtype]))
    return write_hf_model(path, model, Q[qtype], reference_gguf_path())


# Byte offsets of a K-quant block's float16 scales (ggml-common.h: block_q6_K ends with d;
# block_q4_K starts with d and dmin), set to 0.002 in random blocks (logits of order 1).
K_QUANT_SCALES = {"Q6_K": (208,), "Q4_K": (0, 2)}


def _k_quant_blocks(qtype):
    from gguf import GGML_QUANT_SIZES

    gen = torch.Generator().manual_seed(0)

    def make(name, shape):
        block, size = GGML_QUANT_SIZES[qtype]
        raw = torch.randint(0, 256, (shape[0] * shape[1] // block, size), dtype=torch.uint8, generator=gen)
        for at in K_QUANT_SCALES[qtype.name]:
            raw[:, at:at + 2] = torch.full((raw.shape[0], 1), 0.002, dtype=torch.float16).view(torch.uint8)
        return raw.view(shape[0], -1).numpy()

    return make


def _transformers_logits(gguf, ids) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.inference_mode():
        return hf(ids).logits[0].float()


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Targets described under the test's directory (the kernels' build stays in the shared cache)."""
    import tide.target

    monkeypatch.setattr(tide.target, "cache_dir", lambda: tmp_path / "cache")


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_each_family_from_gguf_matches_transformers(tmp_path, family):
    gguf = _gguf_target(tmp_path, family, "F32")
    ids = _ids(VOCAB)
    ours = _ours(LlamaModel.load(resolve_target(gguf), dtype=torch.float32), ids)
    diff = (ours - _transformers_logits(gguf, ids)).abs().max()
    assert diff <= 1e-3, (family, float(diff))


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q6_K", "Q4_K"])
def test_block_types_match_transformers(tmp_path, qtype):
    # K-quant blocks hold 256 values: every input dimension a multiple of 256
    wide = {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64} if qtype.endswith("_K") else {}
    gguf = _gguf_target(tmp_path, "llama", qtype, **wide)
    ids = _ids(VOCAB)
    ours = _ours(LlamaModel.load(resolve_target(gguf), dtype=torch.float32), ids)
    diff = (ours - _transformers_logits(gguf, ids)).abs().max()
    assert diff <= 1e-3, (qtype, float(diff))


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_torch_dequantization_equals_gguf_py(qtype):
    """The torch fast paths give gguf-py's numpy values exactly."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    from benchmarks.gguf_models import encode

    w = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32)
    raw = encode(w, Q[qtype]) if qtype != "F16" else w.astype(np.float16)
    ours = dequantize(np.ascontiguousarray(raw).view(np.uint8).reshape(-1), Q[qtype], (48, 256))
    assert torch.equal(ours, torch.from_numpy(quants.dequantize(raw, Q[qtype]).reshape(48, 256)))


def test_second_start_reads_the_cached_description(tmp_path, monkeypatch):
    """The first start describes the file once (config, tokenizer, tensor index); a second finds
    it and parses nothing: no GGUFReader, no transformers config. The description names the file,
    and the cache directory is itself a target."""
    import gguf as gguf_py

    path = _gguf_target(tmp_path, "llama", "Q8_0")
    first = resolve_target(path)
    described = json.loads((first.path / GGUF_INDEX).read_text())
    assert described["file"] == str(path.resolve()) and "model.layers.1.mlp.down_proj.weight" in described["tensors"]
    assert not list(first.path.glob("*.safetensors"))  # no float copy of the weights

    def refuse(*args, **kwargs):
        raise AssertionError("the file was parsed again")

    monkeypatch.setattr(gguf_py, "GGUFReader", refuse)
    again = resolve_target(path)
    model = LlamaModel.load(again, dtype=torch.float32)
    assert again.gguf == first.gguf and model.cfg.num_layers == 2
    assert resolve_target(first.path).gguf == first.gguf


def test_the_loader_holds_one_float_tensor_at_a_time(tmp_path):
    """A bf16 model from an F16 file: the float32 values the loader reads are never more than a
    layer's worth alive at once (no float copy of the model); int8 from a Q8_0 file reads no
    projection's float values at all."""
    import gc
    import weakref

    from tide.gguf_tensors import GGUFTensors

    alive: list = []
    peak, read = 0, []
    original = GGUFTensors.__getitem__

    def tracked(self, name):
        nonlocal peak
        t = original(self, name)
        read.append(name)
        gc.collect()
        alive[:] = [r for r in alive if r() is not None]
        alive.append(weakref.ref(t))
        peak = max(peak, len(alive))
        return t

    GGUFTensors.__getitem__ = tracked
    try:
        LlamaModel.load(resolve_target(_gguf_target(tmp_path / "f16", "llama", "F16")), dtype=torch.bfloat16)
        assert peak <= 4, peak  # q, k, v of a layer and the tensor just read
        read.clear()
        model = LlamaModel.load(resolve_target(_gguf_target(tmp_path / "q8", "llama", "Q8_0")),
                                dtype=torch.bfloat16, weight_format="int8", prefill_weights="shared")
    finally:
        GGUFTensors.__getitem__ = original
    assert model.prefill_weights == "shared" and not model.prefill_linears
    assert read and not [n for n in read if n.endswith("_proj.weight") or n == "lm_head.weight"], read


def test_int8_from_q8_0_blocks_is_the_float_paths_int8(tmp_path):
    """int8 weights made straight from a Q8_0 file's blocks (no float values) are the ones made
    from its dequantized values, bit for bit: the same logits, prefill and decode."""
    from tide.engine.llama import LlamaModel

    target = resolve_target(_gguf_target(tmp_path, "llama", "Q8_0"))
    direct = LlamaModel.load(target, dtype=torch.bfloat16, weight_format="int8")
    via_float = LlamaModel(direct.cfg, dict(target.tensors()), torch.bfloat16, "cpu", "int8")
    ids = _ids(VOCAB)
    assert torch.equal(_ours(direct, ids), _ours(via_float, ids))


TOKENIZER_TEXTS = ["Hello world", "Zürich, 東京 🙂 مرحبا", "  two spaces\n\ttab", "<|im_start|>user\nhi<|im_end|>"]


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_each_familys_tokenizer_loads_as_autotokenizer_picks_it_without_torch(tmp_path, family):
    """The gateway loads the class the described tokenizer names (tide.target.load_tokenizer), which
    is AutoTokenizer's pick, so it encodes and decodes the same; and it does so without importing
    torch (the gateway process holds no tensors)."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from tide.target import load_tokenizer

    files = resolve_target(_gguf_target(tmp_path, family, "F16"))
    ours, auto = load_tokenizer(files), AutoTokenizer.from_pretrained(files.path)
    assert type(ours) is type(auto)
    for text in TOKENIZER_TEXTS:
        ids = auto(text)["input_ids"]
        assert ours(text)["input_ids"] == ids and ours.decode(ids) == auto.decode(ids), text
    probe = ("import sys; from tide.target import load_tokenizer, resolve_target; "
             "load_tokenizer(resolve_target(sys.argv[1])); print('torch' in sys.modules)")
    for target, cache in ((files.path, files.path.parent), (files.gguf, tmp_path / "fresh-cache")):
        # the described directory; and the GGUF file itself on a first start (described in a child process)
        out = subprocess.run([sys.executable, "-c", probe, str(target)], capture_output=True, text=True, check=True,
                             env={**os.environ, "TIDE_CACHE_DIR": str(cache)})
        assert out.stdout.strip() == "False", out.stderr[-2000:]
    assert list((tmp_path / "fresh-cache" / "targets").glob(f"*/{GGUF_INDEX}"))
