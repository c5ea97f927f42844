"""Phase 3 of `tide draft bootstrap`: export the draft to `DIR/draft/` (checkpoint +
training_record.json), evaluate the exported (bf16-rounded) weights on the held-out chunks, and write
`DIR/report.json` and `DIR/report.png` (loss and acceptance over training)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from tide.eagle3.checkpoint import BOOTSTRAP_DRAFT_DIR
from tide.precision import dtype_name, resolve_dtype
from tools.draft.bootstrap_config import BootstrapConfig
from tools.draft.bootstrap_state import BootstrapManifest, BudgetClock
from tools.draft.bootstrap_train import evaluate_held_out
from tools.draft.generation import write_blob

log = logging.getLogger(__name__)

REPORT_JSON = "report.json"
REPORT_PNG = "report.png"


def export_phase(cfg: BootstrapConfig, out: Path, manifest: BootstrapManifest, clock: BudgetClock, summary: dict,
                 generated: dict, evaluate=evaluate_held_out) -> dict:
    """Export the trained draft (`summary`: what `train_phase` returned; `generated`: this run's
    generation stats), evaluate it as served with `evaluate`, write the report; returns it."""
    from services.trainer.training.export import export_draft
    from tide.eagle3 import load_checkpoint

    head, draft, tr = summary["head"], summary["draft"], manifest.doc["train"]
    draft_dir = out / BOOTSTRAP_DRAFT_DIR
    args = {**dataclasses.asdict(cfg), "target": str(cfg.target), "target_model": head.model_id}
    export_draft(draft_dir, draft.cpu(), args, summary["train_chunks"], {"curve": tr["curve"]},
                 target_model=head.model_id)
    exported = load_checkpoint(draft_dir, head.embed, head.config, dtype=torch.float32)  # as served (bf16-rounded)
    final = evaluate(exported, summary["eval_set"], head, cfg)
    clock.charge("eval")
    doc = manifest.doc
    eval_tokens, train_tokens = manifest.tokens("eval"), manifest.tokens("train")
    gen_s = doc["spent_s"]["generate"]
    report = {
        "target": head.model_id, "draft": str(draft_dir), "created_at": time.time(),
        "accept_length": final["acceptance"], "top1": final["top1"], "evaluation": final,
        "budget_minutes": cfg.minutes, "wall_minutes": clock.elapsed() / 60,
        "spent_minutes": {k: v / 60 for k, v in doc["spent_s"].items()},
        "runs": doc["runs"],
        "generation": {
            "prompts_train": sum(1 for v in doc["prompts"].values() if v["split"] == "train"),
            "prompts_eval": sum(1 for v in doc["prompts"].values() if v["split"] == "eval"),
            "output_tokens_train": train_tokens, "output_tokens_eval": eval_tokens,
            "chunks_train": len(doc["chunks"]["train"]), "chunks_eval": len(doc["chunks"]["eval"]),
            "skipped_long": sum(1 for v in doc["prompts"].values() if v["split"] == "skipped"),
            "tokens_per_s": (train_tokens + eval_tokens) / gen_s if gen_s else None,
            "dtype": dtype_name(resolve_dtype(cfg.dtype)),
            "this_run": generated,
        },
        "training": {"steps": summary["steps"], "schedule_steps": summary["schedule_steps"],
                     "planned_steps": summary["planned_steps"],
                     "tokens": summary["tokens"], "data_rows": summary["data_tokens"],
                     "epochs": summary["epochs"], "stopped_early": tr.get("stopped_early", False),
                     "seconds_per_step": tr.get("step_s"), "evaluations": tr.get("evals", cfg.evals),
                     "seconds_per_evaluation": tr.get("eval_s")},
        "curve": tr["curve"],
        "loss_history": tr["history"],
        "config": dataclasses.asdict(cfg),
    }
    # the training record carries the final evaluation too
    record_path = draft_dir / "training_record.json"
    record = json.loads(record_path.read_text())
    record["evaluation"] = {"held_out": final, "curve": tr["curve"], "report": REPORT_JSON}
    record_path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    plot_report(report, out / REPORT_PNG)
    clock.charge("other")
    report["wall_minutes"] = clock.elapsed() / 60
    report["spent_minutes"] = {k: v / 60 for k, v in doc["spent_s"].items()}
    write_blob(out, REPORT_JSON, (json.dumps(report, indent=2) + "\n").encode())
    doc["done"] = True
    manifest.save()
    log.info("bootstrap done: acceptance %s (held-out), draft in %s", final["acceptance"], draft_dir)
    return report


def plot_report(report: dict, path: Path) -> None:
    """Loss over training tokens; held-out acceptance length (each γ) over training tokens and minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve, hist = report["curve"], report["loss_history"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    if hist:
        ax.plot([h["step"] for h in hist], [h["loss"] for h in hist], lw=1, alpha=0.5, label="train objective")
        ax.plot([h["step"] for h in hist], [h["step_loss"][0] for h in hist], lw=1, label="train loss, step 1")
    ax.plot([c["step"] for c in curve], [c["ttt_loss"][0] for c in curve], "o-", ms=3, label="held-out loss, step 1")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title("loss (objective: unrolled steps weighted)")
    ax.legend()
    gammas = sorted(curve[-1]["acceptance"], key=int) if curve else []
    for ax, xkey, xlabel in ((axes[1], "train_tokens", "training tokens processed"),
                             (axes[2], "wall_minutes", "wall minutes (generation + training)")):
        for g in gammas:
            ax.plot([c[xkey] for c in curve], [c["acceptance"][g] for c in curve], "o-", ms=3, label=f"γ={g}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out acceptance length")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].set_title("acceptance vs tokens")
    axes[2].set_title("acceptance vs minutes")
    fig.suptitle(f"bootstrap of {report['target']}: {report['generation']['output_tokens_train']} training tokens, "
                 f"{report['training']['steps']} steps, {report['wall_minutes']:.1f} min")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".report.", suffix=".png", dir=path.parent)
    os.close(fd)
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
