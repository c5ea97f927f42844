"""EAGLE-3 draft training from hidden-state chunks (model, data and loop kept apart, SpecForge style).

    data.py       chunk sources (local dir, s3://, iterables), background prefetch, pieces, packed batches
    head.py       the target's embedding / norm / lm_head (never its layers), draft vocabulary, new drafts
    objective.py  EAGLE-3 loss with training-time-test unrolling and its attention masks
    loop.py       AdamW + warm-up/cosine, grad clipping, seeded, resumable, DDP under torchrun
    state.py      resumable training state (safetensors + JSON, no pickle)
    evaluate.py   simulated acceptance length under greedy chain drafting, per-step accuracy, coverage
    export.py     checkpoint + training_record.json
    run.py        one job end to end (`python -m services.trainer.training`)
"""

from services.trainer.training.data import Batch, Dataset, Piece, load_dataset, local_source, prefetch, s3_source, split
from services.trainer.training.evaluate import EvalResult, compare, evaluate
from services.trainer.training.export import export_draft, read_record
from services.trainer.training.head import TargetHead, draft_vocab_from_counts, new_draft
from services.trainer.training.loop import TrainConfig, TrainResult, lr_at, train
from services.trainer.training.objective import Eagle3Objective, TTTAttention
from services.trainer.training.run import build_draft, train_draft

__all__ = [
    "Batch", "Dataset", "Eagle3Objective", "EvalResult", "Piece", "TTTAttention", "TargetHead", "TrainConfig",
    "TrainResult", "build_draft", "compare", "draft_vocab_from_counts", "evaluate", "export_draft", "load_dataset",
    "local_source", "lr_at", "new_draft", "prefetch", "read_record", "s3_source", "split", "train", "train_draft",
]
