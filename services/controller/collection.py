"""Selective collection (TIDE Algorithm 1), per target: when workers should store hidden states for
training. Pure domain code (no gRPC, no Redis); the controller feeds it statistics and outcomes.

Mode `auto` (the default):

- undecided at first: no telemetry of the target yet, or the serving draft version has fewer than
  `min_observations` verifications. Collection is then left to the workers (decision field unset).
- ON "cold start": no draft version serving (an n-gram or no drafter: draft version ""), or the
  serving version's long-horizon acceptance rate per drafted token is below the break-even rate
  of the γ policy (tide.policies.costs.StepCosts.break_even_rate, from the workers' latency
  profile: 0.19 on the reference CPU): a draft that does not pay at any γ is weak.
- ON "shift detected": the serving version's short EMA of the acceptance rate per checked draft
  token is below its long EMA by more than `shift_epsilon`, continuously for `shift_hold_s`
  (stats.py: the rate does not move with γ, so the adaptive policy's γ changes and probes do not
  read as shifts. The accept length would: at a per-token acceptance of 0.5 it is 1.875 at γ = 3
  and 1.5 at γ = 1, a fall of 0.375, and in `bench adapt` (docs/results/adapt) collection that had gone off for no gain
  came straight back on. A short EMA over 50 verifications also dips for a few seconds of hard
  prompts: in the quick horizon run such dips re-opened collection twice within 30 s of a no-gain).
- ON "learning the traffic" (`learn`, the default): judged, neither cold nor shifted, and collection
  has not yet gone off for no gain on this target. A draft trained offline on other text has never
  seen this deployment's traffic; a drop in acceptance (a shift) cannot show that, since the EMAs
  start on the new traffic, yet fine-tuning on it is what the loop is for (issue 34: a chat draft
  serving GSM8K for the whole horizon pays, so it is not cold, and shows no shift). The no-gain
  rule below ends it.
- OFF "no shift": judged (enough observations), the draft is good and traffic is stable (without
  `learn`, or once collection has gone off for no gain and the shift condition re-armed).
- Once ON, collection stays on (training runs on the data, a promoted draft keeps serving) until
  the last `no_gain_runs` consecutive training outcomes of the target gained nothing (not promoted,
  or eval accept length improved by less than `gain_margin`) and it has been on for at least
  `min_on_s`: OFF "no gain after training". Two small early cycles that miss the margin are
  noise, not a plateau; the trainer's growing cycles (TIDE_TRAINER_MIN_TOKENS_GROWTH) make later
  verdicts rest on more data.
- That OFF holds until a *later* shift: the shift condition must first clear, then hold again for
  `shift_hold_s` (or a different draft version must serve and be weak, which re-opens cold start:
  a rollback or pin to a draft that does not pay). Without that edge, a shift that training could
  not fix would turn collection straight back on.

The load rule, over all of the above: collection is held OFF ("a draft would not pay at this
load") while the workers' running batch is one at which even a draft accepting `reachable_rate`
per drafted token (or the serving draft's own long-run rate, if higher) would not beat plain
decoding by the γ policy's margin at any γ (StepCosts at that batch, from the workers' latency
profile): a verified row there costs more than it can return, the γ policy does not draft, and
training a better draft buys nothing until the load falls (issue 34: on a 2-vCPU AVX2 CPU at 4
streams a draft needs 0.65 per token at γ = 1; the best draft trained for the reference model
accepts 0.56, and the loop only taxed serving). The condition must hold for `load_hold_s` to take
effect and clear for as long to lift (a lull between requests is not a new load). While it holds,
the state machine above goes on judging; lifted, its state applies again.

Modes `on` / `off` force the state (outcomes are still counted, nothing changes). Every change is
logged with its reason and counted in `changes[(target, reason)]` (Prometheus reads it).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from services.controller.outcomes import TrainingOutcome
from services.controller.stats import DraftStats
from tide.policies.costs import StepCosts

log = logging.getLogger(__name__)

COLD_START = "cold start"
SHIFT = "shift detected"
NO_GAIN = "no gain after training"
NO_SHIFT = "no shift"
LEARN = "learning the traffic"
WAITING = "waiting for telemetry"
LOAD = "a draft would not pay at this load"
LOAD_LIFTED = "load low enough for a draft to pay"
FORCED_ON = "forced on (TIDE_CONTROLLER_COLLECTION=on)"
FORCED_OFF = "forced off (TIDE_CONTROLLER_COLLECTION=off)"


@dataclass(frozen=True)
class CollectionConfig:
    mode: str = "auto"  # auto | on | off
    shift_epsilon: float = 0.15  # acceptance rate per checked draft token (0..1)
    min_observations: int = 50
    no_gain_runs: int = 2
    gain_margin: float = 0.02
    tokens_needed: int = 16384
    learn: bool = True  # collect from the first judgement until training stops gaining (see the module doc)
    min_on_s: float = 300.0  # seconds collection stays on before a no-gain verdict may turn it off
    shift_hold_s: float = 30.0  # seconds the shift condition must hold to turn collection on
    # the load rule (module doc): the acceptance rate per drafted token (0..1) a trained draft could
    # reach; 0 = no load rule. 0.6: above the best the reference model's drafts reached (0.56:
    # accept length 2.08 at γ = 3, the 128k-token bootstrap)
    reachable_rate: float = 0.6
    load_hold_s: float = 60.0  # seconds the load condition must hold (or clear) to take effect


@dataclass(frozen=True)
class Signal:
    """What the telemetry says about a target now."""

    serving_version: str  # draft version of the latest speculative step ("" = no draft)
    draft: DraftStats | None  # statistics of that version (None: no verification seen)
    emitted_tokens: int  # tokens the target emitted so far (all steps)
    batch: float | None = None  # the target's workers' mean running batch (recent window); None = no steps


@dataclass(frozen=True)
class CollectionState:
    enabled: bool | None  # None = undecided (left to the workers)
    reason: str
    since_unix_s: float
    tokens_collected: int  # emitted since collection was last enabled (frozen when it went off)
    tokens_needed: int


@dataclass
class _Target:
    enabled: bool | None
    reason: str
    since: float
    emitted: int = 0
    enabled_at: int | None = None  # emitted tokens when collection was last enabled
    disabled_at: int | None = None  # ... and when it went off after that
    no_gain: int = 0  # consecutive training outcomes without gain
    armed: bool = True  # False after "no gain" until the shift condition clears
    off_version: str = ""  # serving version when collection went off for no gain
    learned: bool = False  # collection has gone off for no gain at least once (the LEARN rule is spent)
    plateau: bool = False  # no_gain_runs non-gains in a row, waiting for min_on_s to pass
    shift_since: float | None = None  # when the shift condition began to hold (continuously)
    load_held: bool = False  # the load rule holds collection off
    load_since: float | None = None  # when the load condition began to differ from load_held (continuously)
    held_since: float = 0.0  # when load_held last changed
    held_at: int = 0  # emitted tokens then


class CollectionControl:
    """Thread-safe state machine over all targets. `break_even(target)`: the acceptance rate per
    drafted token below which drafting does not pay (default: the reference CPU's step costs).
    `pays_at(target, batch, rate)`: whether a draft accepting `rate` per drafted token would pay at
    that running batch (the load rule; None: no load rule)."""

    def __init__(self, config: CollectionConfig | None = None,
                 break_even: Callable[[str], float] | None = None,
                 pays_at: Callable[[str, float, float], bool] | None = None) -> None:
        self.config = config or CollectionConfig()
        self.break_even = break_even or (lambda _target: StepCosts().break_even_rate())
        self.pays_at = pays_at
        if self.config.mode not in ("auto", "on", "off"):
            raise ValueError(f"collection mode must be auto, on or off, got {self.config.mode!r}")
        self.changes: Counter[tuple[str, str]] = Counter()
        self._targets: dict[str, _Target] = {}
        self._lock = threading.Lock()

    # ---- reads

    def state(self, target: str) -> CollectionState | None:
        with self._lock:
            t = self._targets.get(target)
            if t is None:
                return None
            collected = 0
            if t.enabled_at is not None:
                end = t.emitted if t.enabled else (t.disabled_at or t.enabled_at)
                if self._held(t):  # nothing collected since the load rule held it off
                    end = min(end, t.held_at)
                collected = end - t.enabled_at
            enabled, reason, since = (False, LOAD, t.held_since) if self._held(t) else (t.enabled, t.reason, t.since)
            return CollectionState(enabled, reason, since, max(collected, 0), self.config.tokens_needed)

    def targets(self) -> list[str]:
        with self._lock:
            return sorted(self._targets)

    def change_counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self.changes)

    # ---- inputs

    def evaluate(self, target: str, sig: Signal, now: float) -> bool:
        """Apply the latest statistics; True when the state (on / off / undecided) changed."""
        cfg = self.config
        with self._lock:
            t = self._targets.get(target)
            if t is None:
                t = self._targets[target] = _Target(None, WAITING, now)
            t.emitted = sig.emitted_tokens
            if cfg.mode != "auto":
                forced = cfg.mode == "on"
                if t.enabled is forced:
                    return False
                return self._set(target, t, forced, FORCED_ON if forced else FORCED_OFF, now)
            before = False if self._held(t) else t.enabled
            self._judge(target, t, sig, now)
            self._load_rule(target, t, sig, now)
            return (False if self._held(t) else t.enabled) != before

    def _judge(self, target: str, t: _Target, sig: Signal, now: float) -> bool:
        """The state machine of the module doc (the load rule aside), lock held."""
        cfg = self.config
        if t.enabled:  # on until training stops helping, and for min_on_s at least
            if t.plateau and now - t.since >= cfg.min_on_s:
                return self._off_for_no_gain(target, t, now)
            return False
        cold, shifted, judged = self._conditions(target, sig)
        t.shift_since = (t.shift_since if t.shift_since is not None else now) if shifted else None
        shift = shifted and now - t.shift_since >= cfg.shift_hold_s
        if t.enabled is False and t.reason == NO_GAIN:
            if not t.armed:
                t.armed = not shifted
                return False
            if shift:
                return self._set(target, t, True, SHIFT, now)
            if cold and sig.serving_version != t.off_version:
                return self._set(target, t, True, COLD_START, now)
            return False
        if cold:
            return self._set(target, t, True, COLD_START, now)
        if shift:
            return self._set(target, t, True, SHIFT, now)
        if judged and cfg.learn and not t.learned:
            return self._set(target, t, True, LEARN, now)
        if judged:
            return self._set(target, t, False, NO_SHIFT, now)
        if sig.serving_version and t.enabled is None:
            t.reason = f"waiting for {cfg.min_observations} verifications of {sig.serving_version}"
        return False

    def on_outcome(self, outcome: TrainingOutcome, serving_version: str, now: float) -> bool:
        """Count a (new) training outcome; True when it turned collection off."""
        cfg = self.config
        gained = outcome.promoted and (
            outcome.eval_accept_length_candidate - outcome.eval_accept_length_base >= cfg.gain_margin)
        with self._lock:
            t = self._targets.setdefault(outcome.target_model, _Target(None, WAITING, now))
            if gained:
                t.no_gain, t.plateau = 0, False
                return False
            t.no_gain += 1
            log.info("training run %s of %s gained nothing (%d in a row)", outcome.run_id, outcome.target_model,
                     t.no_gain)
            if cfg.mode != "auto" or t.no_gain < cfg.no_gain_runs:
                return False
            t.no_gain, t.off_version = 0, serving_version
            if t.enabled is False and t.reason == NO_GAIN:
                t.armed = False
                return False
            if t.enabled and now - t.since < cfg.min_on_s:  # too early to call it a plateau: evaluate() will
                t.plateau = True
                log.info("collection for %s stays on until %.0f s after it opened (min_on_s) unless a run gains",
                         outcome.target_model, cfg.min_on_s)
                return False
            return self._off_for_no_gain(outcome.target_model, t, now)

    # ---- internals

    def _held(self, t: _Target) -> bool:
        """The load rule holds collection off (where the state machine would not be off anyway)."""
        return t.load_held and t.enabled is not False

    def _load_rule(self, target: str, t: _Target, sig: Signal, now: float) -> None:
        """Hold or lift the load rule once its condition has held or cleared for `load_hold_s`."""
        cfg, d = self.config, sig.draft
        condition = False
        if self.pays_at is not None and cfg.reachable_rate > 0 and sig.batch is not None:
            own = d.rate_long.value if d is not None and d.verify_steps >= cfg.min_observations else 0.0
            condition = not self.pays_at(target, sig.batch, max(cfg.reachable_rate, own))
        if condition == t.load_held:
            t.load_since = None
            return
        t.load_since = t.load_since if t.load_since is not None else now
        if now - t.load_since < cfg.load_hold_s:
            return
        t.load_held, t.load_since, t.held_since, t.held_at = condition, None, now, t.emitted
        reason = LOAD if condition else LOAD_LIFTED
        self.changes[(target, reason)] += 1
        log.info("collection for %s %s: %s (mean running batch %.1f)", target,
                 "held off" if condition else "no longer held off", reason, sig.batch or 0.0,
                 extra={"target_model": target, "collection_enabled": False if condition else t.enabled,
                        "reason": reason})

    def _off_for_no_gain(self, target: str, t: _Target, now: float) -> bool:
        t.plateau, t.armed, t.learned = False, False, True
        return self._set(target, t, False, NO_GAIN, now)

    def _conditions(self, target: str, sig: Signal) -> tuple[bool, bool, bool]:
        """(cold start, shift condition now, judged): judged = the serving version has enough
        observations; cold = its long acceptance rate is below break-even (module doc)."""
        cfg, d = self.config, sig.draft
        if not sig.serving_version:
            return sig.emitted_tokens > 0 or d is not None, False, False  # telemetry without a draft
        judged = d is not None and d.verify_steps >= cfg.min_observations
        if not judged:
            return False, False, False
        cold = d.rate_long.value < self.break_even(target)
        return cold, d.rate_short.value < d.rate_long.value - cfg.shift_epsilon, True

    def _set(self, target: str, t: _Target, enabled: bool, reason: str, now: float) -> bool:
        if (t.enabled, t.reason) == (enabled, reason):  # no change: no log line, no count, same `since`
            return False
        before = t.enabled
        t.enabled, t.reason, t.since = enabled, reason, now
        t.plateau, t.shift_since = False, None
        if enabled:
            t.enabled_at, t.disabled_at = t.emitted, None
        elif before:
            t.disabled_at = t.emitted
        self.changes[(target, reason)] += 1
        held = f" (held off: {LOAD})" if self._held(t) else ""
        log.info("collection for %s %s: %s%s", target, "on" if enabled else "off", reason, held,
                 extra={"target_model": target, "collection_enabled": enabled and not held, "reason": reason})
        return before != enabled
