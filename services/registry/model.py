"""Registry domain model: draft manifests, the per-target pointer state and its pure transitions.

Vocabulary (the proto's, `protos/tide/v1/registry.proto`):

- A **version** is an immutable draft: its manifest (files with SHA-256 and size, eval metrics,
  provenance, parent, creation time, a summary of its config) never changes once written. Ids are
  `<target>/v<NNNN>`, allocated per target, strictly increasing (gaps are possible when a
  registration fails after allocation).
- **current** is the promoted version. **pinned** overrides it until unpinned. **effective** =
  pinned if set, else current: the version workers must run (what the issue calls "current").
- **previous** holds the versions that were current before, most recent first, without
  duplicates and never containing `current`. **history** is the audit trail of pointer events.
- Every change bumps **generation** by exactly one and appends exactly one event (which carries
  that generation), so the history is a serial log: replaying its events from the empty state
  reproduces the pointer (checked by the concurrency tests).

Transitions (pure functions of the state; the store applies them with conditional writes):

- `promote(v)`: current := v; the old current goes onto previous. Does not touch a pin (the
  promotion takes effect on unpin). Promoting the current version again is a no-op (`NoChange`).
  With `expected_current`, refuses (FAILED_PRECONDITION) unless current still equals it.
- `pin(v)`: pinned := v (no-op if already pinned to v). `unpin()`: pinned := "" (no-op if none).
- `rollback(to="")`: current := previous[0], dropped from previous; the version rolled back
  from is not kept in previous (so two rollbacks go two steps back, not back and forth). With
  `to`, returns to that entry of previous and drops the more recent entries. FAILED_PRECONDITION
  when previous is empty or `to` is not in it (use promote for a version that was never current).
  A pin stays in force (an operator's pin outranks an automatic rollback); the event records why.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

HISTORY_LIMIT = 200  # events kept in the pointer object, most recent first
PREVIOUS_LIMIT = 50  # rollback depth
DRAFTERS = ("eagle3",)
REQUIRED_FILES = ("config.json", "model.safetensors")

_TARGET_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")
# Versions are numbered from 1 with at least 4 digits; 9 digits bound the number (a 5,000-digit
# "version" must be refused as malformed, not reach int() and fail as an internal error).
_VERSION_RE = re.compile(r"(?P<target>.+)/v(?P<n>[0-9]{4,9})")
_FILE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_SHA_RE = re.compile(r"[0-9a-f]{64}")


class RegistryError(Exception):
    """Base of the errors the API maps to a status code; the message is safe to show callers."""


class InvalidArgument(RegistryError):
    """Malformed request or checkpoint, checksum mismatch, version of another target."""


class NotFound(RegistryError):
    """Unknown version."""


class FailedPrecondition(RegistryError):
    """The pointer is not in a state that allows the change (nothing to roll back to, stale expectation)."""


class NoChange(Exception):
    """Raised by a transition whose result equals its input (nothing is written)."""

    def __init__(self, state: PointerState):
        super().__init__("no change")
        self.state = state


def check_target(target: str) -> str:
    if not target:
        raise InvalidArgument("target_model is required")
    if len(target) > 128 or not _TARGET_RE.fullmatch(target):
        raise InvalidArgument(f"invalid target_model {target!r}: use letters, digits, '.', '_', '-' (and '/')")
    return target


def version_id(target: str, n: int) -> str:
    return f"{target}/v{n:04d}"


def parse_version(version: str) -> tuple[str, int]:
    """(target, number) of a version id; InvalidArgument if it is not shaped like one."""
    m = _VERSION_RE.fullmatch(version or "")
    if not m:
        raise InvalidArgument(f"invalid version {version!r}: expected '<target>/v<NNNN>'")
    return check_target(m["target"]), int(m["n"])


# --------------------------------------------------------------------------------- manifests


@dataclass(frozen=True)
class FileEntry:
    name: str
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class Artifact:
    """s3://bucket/prefix/<name> for each file."""

    bucket: str
    prefix: str
    files: tuple[FileEntry, ...]

    def check(self) -> None:
        """InvalidArgument unless the file list is well formed and has the checkpoint's files."""
        if not self.bucket or not self.prefix or self.prefix.endswith("/"):
            raise InvalidArgument("artifact needs a bucket and a prefix without trailing '/'")
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"artifact lists a file twice: {sorted(names)}")
        for f in self.files:
            if not _FILE_RE.fullmatch(f.name) or len(f.name) > 128:
                raise InvalidArgument(f"invalid file name {f.name!r} (a plain name inside the checkpoint directory)")
            if not _SHA_RE.fullmatch(f.sha256):
                raise InvalidArgument(f"{f.name}: sha256 must be 64 lowercase hex digits, got {f.sha256!r}")
        missing = [n for n in REQUIRED_FILES if n not in names]
        if missing:
            raise InvalidArgument(f"artifact lacks {missing}: a draft checkpoint needs {list(REQUIRED_FILES)}")

    def to_json(self) -> dict[str, Any]:
        files = [{"name": f.name, "sha256": f.sha256, "size_bytes": f.size_bytes} for f in self.files]
        return {"bucket": self.bucket, "prefix": self.prefix, "files": files}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Artifact:
        files = tuple(FileEntry(f["name"], f["sha256"], int(f["size_bytes"])) for f in d["files"])
        return cls(d["bucket"], d["prefix"], files)


@dataclass(frozen=True)
class DraftManifest:
    """One immutable draft version."""

    version: str
    target_model: str
    artifact: Artifact
    content_digest: str  # tide.registry_client.artifact_digest(files): identifies the bytes
    eval_metrics: dict[str, float] = field(default_factory=dict)
    provenance_json: str = ""
    parent_version: str = ""
    drafter: str = "eagle3"
    created_unix_s: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)  # compatibility summary, see store.config_summary

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "artifact"}
        return {**d, "artifact": self.artifact.to_json(), "format_version": 1}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DraftManifest:
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**{**d, "artifact": Artifact.from_json(d["artifact"])})


def check_metrics(metrics: dict[str, float]) -> dict[str, float]:
    bad = sorted(k for k, v in metrics.items() if not k or not math.isfinite(v))
    if bad:
        raise InvalidArgument(f"eval_metrics must be finite numbers with non-empty names: {bad}")
    return dict(metrics)


# ----------------------------------------------------------------------------------- pointer


@dataclass(frozen=True)
class PointerEvent:
    action: str  # "promote" | "pin" | "unpin" | "rollback"
    from_version: str
    to_version: str
    reason: str
    actor: str
    time_unix_s: float
    generation: int  # the generation this event produced


@dataclass(frozen=True)
class PointerState:
    target_model: str
    current: str = ""
    pinned: str = ""
    previous: tuple[str, ...] = ()
    history: tuple[PointerEvent, ...] = ()  # most recent first
    generation: int = 0

    @property
    def effective(self) -> str:
        return self.pinned or self.current

    def to_json(self) -> dict[str, Any]:
        return {
            "target_model": self.target_model,
            "current": self.current,
            "pinned": self.pinned,
            "previous": list(self.previous),
            "history": [e.__dict__ for e in self.history],
            "generation": self.generation,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PointerState:
        return cls(
            target_model=d["target_model"],
            current=d.get("current", ""),
            pinned=d.get("pinned", ""),
            previous=tuple(d.get("previous", ())),
            history=tuple(PointerEvent(**e) for e in d.get("history", ())),
            generation=int(d.get("generation", 0)),
        )


def _next(
    state: PointerState, action: str, frm: str, to: str, reason: str, actor: str, now: float, **changes: Any
) -> PointerState:
    gen = state.generation + 1
    event = PointerEvent(action, frm, to, reason, actor, now, gen)
    return replace(state, **changes, history=(event, *state.history)[:HISTORY_LIMIT], generation=gen)


def _check_current(state: PointerState, expected_current: str | None) -> None:
    """Optimistic concurrency of promote/rollback: refuse unless `current` is still the expected one."""
    if expected_current is not None and state.current != expected_current:
        raise FailedPrecondition(
            f"current draft of {state.target_model} is {state.current or 'none'!r}, not {expected_current!r}"
        )


def promote(
    state: PointerState, version: str, reason: str, actor: str, now: float, expected_current: str | None = None
) -> PointerState:
    _check_current(state, expected_current)
    if version == state.current:
        raise NoChange(state)
    previous = tuple(v for v in ((state.current,) if state.current else ()) + state.previous if v != version)
    return _next(
        state,
        "promote",
        state.current,
        version,
        reason,
        actor,
        now,
        current=version,
        previous=previous[:PREVIOUS_LIMIT],
    )


def pin(state: PointerState, version: str, reason: str, actor: str, now: float) -> PointerState:
    if version == state.pinned:
        raise NoChange(state)
    return _next(state, "pin", state.effective, version, reason, actor, now, pinned=version)


def unpin(state: PointerState, reason: str, actor: str, now: float) -> PointerState:
    if not state.pinned:
        raise NoChange(state)
    return _next(state, "unpin", state.pinned, state.current, reason, actor, now, pinned="")


def rollback(
    state: PointerState, reason: str, actor: str, now: float, to_version: str = "", expected_current: str | None = None
) -> PointerState:
    _check_current(state, expected_current)
    if not state.previous:
        raise FailedPrecondition(f"{state.target_model} has no previous draft to roll back to")
    target = to_version or state.previous[0]
    if target not in state.previous:
        raise FailedPrecondition(
            f"{target!r} was not a previous current draft of {state.target_model} "
            f"(previous: {list(state.previous)}); promote it instead"
        )
    rest = state.previous[state.previous.index(target) + 1 :]
    return _next(state, "rollback", state.current, target, reason, actor, now, current=target, previous=rest)


def replay(target: str, events: list[PointerEvent]) -> PointerState:
    """The state that applying `events` (oldest first) serially to an empty pointer produces."""
    state = PointerState(target)
    for e in events:
        if e.action == "promote":
            state = promote(state, e.to_version, e.reason, e.actor, e.time_unix_s)
        elif e.action == "pin":
            state = pin(state, e.to_version, e.reason, e.actor, e.time_unix_s)
        elif e.action == "unpin":
            state = unpin(state, e.reason, e.actor, e.time_unix_s)
        elif e.action == "rollback":
            state = rollback(state, e.reason, e.actor, e.time_unix_s, e.to_version)
        else:
            raise ValueError(f"unknown pointer action {e.action!r}")
    return state
