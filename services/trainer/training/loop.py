"""The training loop: AdamW, warm-up + cosine (or constant) LR, grad clipping, TTT objective,
seeded and resumable, single process or DDP under torchrun (WORLD_SIZE > 1; NCCL on CUDA, gloo
on CPU). Rank 0 writes checkpoints; every rank takes every world-th batch of the same plan.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from tqdm import tqdm

from services.trainer.training.aux_scale import layer_exponents, scale_vector, to_model_units, to_training_units
from services.trainer.training.data import Dataset, collate, plan_batches, prefetch
from services.trainer.training.head import TargetHead
from services.trainer.training.objective import STEP_DECAY, Eagle3Objective
from services.trainer.training.state import load_state, restore, save_state
from tide.allocator import release_free_memory
from tide.eagle3 import Eagle3Draft
from tide.precision import native_bf16

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """Defaults follow SpecForge's EAGLE-3 recipe where it has one (AdamW, grad clip 0.5, 0.8^k
    step weights) and are scaled down for the small, online data sets TIDE trains on."""

    steps: int | None = None  # optimizer steps; None = `epochs` passes over the data
    # With `steps`: at most this many passes over the data (None = no cap). A fixed step budget on
    # the few thousand tokens an online cycle gets memorises them: 24 steps of 4 rows (≈ 9 passes
    # over 5 chunks) took train-batch top-1 from 0.29 to 0.58 while held-out acceptance fell, 1.388
    # -> 1.365 at γ = 3 (docs/results/adapt, run b1, on an Intel AMX guest).
    max_epochs: float | None = None
    schedule_steps: int | None = None  # length of the LR schedule; None = `steps` (lets a run stop early and resume)
    # Stop after the first step that ends this many seconds after training began (None: no limit).
    # One process only (ranks would stop at different steps). The bootstrap's segments use it to
    # re-plan as soon as the pace departs from the one their length was planned with.
    max_seconds: float | None = None
    epochs: float = 1.0
    batch_rows: int = 8  # packed rows per batch (per rank)
    max_len: int = 512  # tokens per packed row
    lr: float = 3e-4
    schedule: str = "cosine"  # "cosine": warm-up then cosine to min_lr_ratio * lr; "constant": warm-up then flat
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    # Keep the draft's lm_head and final norm at their start (the target's rows and norm for a
    # from-scratch draft): the draft then only learns to produce a state the target's head reads.
    freeze_head: bool = False
    # Training-time noise on the target's aux states, in units of each state's RMS (see
    # objective.Eagle3Objective): the draft reads features it has not memorised. 0 = none.
    feature_noise: float = 0.0
    # fc trains on the aux states divided per layer by a power of two near their RMS (see
    # training.aux_scale; the exported weights are in the usual units)
    aux_norm: bool = True
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    ttt_steps: int = 3
    ttt_mask: str = "specforge"  # see objective.TTTAttention
    # Training-time test grows in: over the first `ttt_ramp` of the LR schedule the unroll rises from 1
    # step to `ttt_steps` in equal parts (`unroll_at`). Early on the draft's own states are noise to
    # learn from, and a 1-step batch costs ~0.43 of a 3-step one (`unroll_cost`): the same minutes make
    # more steps. 0 = the full unroll from the start.
    ttt_ramp: float = 0.0
    step_decay: float = STEP_DECAY
    seed: int = 0
    checkpoint_dir: str | None = None  # training state (resume); None = no checkpoints
    checkpoint_every: int = 0  # steps; 0 = only at the end
    log_every: int = 10
    progress: bool = True  # tqdm bar on rank 0
    device: str = "auto"  # "auto": cuda:<LOCAL_RANK> when CUDA is there, else cpu
    # bf16 autocast for the forward (fp32 master weights and optimizer) where the device computes bf16
    # natively (tide.precision.native_bf16): 1.7x the tokens/s of fp32 on a CI-sized CPU with
    # avx512_bf16, the usual mixed precision on GPUs. Elsewhere it is left off: on an AVX2-only CPU
    # torch emulates bf16 GEMMs at a fifth of fp32's speed.
    autocast: bool = True


@dataclass
class TrainResult:
    steps: int
    tokens: int
    seconds: float
    history: list[dict] = field(default_factory=list)  # one entry per log_every steps
    step_seconds: list[float] = field(default_factory=list)  # each step of this call, compute only
    step_unroll: list[int] = field(default_factory=list)  # TTT steps unrolled at each step of this call

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    """LR for optimizer step `step` (0-based): linear warm-up, then constant or cosine decay."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    t = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def unroll_at(cfg: TrainConfig, step: int, total: int) -> int:
    """TTT steps unrolled at optimizer step `step` (0-based) of a `total`-step schedule: 1 + (K - 1) *
    step / (ttt_ramp * total), floored, at most K. Never decreases when `total` is shortened."""
    if cfg.ttt_ramp <= 0:
        return cfg.ttt_steps
    return min(cfg.ttt_steps, 1 + int((cfg.ttt_steps - 1) * step / (cfg.ttt_ramp * total)))


# The work of a batch outside the unrolled steps (fc, the target's soft labels) in units of one
# unrolled step (the decoder layer and lm_head, forward and backward): measured on the 2-CPU machine
# with the reference target, 1- and 2-step batches take 0.43 and 0.74 of a 3-step one.
UNROLL_FIXED_COST = 0.5
# Seconds of training between two release_free_memory calls: freed batches and activations stay in
# glibc's heaps otherwise (a 10-minute run grew the trainer from 6.6 to 13.7 GB). With both CPUs the
# trainer leaves up to 2.5 GB of freed pages in 15 s on 695k tokens; a call costs about 35 ms per
# 500 MB released, so every 10 s is under 1 % of the time and a sawtooth of about 1.5 GB.
TRIM_EVERY_S = 10.0


def unroll_cost(unroll: int, ttt_steps: int) -> float:
    """Time of a batch unrolled `unroll` steps, relative to one unrolled `ttt_steps`."""
    return (UNROLL_FIXED_COST + unroll) / (UNROLL_FIXED_COST + ttt_steps)


def _distributed() -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{local}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    return (dist.get_rank() if world > 1 else 0), world, device


def train(draft: Eagle3Draft, head: TargetHead, data: Dataset, cfg: TrainConfig) -> TrainResult:
    """Train `draft` (in place, fp32) on `data`. With `cfg.checkpoint_dir` holding a state, resume
    from it: the result equals that of an uninterrupted run."""
    if not data.pieces:
        raise ValueError("no training data")
    rank, world, device = _distributed()
    if cfg.device != "auto":
        device = torch.device(cfg.device)
    draft.to(device=device, dtype=torch.float32)
    draft.set_embedding(head.embed)
    draft.train()
    state = load_state(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    saved = state["doc"]["config"] if state else {}
    # a resumed run keeps the exponents its optimizer moments were made with
    exponents = (saved.get("aux_exponents") or layer_exponents(data.pieces)) if cfg.aux_norm else None
    scale = scale_vector(exponents, draft.cfg.target_hidden_size) if exponents else None
    targets = (torch.arange(draft.cfg.draft_vocab_size, device=device) + draft.d2t).cpu()
    objective = Eagle3Objective(draft, head.lm_head[targets], cfg.ttt_steps, cfg.ttt_mask, cfg.step_decay,
                                cfg.feature_noise, scale, head.logit_softcap).to(device)
    for p in (*draft.lm_head.parameters(), *draft.norm.parameters()):
        p.requires_grad_(not cfg.freeze_head)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    model = objective
    if world > 1:
        ids = [device] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(objective, device_ids=ids)
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)

    progress = {"step": 0, "epoch": 0, "batch": 0, "tokens": 0, "seconds": 0.0}
    if state is not None:
        progress = restore(state, draft, optimizer)
        log.info("resuming from %s at step %d", cfg.checkpoint_dir, progress["step"])
    del state
    saved_config = {**_jsonable(cfg), "aux_exponents": exponents}

    def checkpoint() -> None:  # always in the model's units: what an export or a resume reads
        if scale is not None:
            to_model_units(draft.fc, scale)
        save_state(cfg.checkpoint_dir, draft, optimizer, progress, saved_config)
        if scale is not None:
            to_training_units(draft.fc, scale)

    if scale is not None:
        to_training_units(draft.fc, scale)
    try:
        result = _steps(cfg, data, objective, model, optimizer, trainable, progress, rank, world, device, checkpoint)
        if cfg.checkpoint_dir and rank == 0:
            checkpoint()
    finally:  # also on an error: the caller's draft is in the model's units
        if scale is not None:
            to_model_units(draft.fc, scale)
    return result


@functools.cache  # once per process: a bootstrap trains in several segments
def _note_autocast_off(device_type: str) -> None:
    log.info("bf16 autocast off: %s has no native bf16 (float32 is faster there)", device_type)


def _steps(cfg: TrainConfig, data: Dataset, objective: Eagle3Objective, model, optimizer, trainable: list,
           progress: dict, rank: int, world: int, device: torch.device, checkpoint) -> TrainResult:
    """The optimizer steps of `train` (from `progress` on, which it updates)."""
    lengths = [len(p) for p in data.pieces]

    def epoch_plan(epoch: int) -> list:
        plan = plan_batches(lengths, cfg.batch_rows, cfg.max_len, cfg.seed, epoch)
        return [plan[i * world + rank] for i in range(len(plan) // world)]

    per_epoch = len(epoch_plan(0))
    if per_epoch == 0:
        raise ValueError(f"{len(lengths)} pieces make fewer batches than {world} ranks")
    total = cfg.steps if cfg.steps is not None else max(1, math.ceil(cfg.epochs * per_epoch))
    if cfg.steps is not None and cfg.max_epochs:
        total = min(total, max(1, math.ceil(cfg.max_epochs * per_epoch)))
    horizon = cfg.schedule_steps or total  # the LR schedule's length
    result = TrainResult(progress["step"], progress["tokens"], progress["seconds"])
    autocast = cfg.autocast and native_bf16(device.type)
    if cfg.autocast and not autocast and rank == 0:
        _note_autocast_off(device.type)
    bar = tqdm(total=total, initial=progress["step"], disable=not cfg.progress or rank != 0, desc="train", unit="step")
    window = torch.zeros(cfg.ttt_steps, 3)
    window_tokens, window_start = 0, time.perf_counter()
    trimmed = began = time.monotonic()
    out_of_time = False
    while progress["step"] < total and not out_of_time:
        plan = epoch_plan(progress["epoch"])[progress["batch"]:]
        for batch in prefetch(plan, fn=lambda rows: collate(data.pieces, rows)):
            t0 = time.perf_counter()
            step = progress["step"]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(cfg, step, horizon)
            objective.noise_rng.manual_seed(cfg.seed * 1_000_003 + step)  # one stream per (seed, step); a prime
            unroll = unroll_at(cfg, step, horizon)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss, stats = model(batch.to(device), unroll)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
            optimizer.step()
            n = _global_tokens(batch.num_tokens, world, device)
            took = time.perf_counter() - t0
            result.step_seconds.append(took)
            result.step_unroll.append(unroll)
            progress.update(step=step + 1, batch=progress["batch"] + 1, tokens=progress["tokens"] + n,
                            seconds=progress["seconds"] + took)
            window += stats.detach().cpu()
            if time.monotonic() - trimmed >= TRIM_EVERY_S:
                release_free_memory()
                trimmed = time.monotonic()
            window_tokens += n
            if (step + 1) % cfg.log_every == 0 or step + 1 == total:
                k = cfg.log_every if (step + 1) % cfg.log_every == 0 else (step + 1) % cfg.log_every
                entry = {"step": step + 1, "lr": lr_at(cfg, step, horizon), "unroll": unroll, "loss": loss.item(),
                         "grad_norm": float(grad_norm),
                         "step_loss": (window[:, 0] / k).tolist(),
                         "step_acc": (window[:, 1] / window[:, 2].clamp(min=1)).tolist(),
                         "tokens_per_s": window_tokens / (time.perf_counter() - window_start)}
                result.history.append(entry)
                bar.set_postfix(loss=f"{entry['loss']:.3f}", acc0=f"{entry['step_acc'][0]:.2f}",
                                tok_s=f"{entry['tokens_per_s']:.0f}")
                window.zero_()
                window_tokens, window_start = 0, time.perf_counter()
            bar.update(1)
            if cfg.checkpoint_dir and rank == 0 and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                checkpoint()
            out_of_time = world == 1 and cfg.max_seconds is not None and time.monotonic() - began >= cfg.max_seconds
            if progress["step"] >= total or out_of_time:
                break
        else:
            progress.update(epoch=progress["epoch"] + 1, batch=0)
    bar.close()
    result.steps, result.tokens, result.seconds = progress["step"], progress["tokens"], progress["seconds"]
    return result


def _global_tokens(n: int, world: int, device: torch.device) -> int:
    """Tokens of this step over all ranks (for throughput and the resumable token count)."""
    if world == 1:
        return n
    t = torch.tensor([n], device=device)
    dist.all_reduce(t)
    return int(t)


def _jsonable(cfg: TrainConfig) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}
