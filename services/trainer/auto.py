"""The automatic trigger (TIDE_TRAINER_AUTO_TRAIN=1): a background loop that starts a training run
whenever the target's buffered tokens reach what a run needs and no run is going. No gRPC.

A run needs TIDE_TRAINER_MIN_TOKENS, or TIDE_TRAINER_MIN_TOKENS_GROWTH x the tokens earlier runs of
the target trained on where that is more: cycles grow with the data. A candidate of the first
2,048 tokens is judged on a few hundred held-out ones; once 100k tokens have been trained on, one
more such cycle moves the draft too little to beat the promotion margin, and two such non-gains
read as a plateau to the controller (collection off) when the draft was still learning.

It looks every TIDE_TRAINER_AUTO_CHECK_S seconds and right after each chunk intake (`wake`). After
a failed run (registry unreachable, ...) its chunks are still buffered, so the next automatic run
waits retry_min_s, doubling per consecutive failure up to retry_max_s, instead of failing in a
tight loop; TriggerTraining is not held back.
"""

from __future__ import annotations

import logging
import threading
import time

from services.trainer.manifest import Manifest
from services.trainer.runs import TrainingRunner, TrainingUnavailable, TriggerResult

log = logging.getLogger(__name__)


class AutoTrigger:
    def __init__(self, runner: TrainingRunner, manifest: Manifest, interval_s: float = 5.0,
                 retry_min_s: float = 30.0, retry_max_s: float = 600.0) -> None:
        self.runner, self.manifest, self.interval_s = runner, manifest, interval_s
        self.retry_min_s, self.retry_max_s = retry_min_s, retry_max_s
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._unavailable = ""  # last TrainingUnavailable message, logged once

    def start(self) -> AutoTrigger:
        self._thread = threading.Thread(target=self._loop, name="auto-train", daemon=True)
        self._thread.start()
        return self

    def wake(self) -> None:
        """Look now (called after each intake)."""
        self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:  # never let the trigger die
                log.exception("automatic training check failed")
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def retry_at(self) -> float:
        """Unix time before which no automatic run starts (0: none pending)."""
        failures, last = self.runner.stats.consecutive_failures, self.runner.last_outcome
        if not failures or last is None:
            return 0.0
        return last.finished_unix_s + min(self.retry_min_s * 2 ** (failures - 1), self.retry_max_s)

    def tokens_needed(self, target: str) -> int:
        """Buffered tokens the next automatic run of `target` waits for (module doc)."""
        s = self.runner.settings
        if s.min_tokens_growth <= 0:
            return s.min_tokens
        trained = sum(e.num_tokens for e in self.manifest.trained(target))
        return max(s.min_tokens, int(s.min_tokens_growth * trained))

    def check(self) -> TriggerResult | None:
        """Start a run when one is due; the trigger's answer, or None when nothing was tried."""
        if self.runner.busy or time.time() < self.retry_at():
            return None
        try:
            target = self.runner.target_model(timeout_s=0)
        except TrainingUnavailable as e:  # not ready yet, or cannot load: look again later
            if str(e) != self._unavailable:
                self._unavailable = str(e)
                log.warning("automatic training waits: %s", e)
            return None
        _, tokens = self.manifest.buffered_totals(target)
        need = self.tokens_needed(target)
        if tokens < need:
            return None
        try:
            r = self.runner.trigger(target, reason=f"auto: {tokens} tokens buffered (>= {need})")
        except TrainingUnavailable as e:
            if str(e) != self._unavailable:
                self._unavailable = str(e)
                log.warning("automatic training cannot start: %s", e)
            return None
        if r.accepted:
            log.info("automatic training run %s started: %s", r.run_id, r.detail)
        return r
