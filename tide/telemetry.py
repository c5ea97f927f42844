"""Per-step telemetry: what one engine step did, as the controller and benchmarks see it.

Defined once here; the inference worker produces these records, the telemetry stream carries
them as JSON (see `tide.streams`), the controller and the policy simulator consume them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

# Sources of draft tokens that take no draft model: a copy of the request's own context (a few
# dictionary probes, microseconds against a draft step's ~2 ms) and a recall from the speculation
# memory (tide.engine.drafters.memory: tens of slice compares). The γ policy prices them at 0 draft
# ms; a draft version's statistics leave them out.
COPY_SOURCES = frozenset({"ngram", "memory"})


@dataclass(frozen=True)
class StepRecord:
    """One engine step (prefill and/or draft+verify) over the running batch.

    Units: times in milliseconds, `time_unix_s` in seconds since the epoch. `gammas[i]` and
    `accepted[i]` belong to `request_ids[i]`; `accepted` counts accepted *draft* tokens (the
    bonus token is not included), so a request's accept length this step is `accepted + 1`.
    """

    worker_id: str
    step: int
    time_unix_s: float
    batch_size: int
    request_ids: list[str]
    gammas: list[int]
    accepted: list[int]
    draft_ms: float
    verify_ms: float
    other_ms: float
    prefill_tokens: int = 0
    drafter: str = "none"
    draft_version: str = ""
    target_model: str = ""
    workload: list[str] = field(default_factory=list)
    # Per request, where its drafts came from when the drafter has several sources (the hybrid:
    # "ngram" for a copy of its context, "eagle3" for the draft's chain); [] when it has one, all
    # `drafter`. A draft version's acceptance is its own tokens', not the copies' (`drafted_by_draft`).
    sources: list[str] = field(default_factory=list)

    @property
    def step_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.other_ms

    @property
    def emitted_tokens(self) -> int:
        """Tokens appended to the requests' outputs by this step's verification."""
        return sum(a + 1 for a in self.accepted)

    def drafted_by_draft(self) -> list[tuple[int, int]]:
        """(γ, accepted) of the requests that drafted this step with the step's drafter itself, not
        a weightless copy beside it: what a draft version's acceptance statistics take."""
        sources = self.sources or [self.drafter] * len(self.gammas)
        return [(g, a) for g, a, s in zip(self.gammas, self.accepted, sources, strict=False)
                if g > 0 and (s == self.drafter or s not in COPY_SOURCES)]

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> StepRecord:
        data = json.loads(text)
        return cls(**data)
