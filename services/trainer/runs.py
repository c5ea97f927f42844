"""Training runs: at most one at a time, in a thread, over the manifest's buffered chunks.

No gRPC. `TrainingRunner.trigger` (TriggerTraining, or the automatic trigger in auto.py) starts a
run over the chunks of the trainer's target that no recorded run used (manifest.py); the run itself
is cycle.py (base draft from the registry -> training library -> compare -> register -> promote ->
record). The training library (`services.trainer.training`) is imported at trigger time, so a
deployment without it refuses with `TrainingUnavailable` instead of failing at start. Every outcome
is reported (to the controller), failed ones included; a failed run records nothing, so its chunks
stay buffered for the next one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from services.trainer.cycle import FAILED, TrainingCycle, TrainingOutcome
from services.trainer.manifest import Manifest, ManifestEntry
from services.trainer.settings import TrainerSettings
from tide.allocator import release_free_memory

__all__ = ["RunStats", "RunnerStatus", "TargetNotReady", "TrainingOutcome", "TrainingRunner", "TrainingUnavailable",
           "TriggerResult", "WrongTarget", "load_library"]

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
class RunnerStatus:
    state: str  # "idle" | "training" | "evaluating" (comparing, registering, promoting)
    run_id: str
    target_model: str  # "" while the target is still being resolved
    last_outcome: TrainingOutcome | None
    phase: str = ""  # of the current run: starting | base | training | evaluating | promoting
    progress: float = 0.0  # of the current run, by phase (base 0, training 0.1, evaluating 0.8, promoting 0.9)
    loss: float = 0.0  # last training loss of the latest run that trained (0 before any)


def load_library():
    """(train_draft, TrainConfig) from the training library; TrainingUnavailable when it is missing."""
    try:
        from services.trainer.training import TrainConfig, train_draft
    except ImportError as e:
        raise TrainingUnavailable(f"the training library (services.trainer.training) is not available: {e}") from None
    return train_draft, TrainConfig


@dataclass
class RunStats:
    """Totals since start (metrics.py)."""

    results: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # result -> runs
    seconds: float = 0.0  # wall time of finished runs
    last_candidate: float | None = None  # served accept lengths of the last run that got that far
    last_base: float | None = None
    consecutive_failures: int = 0


class TrainingRunner:
    def __init__(self, settings: TrainerSettings, cycle: TrainingCycle, manifest: Manifest,
                 report: Callable[[TrainingOutcome], None] | None = None) -> None:
        self.settings, self.cycle, self.manifest, self.report = settings, cycle, manifest, report
        self._lock = threading.Lock()
        self._run_id = ""
        self._phase, self._progress, self._loss = "", 0.0, 0.0
        self._thread: threading.Thread | None = None
        self.last_outcome: TrainingOutcome | None = None
        self.stats = RunStats()
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

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._run_id)

    def status(self) -> RunnerStatus:
        target = self._target.result() if self._target.done() and not self._target.exception() else ""
        with self._lock:
            if not self._run_id:
                return RunnerStatus("idle", "", target, self.last_outcome, loss=self._loss)
            state = "evaluating" if self._phase in ("evaluating", "promoting") else "training"
            return RunnerStatus(state, self._run_id, target, self.last_outcome, self._phase, self._progress,
                                self._loss)

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
            self._run_id, self._phase, self._progress = run_id, "starting", 0.0
            self._thread = threading.Thread(target=self._run, args=(run_id, target, entries, reason, train_draft,
                                                                    config_cls), name=f"train-{run_id}", daemon=True)
            self._thread.start()
        log.info("training run %s started on %d chunks (%d tokens) of %s: %s", run_id, len(entries), tokens, target,
                 reason or "no reason given")
        return TriggerResult(True, run_id, f"training on {len(entries)} chunks ({tokens} tokens)")

    def _set_phase(self, phase: str, progress: float) -> None:
        with self._lock:
            self._phase, self._progress = phase, progress

    def _run(self, run_id: str, target: str, entries: list[ManifestEntry], reason: str, train_draft,
             config_cls) -> None:
        try:
            r = self.cycle.run(run_id, target, entries, reason, train_draft, config_cls, self._set_phase)
            outcome, result, loss = r.outcome, r.result, r.loss
        except Exception as e:  # a bug in the cycle: still a reported, failed run
            log.exception("training run %s failed", run_id)
            outcome = TrainingOutcome(run_id, target, detail=f"failed: {type(e).__name__}: {e}",
                                      finished_unix_s=time.time())
            result, loss = FAILED, 0.0
        with self._lock:
            self.last_outcome, self._run_id, self._phase, self._progress = outcome, "", "", 0.0
            self._loss = loss or self._loss
            st = self.stats
            st.results[result] += 1
            st.seconds += outcome.duration_s
            st.consecutive_failures = st.consecutive_failures + 1 if result == FAILED else 0
            if outcome.eval_accept_length_candidate:
                st.last_candidate, st.last_base = (outcome.eval_accept_length_candidate,
                                                   outcome.eval_accept_length_base)
        log.info("training run %s %s in %.1f s: %s", run_id, result, outcome.duration_s, outcome.detail)
        release_free_memory()  # the run's data and model are freed: their pages leave the idle trainer's RSS
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
