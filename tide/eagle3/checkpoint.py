"""Draft checkpoint directory: `config.json` + `model.safetensors`, loadable by SGLang and vLLM unchanged.

Tensor names (what SGLang's `LlamaForCausalLMEagle3.load_weights` maps, prefixing `model.` and
stacking q/k/v and gate/up; vLLM maps `midlayer.` to `layers.0.`):

    fc.weight [H, 3T]                      midlayer.self_attn.{q,k,v,o}_proj.weight (q/k/v read 2H)
    midlayer.mlp.{gate,up,down}_proj.weight  midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight
    norm.weight [H]    lm_head.weight [Vd, H]    d2t int64 [Vd] (target id = i + d2t[i])    t2d bool [V]

No embedding: engines share the target's. Writes are atomic per file (temp file + rename), tensors
in the config's `torch_dtype`, never pickle.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from tide.eagle3.config import DraftIncompatible, Eagle3Config, target_facts
from tide.eagle3.model import Eagle3Draft

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
BOOTSTRAP_DRAFT_DIR = "draft"  # where `tide draft bootstrap` puts the checkpoint inside its output directory
_FLOAT_DTYPES = {"F32", "BF16", "F16"}


def expected_tensors(cfg: Eagle3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype: "float" for any float type, else exact) of a valid checkpoint."""
    h, t, hd, inter = cfg.hidden_size, cfg.target_hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    m = "midlayer."
    shapes = {
        "fc.weight": (h, 3 * t),
        m + "self_attn.q_proj.weight": (q, 2 * h),
        m + "self_attn.k_proj.weight": (kv, 2 * h),
        m + "self_attn.v_proj.weight": (kv, 2 * h),
        m + "self_attn.o_proj.weight": (h, q),
        m + "mlp.gate_proj.weight": (inter, h),
        m + "mlp.up_proj.weight": (inter, h),
        m + "mlp.down_proj.weight": (h, inter),
        m + "input_layernorm.weight": (h,),
        m + "hidden_norm.weight": (h,),
        m + "post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
    }
    out = {name: (shape, "float") for name, shape in shapes.items()}
    out["d2t"] = ((cfg.draft_vocab_size,), "I64")
    out["t2d"] = ((cfg.vocab_size,), "BOOL")
    return out


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(draft: Eagle3Draft, path, extra: dict | None = None) -> Path:
    """Write `draft` as an SGLang/vLLM EAGLE-3 checkpoint directory; `extra` -> config.json["tide"]."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = draft.cfg.dtype
    tensors = {}
    for name, t in draft.state_dict().items():
        t = t.detach().to("cpu")
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    if set(tensors) != set(expected_tensors(draft.cfg)):  # a programming error, never user input
        raise RuntimeError(f"draft state {sorted(tensors)} does not match the checkpoint layout")
    _atomic_write(path / WEIGHTS_FILE, save(tensors, metadata={"format": "pt"}))
    config = json.dumps(draft.cfg.to_json_dict(extra), indent=2, sort_keys=True) + "\n"
    _atomic_write(path / CONFIG_FILE, config.encode())
    return path


def find_checkpoint_dir(path) -> Path:
    """`path` when it is a checkpoint directory, its `draft/` when it is a bootstrap output directory;
    FileNotFoundError naming it otherwise (so a CLI can refuse it before loading a model)."""
    p = Path(path)
    for candidate in (p, p / BOOTSTRAP_DRAFT_DIR):
        if (candidate / CONFIG_FILE).exists():
            return candidate
    raise FileNotFoundError(f"{p} is neither a draft checkpoint nor a bootstrap directory")


def read_config(path) -> Eagle3Config:
    file = Path(path) / CONFIG_FILE
    try:
        d = json.loads(file.read_text())
    except FileNotFoundError:
        raise DraftIncompatible(f"{path}: no {CONFIG_FILE}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftIncompatible(f"{file}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise DraftIncompatible(f"{file}: not a JSON object")
    return Eagle3Config.from_json_dict(d)


def read_extra(path) -> dict:
    """The "tide" section of config.json (format version + whatever the writer passed as `extra`)."""
    return dict(json.loads((Path(path) / CONFIG_FILE).read_text()).get("tide") or {})


def validate_checkpoint_dir(path, check_values: bool = True) -> Eagle3Config:
    """Check a checkpoint directory on its own (no target needed): config, tensor names, shapes,
    dtypes and, with `check_values`, the vocabulary maps and finiteness. Raises DraftIncompatible."""
    cfg = read_config(path)
    file = Path(path) / WEIGHTS_FILE
    if not file.exists():
        raise DraftIncompatible(f"{path}: no {WEIGHTS_FILE}")
    want = expected_tensors(cfg)
    try:
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
            missing, unexpected = sorted(set(want) - names), sorted(names - set(want))
            if missing or unexpected:
                raise DraftIncompatible(f"{file}: missing tensors {missing}, unexpected tensors {unexpected}")
            for name, (shape, kind) in want.items():
                s = f.get_slice(name)
                got_shape, got_dtype = tuple(s.get_shape()), s.get_dtype()
                if got_shape != shape:
                    raise DraftIncompatible(f"{file}: {name} has shape {list(got_shape)}, config implies {list(shape)}")
                if (got_dtype not in _FLOAT_DTYPES) if kind == "float" else got_dtype != kind:
                    raise DraftIncompatible(f"{file}: {name} has dtype {got_dtype}, expected {kind}")
            if check_values:
                _check_vocab_maps(file, cfg, f.get_tensor("d2t"), f.get_tensor("t2d"))
                for name, (_, kind) in want.items():
                    if kind == "float" and not torch.isfinite(f.get_tensor(name)).all():
                        raise DraftIncompatible(f"{file}: {name} has non-finite values")
    except DraftIncompatible:
        raise
    except Exception as e:  # truncated or corrupt safetensors header
        raise DraftIncompatible(f"{file}: unreadable ({type(e).__name__}: {e})") from None
    return cfg


def _check_vocab_maps(file: Path, cfg: Eagle3Config, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    targets = torch.arange(cfg.draft_vocab_size) + d2t
    if targets.min() < 0 or targets.max() >= cfg.vocab_size:
        raise DraftIncompatible(f"{file}: d2t maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")
    if targets.unique().numel() != cfg.draft_vocab_size:
        raise DraftIncompatible(f"{file}: d2t maps two draft ids to the same target id")
    if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[targets].all()):
        raise DraftIncompatible(f"{file}: t2d does not mark exactly the target ids that d2t maps to")


def check_compatible(cfg: Eagle3Config, target_config, target_embedding: torch.Tensor | None = None) -> None:
    """Refuse a draft that does not fit a target (HF config dict or engine LlamaConfig)."""
    t = target_facts(target_config)
    problems = []
    if cfg.vocab_size != t.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target vocab {t.vocab_size}")
    if cfg.target_hidden_size != t.hidden_size:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} != target hidden {t.hidden_size}")
    if cfg.hidden_size != t.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != target hidden {t.hidden_size} (the embedding is shared)")
    if cfg.aux_layers is not None and tuple(cfg.aux_layers) != tuple(t.aux_layers):
        problems.append(f"aux layers {list(cfg.aux_layers)} != layers the target captures {list(t.aux_layers)}")
    if target_embedding is not None and tuple(target_embedding.shape) != (cfg.vocab_size, cfg.hidden_size):
        problems.append(f"target embedding {list(target_embedding.shape)} != [{cfg.vocab_size}, {cfg.hidden_size}]")
    if problems:
        raise DraftIncompatible("draft does not fit the target: " + "; ".join(problems))


def load_checkpoint(path, target_embedding: torch.Tensor, target_config, device="cpu",
                    dtype: torch.dtype | None = None) -> Eagle3Draft:
    """Validate, check the fit to the target, and build the draft (in `dtype`, default the config's)."""
    cfg = validate_checkpoint_dir(path)
    check_compatible(cfg, target_config, target_embedding)
    dtype = dtype or cfg.dtype
    state = load_file(str(Path(path) / WEIGHTS_FILE), device=str(device))
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    draft.load_state_dict(state, strict=True, assign=True)
    draft.set_embedding(target_embedding)
    return draft
