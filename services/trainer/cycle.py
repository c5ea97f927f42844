"""One training run end to end, no gRPC: base draft -> fine-tune -> compare -> register -> promote.

1. Base: the registry's effective version for the target (what the workers run), downloaded and
   verified; no version yet -> from scratch. Registry unreachable -> the run fails before training.
2. Train: `services.trainer.training.train_draft(init=<base checkpoint>)` on the buffered chunks
   (verified again on read) plus a replayed sample of earlier runs' chunks (TIDE_TRAINER_REPLAY
   times the new tokens: rehearsal against forgetting earlier domains); it evaluates the base and
   the candidate on the same held-out chunks. The held-out split is a fixed hash of the chunk id,
   so replayed held-out chunks were never trained on by any version and the comparison spans every
   domain collected so far, not only the newest.
3. Compare on the served accept length at TIDE_TRAINER_EVAL_GAMMA (promotion.py).
4. Register the candidate with its metrics and provenance (parent = the base version).
5. Promote when it beats the base by TIDE_TRAINER_PROMOTE_MARGIN and auto-promotion is on, only if
   the current draft did not change meanwhile (optimistic concurrency).
6. Record the run in the manifest (its chunks stop being buffered).

A run that fails before the candidate is registered records nothing: its chunks stay buffered for
the next one. A registered candidate whose promotion fails is still recorded (promote it by hand).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from minio import Minio
from minio.error import S3Error

from services.trainer.drafts import BaseDraft, DraftRegistry, PointerMoved, RegistryError
from services.trainer.governance import Policy
from services.trainer.manifest import Manifest, ManifestEntry
from services.trainer.memory_budget import DEFAULT_BUDGET_SHARE, MiB, RunMemory, run_memory, take_within
from services.trainer.promotion import NO_DRAFT, decide, served_at, step_costs
from services.trainer.settings import TrainerSettings
from services.trainer.training.data import is_heldout
from tide import blobs
from tide.datakeys import Keyring, Unauthentic
from tide.memory import available_bytes
from tide.outcomes import TrainingOutcome

log = logging.getLogger(__name__)

PROMOTED, REGISTERED, FAILED = "promoted", "registered", "failed"  # a run's result
# The registry refuses a provenance_json longer than 4096 characters (its limit on every string
# field). The chunk ids go in while they fit this budget; the full lists are in the run record
# (`run_record`, S3). A cap of 1000 ids (~40 characters each) failed registration outright once a
# run trained on ~100 chunks.
MAX_PROVENANCE_CHARS = 3800


@dataclass(frozen=True)
class RunResult:
    outcome: TrainingOutcome
    result: str  # PROMOTED | REGISTERED | FAILED
    loss: float = 0.0  # last training loss (0 when the run did not train)


Phase = Callable[[str, float], None]  # (phase, progress in [0, 1])


class TrainingCycle:
    def __init__(self, settings: TrainerSettings, s3: Minio, manifest: Manifest, registry: DraftRegistry,
                 keyring: Keyring | None = None, policy: Policy | None = None) -> None:
        self.settings, self.s3, self.manifest, self.registry = settings, s3, manifest, registry
        self.keyring = keyring if keyring is not None else Keyring.empty()  # opens sealed chunk blobs
        self.policy = policy  # the retention policy in force, for the drafts' provenance
        self.quarantined = 0  # sealed blobs that failed authentication when a run read them (skipped)

    def run(self, run_id: str, target: str, entries: list[ManifestEntry], reason: str, train_draft, config_cls,
            phase: Phase = lambda name, progress: None) -> RunResult:
        s, t0 = self.settings, time.monotonic()
        stay = f"the {len(entries)} chunks stay buffered"

        def finish(result: str, loss: float = 0.0, **fields) -> RunResult:
            outcome = TrainingOutcome(run_id, target, duration_s=time.monotonic() - t0, finished_unix_s=time.time(),
                                      **fields)
            return RunResult(outcome, result, loss)

        phase("base", 0.0)
        try:
            base = self.registry.base(target)
        except RegistryError as e:
            log.error("training run %s not started: %s", run_id, e)
            return finish(FAILED, detail=f"failed: {e}; nothing trained, {stay}")
        log.info("training run %s: %s", run_id, f"fine-tuning {base.version}" if base.version else "from scratch")

        memory = self._run_memory()
        budget, source = self._memory_budget()
        allowed = memory.max_tokens(budget)
        # the new chunks and their replay share within the budget; the rest stay buffered for the next run
        taken = take_within(entries, int(allowed / (1 + s.replay)))
        if not taken:
            detail = (f"not started: a run of this target needs {memory.describe()}, more than the memory budget "
                      f"of {budget / MiB:.0f} MiB ({source}) leaves for its oldest chunk; raise "
                      f"TIDE_TRAINER_MEMORY_MB; {stay}")
            log.error("training run %s %s", run_id, detail)
            return finish(FAILED, base_version=base.version, detail=detail)
        if len(taken) < len(entries):
            log.info("training run %s: %d of %d buffered chunks fit the memory budget of %.0f MiB (%s: %s); the "
                     "rest stay buffered", run_id, len(taken), len(entries), budget / MiB, source, memory.describe())
        entries = taken

        phase("training", 0.1)
        out_dir = Path(s.work_dir) / "runs" / run_id / "draft"
        new_tokens = sum(e.num_tokens for e in entries)
        replay = self.manifest.replay_sample(target, int(s.replay * new_tokens), seed=run_id,
                                             recent_share=s.replay_recent) if s.replay else []
        if replay:
            log.info("training run %s: %d new chunks (%d tokens) + %d replayed (%d tokens)", run_id, len(entries),
                     new_tokens, len(replay), sum(e.num_tokens for e in replay))
        # earlier runs' held-out chunks join the eval set (the same hash holds them out again), so a
        # candidate is judged on more than its own cycle's tenth: 600 tokens of a small cycle judged
        # two better candidates "no gain" (docs/results/horizon, one client)
        replayed = {e.chunk_id for e in replay}
        history_room = min(s.eval_history_tokens, allowed - new_tokens - sum(e.num_tokens for e in replay))
        history_eval = [e for e in self.manifest.heldout_history(
            target, history_room, lambda cid: is_heldout(cid, s.eval_fraction, s.seed))
            if e.chunk_id not in replayed] if history_room > 0 else []
        if history_eval:
            log.info("training run %s: %d earlier held-out chunks (%d tokens) added to the eval set", run_id,
                     len(history_eval), sum(e.num_tokens for e in history_eval))
        try:
            cfg = config_cls(steps=s.steps or None, epochs=s.epochs, max_epochs=s.max_epochs or None,
                             batch_rows=s.batch_rows, max_len=s.max_len, lr=s.lr,
                             warmup_steps=s.warmup_steps, device=s.device, seed=s.seed, progress=False)
            summary = train_draft(s.target, self._blobs(entries, replay + history_eval), out_dir, init=base.path,
                                  cfg=cfg,
                                  draft_vocab_size=s.draft_vocab, eval_fraction=s.eval_fraction,
                                  expected_target=target)
        except Exception as e:
            log.exception("training run %s failed", run_id)
            return finish(FAILED, base_version=base.version, detail=f"failed: training: {type(e).__name__}: {e}; "
                                                                    f"{stay}")
        loss = float((summary["train"].get("last") or {}).get("loss", 0.0))

        phase("evaluating", 0.8)
        candidate = served_at(summary.get("candidate"), s.eval_gamma)
        base_served = served_at(summary.get("baseline"), s.eval_gamma) if base.version else NO_DRAFT
        costs = step_costs(s.latency_profile, target)
        decision = decide(run_id, candidate, base_served, base.version, gamma=s.eval_gamma, margin=s.promote_margin,
                          auto_promote=s.auto_promote, costs=costs)
        numbers = dict(base_version=base.version, eval_accept_length_candidate=candidate or 0.0,
                       eval_accept_length_base=base_served or 0.0, train_tokens=int(summary["train"]["tokens"]),
                       eval_tokens=int((summary.get("candidate") or {}).get("tokens", 0)))
        try:
            version = self.registry.register(target, out_dir, eval_metrics=self._metrics(summary, candidate,
                                                                                         base_served),
                                             provenance=self._provenance(run_id, reason, base, entries, replay,
                                                                         summary),
                                             parent_version=base.version)
        except RegistryError as e:
            log.error("training run %s: candidate not registered: %s", run_id, e)
            return finish(FAILED, loss, **numbers, detail=f"failed: {e}; {stay}")
        log.info("training run %s: candidate registered as %s", run_id, version)

        promoted = False
        if decision.promote:
            phase("promoting", 0.9)
            try:
                self.registry.promote(target, version, f"trainer {decision.reason}", expected_current=base.current)
                promoted = True
                pinned = f" (the target is pinned to {base.version}: workers run it until unpinned)" \
                    if base.pinned else ""
                detail = f"promoted {version}{pinned}: {decision.reason}"
            except PointerMoved as e:
                detail = f"registered {version}, not promoted: the current draft changed during the run ({e}); " \
                         f"{decision.reason}"
            except RegistryError as e:
                detail = f"registered {version}, promotion failed ({e}); {decision.reason}"
        else:
            detail = f"registered {version}; {decision.reason}"
        log.info("training run %s: %s", run_id, detail)
        result = finish(PROMOTED if promoted else REGISTERED, loss, **numbers, candidate_version=version,
                        promoted=promoted, detail=detail)
        try:
            self.manifest.record_run(target, run_id, entries,
                                     {"reason": reason, "replayed_chunk_ids": [e.chunk_id for e in replay],
                                      "outcome": dataclasses.asdict(result.outcome),
                                      "result": result.result, "out_dir": str(out_dir), "train": summary["train"],
                                      "baseline": summary.get("baseline"), "candidate": summary.get("candidate")})
        except Exception as e:  # the candidate exists; only the bookkeeping of its chunks is lost
            log.exception("training run %s: run record not written", run_id)
            result = dataclasses.replace(result, outcome=dataclasses.replace(
                result.outcome, detail=f"{detail} (run record not written: {type(e).__name__}: {e})"))
        return result

    def _run_memory(self) -> RunMemory:
        """What a run of this target holds (memory_budget.run_memory), from the target's config."""
        from tide.target import resolve_target

        s = self.settings
        return run_memory(resolve_target(s.target).config, s.draft_vocab, s.batch_rows, s.max_len)

    def _memory_budget(self) -> tuple[int, str]:
        """(bytes a run may hold, where the number came from): TIDE_TRAINER_MEMORY_MB, else half of
        the memory available now (the worker's weights and KV cache are allocated by then)."""
        if self.settings.memory_mb is not None:
            return self.settings.memory_mb * MiB, "TIDE_TRAINER_MEMORY_MB"
        found = available_bytes()
        if found is None:
            return 1 << 62, "available memory unknown"
        return int(found[0] * DEFAULT_BUDGET_SHARE), f"{DEFAULT_BUDGET_SHARE:.0%} of {found[0] / MiB:.0f} MiB available"

    def _blobs(self, entries: list[ManifestEntry], replay: list[ManifestEntry] = ()) -> Iterator[bytes]:
        """The chunks' blobs, verified again (one that went bad since intake is skipped, not trained
        on), then the replayed ones (one that storage no longer has, e.g. expired, is skipped too)."""
        for e in entries:
            try:  # opened here: the training library decodes plaintext (a sealed blob failing: never trained on)
                yield self.keyring.open(blobs.get_bytes(self.s3, e.bucket, e.key, expected_sha256=e.sha256))
            except (blobs.ChecksumMismatch, S3Error, Unauthentic) as err:  # S3Error: deleted meanwhile (forget)
                self.quarantined += isinstance(err, Unauthentic)
                log.error("skipping chunk %s: %s", e.chunk_id, err)
        for e in replay:
            try:
                yield self.keyring.open(blobs.get_bytes(self.s3, e.bucket, e.key, expected_sha256=e.sha256))
            except (blobs.ChecksumMismatch, S3Error, Unauthentic) as err:
                self.quarantined += isinstance(err, Unauthentic)
                log.warning("not replaying chunk %s: %s", e.chunk_id, err)

    def _data_provenance(self, entries: list[ManifestEntry], replay: list[ManifestEntry]) -> dict:
        """What traffic trained the draft (its card: `tidectl drafts show VERSION`): when it was
        collected, how many requests and tokens (new chunks and replayed ones), the retention
        policy in force. Request ids themselves stay out of the card (they are in the manifest)."""
        everything = list(entries) + list(replay)
        requests = {re.sub(r"-\d+$", "", r) for e in everything for r in e.request_ids}  # choices: one request
        return {**_span(everything), "requests": len(requests), "tokens": sum(e.num_tokens for e in everything),
                "new_tokens": sum(e.num_tokens for e in entries), "replayed_tokens": sum(e.num_tokens for e in replay),
                "api_keys": len({k for e in everything for k in e.key_ids if k}),
                "encrypted": all(e.data_key_id for e in everything) if everything else False,
                "retention": self.policy.describe() if self.policy is not None else None}

    def _metrics(self, summary: dict, candidate: float | None, base: float | None) -> dict[str, float]:
        ev = summary.get("candidate") or {}
        m = {"accept_length": candidate, "accept_length_base": base,
             "accept_length_gain": None if candidate is None or base is None else candidate - base,
             "eval_gamma": self.settings.eval_gamma,
             "acceptance_all_rows": (ev.get("acceptance") or {}).get(str(self.settings.eval_gamma)),
             "coverage": ev.get("coverage"), "eval_tokens": ev.get("tokens"),
             "train_tokens": summary["train"]["tokens"], "train_steps": summary["train"]["steps"]}
        return {k: float(v) for k, v in m.items() if v is not None and math.isfinite(float(v))}

    def _provenance(self, run_id: str, reason: str, base: BaseDraft, entries: list[ManifestEntry],
                    replay: list[ManifestEntry], summary: dict) -> dict:
        s, ids = self.settings, [e.chunk_id for e in entries]
        target = entries[0].target_model if entries else ""
        doc = {
            "run_id": run_id, "reason": reason, "trainer": s.consumer, "parent_version": base.version,
            "base_version": base.version, "base_pinned": base.pinned,
            "run_record": f"s3://{self.manifest.bucket}/{self.manifest.run_key(target, run_id)}",
            "chunk_count": len(ids), "chunk_ids": [], "replayed_chunk_count": len(replay),
            "chunk_ids_truncated": False, "eval_chunk_ids": [], "eval_chunk_ids_truncated": False,
            "train": {"tokens": summary["train"]["tokens"], "steps": summary["train"]["steps"],
                      "seconds": summary["train"]["seconds"]},
            "data": self._data_provenance(entries, replay),
            "config": {"steps": s.steps, "epochs": s.epochs, "batch_rows": s.batch_rows, "max_len": s.max_len,
                       "lr": s.lr, "warmup_steps": s.warmup_steps, "seed": s.seed, "draft_vocab": s.draft_vocab,
                       "eval_fraction": s.eval_fraction, "replay": s.replay, "replay_recent": s.replay_recent,
                       "max_epochs": s.max_epochs, "eval_gamma": s.eval_gamma,
                       "promote_margin": s.promote_margin, "auto_promote": s.auto_promote, "device": s.device},
        }
        return _with_ids(doc, {"chunk_ids": ids, "eval_chunk_ids": list(summary.get("eval_chunk_ids", []))})


def _span(entries) -> dict:
    times = [e.created_unix_s for e in entries]
    return {"first_collected_unix_s": min(times) if times else None,
            "last_collected_unix_s": max(times) if times else None}


def _with_ids(doc: dict, lists: dict[str, list[str]]) -> dict:
    """`doc` with each list of ids under its key, as many ids as keep its JSON within
    MAX_PROVENANCE_CHARS (in the order given); `<key>_truncated` says where some were left out."""
    for key in lists:  # every key and flag in place first, so `room` counts them
        doc[key], doc[f"{key}_truncated"] = [], False
    room = MAX_PROVENANCE_CHARS - len(json.dumps(doc))
    for key, ids in lists.items():
        kept = []
        for cid in ids:
            cost = len(json.dumps(cid)) + 2  # the quoted id and ", "
            if cost > room:
                break
            kept.append(cid)
            room -= cost
        doc[key], doc[f"{key}_truncated"] = kept, len(kept) < len(ids)
    return doc
