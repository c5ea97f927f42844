"""Training runs on demand: the manifest's buffered chunks -> the training library -> an outcome.

No gRPC. `TrainingRunner.trigger` starts at most one run at a time, in a thread, over the chunks of
the trainer's target that no recorded run used (manifest.py). The run calls the training library
(`services.trainer.training.train_draft`; never a trainer of our own): the library is imported at
trigger time, so a deployment without it refuses with `TrainingUnavailable` instead of failing at
start. The candidate is exported under the work directory; a successful run is recorded in the
manifest (its chunks stop being buffered) and its outcome reported (to the controller). A failed
run records nothing: its chunks stay buffered for the next one.

Registering and promoting the candidate is the next step of the trainer (registry + controller).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from minio import Minio

from services.trainer.manifest import Manifest, ManifestEntry
from services.trainer.settings import TrainerSettings
from tide import blobs

log = logging.getLogger(__name__)


class TrainingUnavailable(Exception):
    """Training cannot run here (the library is missing, or the target cannot be loaded)."""


class TargetNotReady(TrainingUnavailable):
    """The target is still being prepared (e.g. the reference GGUF converted on first use); retry."""


class WrongTarget(ValueError):
    """The request names a target this trainer does not train."""


@dataclass(frozen=True)
class TriggerResult:
    accepted: bool
    run_id: str
    detail: str


@dataclass(frozen=True)
class TrainingOutcome:
    """Mirrors tide.v1.TrainingOutcome (accept lengths: simulated, bonus token included)."""

    run_id: str
    target_model: str
    candidate_version: str = ""
    base_version: str = ""
    eval_accept_length_candidate: float = 0.0
    eval_accept_length_base: float = 0.0
    promoted: bool = False
    detail: str = ""
    train_tokens: int = 0
    eval_tokens: int = 0
    duration_s: float = 0.0
    finished_unix_s: float = 0.0


@dataclass(frozen=True)
class RunnerStatus:
    state: str  # "idle" | "training"
    run_id: str
    target_model: str  # "" while the target is still being resolved
    last_outcome: TrainingOutcome | None


def load_library():
    """(train_draft, TrainConfig) from the training library; TrainingUnavailable when it is missing."""
    try:
        from services.trainer.training import TrainConfig, train_draft
    except ImportError as e:
        raise TrainingUnavailable(f"the training library (services.trainer.training) is not available: {e}") from None
    return train_draft, TrainConfig


class TrainingRunner:
    def __init__(self, settings: TrainerSettings, s3: Minio, manifest: Manifest,
                 report: Callable[[TrainingOutcome], None] | None = None) -> None:
        self.settings, self.s3, self.manifest, self.report = settings, s3, manifest, report
        self._lock = threading.Lock()
        self._run_id = ""
        self._thread: threading.Thread | None = None
        self.last_outcome: TrainingOutcome | None = None
        # The target's model id names its chunks; resolving "ref" may convert the GGUF once (~20 s).
        pool = concurrent.futures.ThreadPoolExecutor(1, "resolve-target")
        self._target = pool.submit(self._resolve)
        pool.shutdown(wait=False)

    def _resolve(self) -> str:
        from tide.target import resolve_target

        return resolve_target(self.settings.target).model_id

    def target_model(self, timeout_s: float | None = 120.0) -> str:
        try:
            return self._target.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TargetNotReady(f"target {self.settings.target!r} is still being prepared; retry") from None
        except Exception as e:
            raise TrainingUnavailable(f"target {self.settings.target!r} cannot be loaded: {e}") from None

    def status(self) -> RunnerStatus:
        target = self._target.result() if self._target.done() and not self._target.exception() else ""
        with self._lock:
            return RunnerStatus("training" if self._run_id else "idle", self._run_id, target, self.last_outcome)

    def trigger(self, target_model: str = "", reason: str = "", force: bool = False) -> TriggerResult:
        train_draft, config_cls = load_library()
        target = self.target_model()
        if target_model and target_model != target:
            raise WrongTarget(f"this trainer trains drafts for {target!r}, not {target_model!r}")
        with self._lock:
            if self._run_id:
                return TriggerResult(False, self._run_id, "a training run is already going")
            entries = self.manifest.buffered(target)
            tokens = sum(e.num_tokens for e in entries)
            if not entries:
                return TriggerResult(False, "", f"no chunks of {target} are buffered")
            if tokens < self.settings.min_tokens and not force:
                return TriggerResult(False, "", f"{tokens} tokens buffered, {self.settings.min_tokens} needed "
                                                "(force=true trains anyway)")
            run_id = f"run-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"
            self._run_id = run_id
            self._thread = threading.Thread(target=self._run, args=(run_id, target, entries, reason, train_draft,
                                                                    config_cls), name=f"train-{run_id}", daemon=True)
            self._thread.start()
        log.info("training run %s started on %d chunks (%d tokens) of %s: %s", run_id, len(entries), tokens, target,
                 reason or "no reason given")
        return TriggerResult(True, run_id, f"training on {len(entries)} chunks ({tokens} tokens)")

    def _blobs(self, entries: list[ManifestEntry]) -> Iterator[bytes]:
        """The chunks' blobs, verified again (one that went bad since intake is skipped, not trained on)."""
        for e in entries:
            try:
                yield blobs.get_bytes(self.s3, e.bucket, e.key, expected_sha256=e.sha256)
            except blobs.ChecksumMismatch as err:
                log.error("skipping chunk %s: %s", e.chunk_id, err)

    def _run(self, run_id: str, target: str, entries: list[ManifestEntry], reason: str, train_draft,
             config_cls) -> None:
        s, t0 = self.settings, time.monotonic()
        out_dir = Path(s.work_dir) / "runs" / run_id / "draft"
        try:
            cfg = config_cls(steps=s.steps or None, epochs=s.epochs, batch_rows=s.batch_rows, max_len=s.max_len,
                             device=s.device, seed=s.seed, progress=False)
            summary = train_draft(s.target, self._blobs(entries), out_dir, cfg=cfg, draft_vocab_size=s.draft_vocab,
                                  eval_fraction=s.eval_fraction, expected_target=target)
            candidate = summary.get("candidate") or {}
            outcome = TrainingOutcome(
                run_id, target, eval_accept_length_candidate=float(
                    (candidate.get("acceptance") or {}).get(str(s.eval_gamma), 0.0)),
                detail=f"candidate exported to {out_dir} (not registered: registration is the trainer's next step)",
                train_tokens=int(summary["train"]["tokens"]), eval_tokens=int(candidate.get("tokens", 0)),
                duration_s=time.monotonic() - t0, finished_unix_s=time.time())
            self.manifest.record_run(target, run_id, [e.chunk_id for e in entries],
                                     {"reason": reason, "outcome": dataclasses.asdict(outcome), "out_dir": str(out_dir),
                                      "train": summary["train"], "candidate": candidate or None})
            log.info("training run %s done in %.1f s: simulated accept length %.3f at gamma %d", run_id,
                     outcome.duration_s, outcome.eval_accept_length_candidate, s.eval_gamma)
        except Exception as e:
            log.exception("training run %s failed", run_id)
            outcome = TrainingOutcome(run_id, target, detail=f"failed: {type(e).__name__}: {e}",
                                      duration_s=time.monotonic() - t0, finished_unix_s=time.time())
        with self._lock:
            self.last_outcome, self._run_id = outcome, ""
        if self.report is not None:
            try:
                self.report(outcome)
            except Exception:
                log.exception("could not report the outcome of %s", run_id)

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the current run (tests, shutdown)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
