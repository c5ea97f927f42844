"""Settings of `tide draft bootstrap` (`BootstrapConfig`), and which of them a resumed run must share
with the run that started its output directory (`FIXED`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class BootstrapConfig:
    target: str = "ref"
    prompts: list[str] = field(default_factory=list)
    out: str = "bootstrap"
    minutes: float = 30.0  # wall-time budget of the whole run (generation + training + export)
    # Share of the budget that generation may use (held-out prompts included). The draft is limited
    # by optimizer steps more than by distinct tokens: on one machine and one data source, a 30-minute
    # run with generation cut at 0.5 / 0.4 / 0.3 of the budget reached served accept@3 1.855 / 1.922 /
    # 1.972 (2.1 / 4.2 / 7.0 passes over the data;
    # docs/results/bootstrap, boot17, on an AMD avx512_bf16 guest). A clean-clone run with 0.3
    # gave 1.940: runs of one setting differ by ~0.03
    # (docs/results/bootstrap, boot18).
    gen_fraction: float = 0.3
    gen_tokens: int | None = None  # stop generating once the training set holds this many output tokens
    prompt_limit: int | None = None  # prompts read per file
    eval_prompts: int = 32  # held-out prompts (evaluation only)
    # Engine slots while generating. More slots make more tokens per second (reference model on the
    # Intel AMX machine, prompts grouped by length: 325 tokens/s at 32, 379 at 64, 450 at 128), and
    # since generation is cut at its deadline they cost training no time. But the float32 KV cache
    # grows with them (128 slots x 769 positions: 7.9 GB resident), and in a 30-minute run 128 slots'
    # 1.3x the tokens ended at the same held-out acceptance as 32
    # (docs/results/bootstrap, boot15 and boot16).
    batch: int = 32
    max_tokens: int = 256  # output tokens per prompt
    max_prompt_tokens: int = 768  # longer prompts are skipped
    chunk_tokens: int = 2048  # rows per chunk file (the workers' default)
    dtype: str = "auto"  # target dtype for generation (tide.precision: "auto" = bf16 where fast, else fp32)
    draft_vocab: int = 8192
    max_epochs: float = 20.0  # cap on passes over the training data
    evals: int = 8  # evaluations on the held-out chunks during training (the curve; see bootstrap_train.EVAL_SHARE)
    # A from-scratch draft in a ~15-minute training budget is limited by optimizer steps, not by
    # tokens: on 292k output tokens (boot6's data), 2 rows x 512 at lr 1e-3 reached held-out served
    # accept@3 1.64 in 4.3 min of training, where 8 rows at 3e-4 had 1.40 after 2.9 min and 2 rows
    # at 3e-4 1.63 after 6.4 min (docs/results/bootstrap, boot6, on an AMD avx512_bf16 guest).
    lr: float = 1e-3
    batch_rows: int = 2
    learn_prompt_rows: bool = False  # see training.data.load_dataset
    max_len: int = 512
    ttt_steps: int = 3
    ttt_mask: str = "specforge"  # see training.objective.TTTAttention
    # The unroll grows from 1 to ttt_steps over this share of the schedule (training.loop.TrainConfig).
    # At equal compute on boot19's data (1,440 steps with it, 1,200 without): held-out served
    # accept@3 2.017 against 1.912 (docs/results/bootstrap, "Fixed-step A/Bs on boot19's data").
    ttt_ramp: float = 0.4
    warmup_steps: int = 20
    freeze_head: bool = False  # see training.loop.TrainConfig
    feature_noise: float = 0.0  # see training.loop.TrainConfig
    aux_norm: bool = True  # per-layer scaling of the aux states while training (training.aux_scale)
    autocast: bool = True  # bf16 autocast for the training forward (see training.loop.TrainConfig)
    seed: int = 0
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    progress: bool = True

    @property
    def eval_len(self) -> int:
        return self.max_prompt_tokens + self.max_tokens + 1

    def train_config(self, state_dir: Path, steps: int, schedule_steps: int | None, max_seconds: float | None = None):
        from services.trainer.training.loop import TrainConfig

        return TrainConfig(steps=steps, schedule_steps=schedule_steps, batch_rows=self.batch_rows,
                           max_len=self.max_len, lr=self.lr, warmup_steps=self.warmup_steps,
                           ttt_steps=self.ttt_steps, ttt_mask=self.ttt_mask, ttt_ramp=self.ttt_ramp, seed=self.seed,
                           freeze_head=self.freeze_head, feature_noise=self.feature_noise, aux_norm=self.aux_norm,
                           checkpoint_dir=str(state_dir), autocast=self.autocast, max_seconds=max_seconds,
                           log_every=1, progress=False)  # segments start anywhere


# Settings a resumed run must share with the first one (the rest may change, e.g. --minutes).
FIXED = ("target", "eval_prompts", "max_tokens", "max_prompt_tokens", "seed", "draft_vocab", "lr", "batch_rows",
         "max_len", "ttt_steps", "ttt_mask", "warmup_steps", "learn_prompt_rows", "freeze_head", "feature_noise",
         "aux_norm", "ttt_ramp")
# What a manifest written before a FIXED setting existed did, for that setting (not today's default:
# resuming such a run with the new default would change its training under it).
BEFORE_SETTING = {"aux_norm": False, "ttt_ramp": 0.0}
