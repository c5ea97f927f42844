"""A GGUF file's tensors under their HF names, read one at a time from the memory-mapped file.

llama.cpp's files hold each tensor in its own block format (F32, F16, BF16, Q8_0, Q4_0, Q4_1, the
K-quants, ...). `GGUFTensors` maps the HF checkpoint names the engine loads (`model.layers.0.
self_attn.q_proj.weight`, ...) to float32 tensors dequantized on access, so a loader holds the
float values of one tensor at a time and never of the whole model: an 8B Q8_0 file (8.5 GB)
dequantized whole would be 32 GB of float32, more than a 24 GB machine has.

The HF names and llama.cpp's layout changes are transformers' own (its GGUF support, read here
per tensor instead of all at once): the name map comes from a meta-device instance of the
config's model class (no memory), and the architecture's tensor processor undoes what llama.cpp's
converter did (Llama's q/k rows permuted for its RoPE layout; Gemma's norms stored as 1 + w).

`index` parses the file once (GGUFReader and transformers' name map take seconds each); the
target's cache directory keeps it as JSON (tide.target), so a later start opens no parser at all.

The common formats dequantize in torch (all threads; the same float32 values as gguf-py's numpy
`dequantize`: one multiply, and for Q4_1 one add, per element, both exact roundings of the same
operands); the rest take gguf-py's `dequantize`.
"""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path

import numpy as np
import torch

from tide.tensor_mapping import TensorMapping

# Bytes per 32-value block (the block's float16 scale d first; Q4_1 then its float16 minimum m).
_Q8_0_BLOCK, _Q4_0_BLOCK, _Q4_1_BLOCK = 34, 18, 20


def gguf_hf_config(path: Path, reader=None) -> dict:
    """The HF config.json transformers derives from the file's metadata (no tensor is read), with
    the head size llama.cpp records (`<arch>.attention.key_length`) where transformers' mapping
    for the architecture has no key for it (Qwen 3: it would take Qwen3Config's default of 128)."""
    from gguf import GGUFReader
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import read_field

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    config.pop("quantization_config", None)
    config.pop("transformers_version", None)
    reader = reader or GGUFReader(path)
    arch = read_field(reader, "general.architecture")[0]
    key_length = read_field(reader, f"{arch}.attention.key_length")
    if key_length:
        config["head_dim"] = int(key_length[0])
    if not config.get("architectures"):
        from transformers import AutoModelForCausalLM

        config["architectures"] = [AutoModelForCausalLM._model_mapping[type(AutoConfig.for_model(
            config["model_type"]))].__name__]
    return json.loads(json.dumps(config, default=str))


def _half(raw: torch.Tensor, at: int) -> torch.Tensor:
    """[blocks, 1] float32: the float16 at byte `at` of each block row."""
    return raw[:, at:at + 2].contiguous().view(torch.float16).float()


def dequantize(data: np.ndarray, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 [*shape] (HF order: rows first) from a GGUF tensor's raw bytes (`data`, uint8)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    qtype = Q(qtype)
    raw = torch.from_numpy(data)
    if qtype == Q.F32:
        return raw.view(torch.float32).reshape(shape).clone()
    if qtype in (Q.F16, Q.BF16):
        return raw.view(torch.float16 if qtype == Q.F16 else torch.bfloat16).float().reshape(shape)
    block = {Q.Q8_0: _Q8_0_BLOCK, Q.Q4_0: _Q4_0_BLOCK, Q.Q4_1: _Q4_1_BLOCK}.get(qtype)
    if block is None:  # K-quants and the rest: gguf-py's numpy, one row of blocks per output row
        return torch.from_numpy(quants.dequantize(data.reshape(shape[0], -1), qtype)).reshape(shape)
    raw = raw.view(-1, block)
    d = _half(raw, 0)
    if qtype == Q.Q8_0:
        return (raw[:, 2:].view(torch.int8).float() * d).reshape(shape)
    nib = raw[:, block - 16:]
    q = torch.cat([nib & 0x0F, nib >> 4], dim=1).float()  # low nibbles: values 0..15, high: 16..31
    if qtype == Q.Q4_0:
        return ((q - 8) * d).reshape(shape)
    return (q * d + _half(raw, 2)).reshape(shape)


def index(path: Path) -> dict:
    """What `GGUFTensors` needs to read the file without parsing it again (GGUFReader takes seconds
    on a 49k-token vocabulary; transformers' name map as long): the architecture and, per HF name,
    the tensor's byte offset and size in the file, GGUF type and HF shape; and the HF config
    (`gguf_hf_config`). JSON-serialisable."""
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map, read_field

    reader = GGUFReader(path)
    config = gguf_hf_config(path, reader)
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config)
    name_map = get_gguf_hf_weights_map(meta, TensorProcessor())
    tensors = {name_map[t.name]: {"gguf_name": t.name, "offset": int(t.data_offset), "nbytes": int(t.n_bytes),
                                  "type": int(t.tensor_type), "shape": [int(n) for n in reversed(t.shape)]}
               for t in reader.tensors if t.name in name_map}
    return {"architecture": str(read_field(reader, "general.architecture")[0]), "config": config, "tensors": tensors}


def _read_ahead(path: Path, block: int = 16 << 20) -> None:
    """Read `path` once, start to end, discarding the bytes (they stay in the page cache)."""
    buf = bytearray(block)
    with contextlib.suppress(OSError), path.open("rb", buffering=0) as f:  # a hint: the loader's reads report errors
        while f.readinto(buf):
            continue


class GGUFTensors(TensorMapping):
    """HF name -> float32 tensor, read from the file and dequantized at each access (nothing is
    kept, and the file is read with pread, not mapped: what a loader holds is its own tensors)."""

    def __init__(self, path: Path, file_index: dict, config: dict) -> None:
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.path = Path(path)
        self._tensors = self._names = file_index["tensors"]
        self._processor = TENSOR_PROCESSORS.get(file_index["architecture"], TensorProcessor)(config=config)
        # Read the file ahead in a background thread (into the page cache, in file order): tensors
        # are then converted while the next are read. An 8B Q8_0 file from a cold cache loaded in
        # 40 s without (each read waited for the conversion before it; posix_fadvise's WILLNEED
        # did not help) where reading the file alone takes 5.8 s.
        threading.Thread(target=_read_ahead, args=(self.path,), name="gguf-read-ahead", daemon=True).start()

    def q8_0_rows(self, name: str) -> torch.Tensor | None:
        """A Q8_0 matrix's raw rows (uint8 [out, in / 32 * 34]) in HF order, for quantized serving
        without float values (tide.quant.Int8Linear.from_q8_0); None for other types, or where the
        architecture's processor changes values rather than reorders rows."""
        from gguf import GGMLQuantizationType as Q

        t = self._tensors[name]
        if t["type"] != Q.Q8_0 or len(t["shape"]) != 2:
            return None
        rows = t["shape"][0]
        order = np.arange(rows, dtype=np.float32)[:, None]  # where the processor moves each row
        moved = self._processor.process(weights=order, name=t["gguf_name"], tensor_key_mapping={},
                                        parsed_parameters={}).weights
        moved = np.asarray(moved).reshape(-1)
        if not np.array_equal(np.sort(moved), order.reshape(-1)):
            return None
        raw = torch.from_numpy(self._read(t)).view(rows, -1)
        return raw if np.array_equal(moved, order.reshape(-1)) else raw[torch.from_numpy(moved.astype(np.int64))]

    def _read(self, t: dict) -> np.ndarray:
        data = np.empty(t["nbytes"], dtype=np.uint8)
        view, done = memoryview(data), 0
        with self.path.open("rb", buffering=0) as f:
            f.seek(t["offset"])
            while done < len(view):  # one read returns at most ~2 GiB on Linux
                got = f.readinto(view[done:])
                if not got:
                    raise OSError(f"{self.path}: truncated at tensor {t['gguf_name']}")
                done += got
        return data

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        w = dequantize(self._read(t), t["type"], tuple(t["shape"]))
        values = w.numpy()
        processed = self._processor.process(weights=values, name=t["gguf_name"], tensor_key_mapping={},
                                            parsed_parameters={}).weights
        # The processor hands back its input, or a new array where it reordered or shifted it.
        return w if processed is values else torch.from_numpy(np.ascontiguousarray(processed))
