"""GGUF files as llama.cpp's converter writes them, for tests and the model-size benchmarks.

`write_gguf` writes a HF model's tensors (or random ones, generated a tensor at a time: an 8B
file is never in memory) in one GGUF type, with the metadata transformers reads back
(transformers.integrations.ggml's GGUF_CONFIG_MAPPING, inverted) and the reference model's
tokenizer (its vocabulary, merges, special tokens and chat template). llama.cpp's own layout
changes are made as its convert_hf_to_gguf.py makes them: Llama and Mistral q/k rows permuted
for its RoPE layout, Gemma's norm weights stored as 1 + w.

`python -m benchmarks.gguf_models --size 8b --type Q8_0 --out DIR` writes a random-weight
Llama-shaped model (`LLAMA_SHAPES`); the values do not change the speed of plain decoding.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

# Llama-shaped models of about these sizes, with the reference model's 49152-token vocabulary
# (its tokenizer), untied heads: (hidden, intermediate, layers, heads, kv heads). 1.5b and 3b
# are Qwen2.5-1.5B's and Llama 3.2 3B's bodies, 8b is Llama 3.1 8B's (7.4B parameters with
# this vocabulary, 8.0B with its own 128k).
LLAMA_SHAPES = {
    "0.5b": (1024, 4096, 24, 16, 8),
    "1.5b": (1536, 8960, 28, 12, 2),
    "3b": (3072, 8192, 28, 24, 8),
    "8b": (4096, 14336, 32, 32, 8),
}
VOCAB = 49152  # the reference tokenizer's


def llama_config(size: str) -> dict:
    hidden, inter, layers, heads, kv = LLAMA_SHAPES[size]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hidden // heads,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def _gguf_arch(config: dict) -> str:
    model_type = config["model_type"]
    return {"gemma3_text": "gemma3"}.get(model_type, model_type)


def _metadata(writer, config: dict, arch: str, file_type: int) -> None:
    from gguf import GGUFValueType as V
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    writer.add_name(f"tide-{arch}")
    writer.add_file_type(file_type)
    keys = {key: hf_key for key, hf_key in GGUF_CONFIG_MAPPING[{"mistral": "llama"}.get(arch, arch)].items() if hf_key}
    keys.setdefault("attention.key_length", "head_dim")  # llama.cpp records the head size for every family
    for key, hf_key in keys.items():
        if config.get(hf_key) is None:
            continue
        value = config[hf_key]
        writer.add_key_value(f"{arch}.{key}", value, V.FLOAT32 if isinstance(value, float) else V.UINT32)


def _tokenizer(writer, source: Path, vocab: int) -> None:
    """Copy the tokenizer.* fields of the GGUF file `source`, its first `vocab` tokens (and the
    merges among those) where the model's vocabulary is smaller: a test's tiny model."""
    from gguf import GGUFReader, GGUFValueType

    fields = {k: f for k, f in GGUFReader(source).fields.items() if k.startswith("tokenizer.")}
    tokens = fields["tokenizer.ggml.tokens"].contents()
    kept = set(tokens[:vocab])
    for key, field in fields.items():
        value = field.contents()
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = value[:vocab]
        elif key == "tokenizer.ggml.merges" and vocab < len(tokens):
            value = [m for m in value if all(p in kept for p in m.split(" ")) and m.replace(" ", "") in kept]
            if not value:  # GGUF has no empty arrays: scores instead, from which none are derived
                writer.add_key_value("tokenizer.ggml.scores", [0.0] * vocab, GGUFValueType.ARRAY,
                                     GGUFValueType.FLOAT32)
                continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for its RoPE (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, qtype) -> np.ndarray:
    """A float32 array in GGUF type `qtype` (raw uint8 for block types)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16)
    return quants.quantize(w.astype(np.float32), qtype)


TensorSpec = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]  # HF name, shape, float32 producer


def write_gguf(path: Path, config: dict, tensors: Iterable[TensorSpec], qtype, tokenizer: Path,
               raw: Callable[[str, tuple[int, ...]], np.ndarray] | None = None) -> Path:
    """Write `tensors` (HF names) to `path`: 2-D weights in `qtype`, 1-D (norms, biases) in F32,
    as llama.cpp's files keep them. `raw(name, shape)`, where given, produces a 2-D weight's bytes
    in `qtype` directly (random files: no float32 values, no quantization)."""
    from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map

    qtype = GGMLQuantizationType(qtype)
    arch = _gguf_arch(config)
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    names = get_tensor_name_map(arch_id, config["num_hidden_layers"])
    writer = GGUFWriter(path, arch)
    _metadata(writer, config, arch, int(qtype))
    _tokenizer(writer, tokenizer, config["vocab_size"])
    specs = list(tensors)
    plan = []
    for name, shape, make in specs:
        base, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise KeyError(f"no GGUF name for {name} in {arch}")
        kind = qtype if len(shape) == 2 else GGMLQuantizationType.F32
        plan.append((name, f"{gguf_name}.{suffix}", shape, make, kind))
    for _, gguf_name, shape, _, kind in plan:  # tensor infos first: the header lists them all
        data_shape, dtype = _stored(shape, kind)
        writer.add_tensor_info(gguf_name, data_shape, dtype, int(np.prod(data_shape)) * dtype.itemsize,
                               raw_dtype=kind if dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, _, shape, make, kind in plan:  # then each tensor, made as it is written
        data = _produce(name, shape, make, kind, config, arch, raw)
        if (data.shape, data.dtype) != _stored(shape, kind):
            raise ValueError(f"{name}: made {data.dtype} {data.shape}, the header says {_stored(shape, kind)}")
        writer.write_tensor_data(data)
    writer.close()
    return path


def _stored(shape: tuple[int, ...], kind) -> tuple[tuple[int, ...], np.dtype]:
    """How a tensor of HF `shape` lies in the file as a numpy array: float32 / float16 values, or
    uint8 bytes (rows, bytes per row) for BF16 and the block types."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    if kind in (Q.F32, Q.F16):
        return tuple(shape), np.dtype(np.float32 if kind == Q.F32 else np.float16)
    block, size = GGML_QUANT_SIZES[kind]
    return (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8)


def _produce(name, shape, make, kind, config, arch, raw) -> np.ndarray:
    from gguf import GGMLQuantizationType

    if raw is not None and len(shape) == 2:
        return raw(name, shape)
    w = make().astype(np.float32)
    if arch in ("llama", "mistral") and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
        heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
        w = _permute(w, heads)
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        w = w + 1
    return encode(w, kind if len(shape) == 2 else GGMLQuantizationType.F32)


def write_hf_model(path: Path, model: torch.nn.Module, qtype, tokenizer: Path) -> Path:
    """A transformers model's weights as a GGUF file (its config's metadata)."""
    config = model.config.to_dict()
    state = model.state_dict()
    specs = [(n, tuple(t.shape), (lambda t=t: t.detach().float().numpy())) for n, t in state.items()
             if not (n == "lm_head.weight" and config.get("tie_word_embeddings"))]
    return write_gguf(path, config, specs, qtype, tokenizer)


def random_raw(qtype, seed: int = 0) -> Callable[[str, tuple[int, ...]], np.ndarray]:
    """Random bytes of a 2-D weight in `qtype`: block scales about 0.02 / 127 (Q8_0) or 0.02 / 8
    (Q4_0), values uniform; F16 / BF16 values normal with std 0.02."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    gen = torch.Generator().manual_seed(seed)

    def make(name: str, shape: tuple[int, ...]) -> np.ndarray:
        rows, cols = shape
        if qtype == Q.F16:
            return (torch.randn(rows, cols, generator=gen) * 0.02).to(torch.float16).numpy()
        if qtype == Q.BF16:
            return (torch.randn(rows, cols, generator=gen) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy()
        block, size = GGML_QUANT_SIZES[qtype]
        blocks = rows * cols // block
        out = torch.randint(0, 256, (blocks, size), dtype=torch.uint8, generator=gen)
        scale = torch.full((blocks, 1), 0.02 / (127 if qtype == Q.Q8_0 else 8), dtype=torch.float16)
        out[:, :2] = scale.view(torch.uint8)
        if qtype == Q.Q4_1:
            out[:, 2:4] = torch.full((blocks, 1), -0.02, dtype=torch.float16).view(torch.uint8)
        elif qtype != Q.Q8_0 and qtype != Q.Q4_0:
            raise ValueError(f"random files in F16, BF16, Q8_0, Q4_0 or Q4_1, not {qtype.name}")
        return out.view(rows, -1).numpy()

    return make


def llama_specs(config: dict) -> list[TensorSpec]:
    """The tensors of a Llama checkpoint of `config`, norms of ones (the only values read)."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]

    def ones(n: int):
        return lambda: np.ones(n, dtype=np.float32)

    none = None  # 2-D tensors come from `raw`
    specs: list[TensorSpec] = [("model.embed_tokens.weight", (v, h), none)]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,), ones(h)),
                  (p + "self_attn.q_proj.weight", (q, h), none), (p + "self_attn.k_proj.weight", (kv, h), none),
                  (p + "self_attn.v_proj.weight", (kv, h), none), (p + "self_attn.o_proj.weight", (h, q), none),
                  (p + "post_attention_layernorm.weight", (h,), ones(h)),
                  (p + "mlp.gate_proj.weight", (inter, h), none), (p + "mlp.up_proj.weight", (inter, h), none),
                  (p + "mlp.down_proj.weight", (h, inter), none)]
    return specs + [("model.norm.weight", (h,), ones(h)), ("lm_head.weight", (v, h), none)]


def main(argv: list[str] | None = None) -> None:
    from gguf import GGMLQuantizationType as Q

    from tide.target import reference_gguf_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(LLAMA_SHAPES), required=True)
    ap.add_argument("--type", default="Q8_0", choices=["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"llama-{args.size}-random.{args.type}.gguf"
    started = time.monotonic()
    config = llama_config(args.size)
    write_gguf(path, config, llama_specs(config), Q[args.type], reference_gguf_path(), raw=random_raw(Q[args.type]))
    print(f"{path}: {path.stat().st_size / 2**30:.2f} GiB in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
