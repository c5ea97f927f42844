"""EAGLE-3 draft model and its checkpoint format (the layout SGLang and vLLM load)."""

from tide.eagle3.checkpoint import (
    check_compatible,
    expected_tensors,
    load_checkpoint,
    read_config,
    read_extra,
    save_checkpoint,
    validate_checkpoint_dir,
)
from tide.eagle3.config import ARCHITECTURE, DraftIncompatible, Eagle3Config, default_aux_layers
from tide.eagle3.model import Attend, Eagle3Draft, causal_attend

__all__ = [
    "ARCHITECTURE",
    "Attend",
    "DraftIncompatible",
    "Eagle3Config",
    "Eagle3Draft",
    "causal_attend",
    "check_compatible",
    "default_aux_layers",
    "expected_tensors",
    "load_checkpoint",
    "read_config",
    "read_extra",
    "save_checkpoint",
    "validate_checkpoint_dir",
]
