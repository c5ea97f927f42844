"""Registry-driven EAGLE-3 drafts: watch the target's pointer, fetch and load each new version, and
offer it to the worker, which swaps it in between engine steps.

`DraftWatcher` runs two daemon threads:

- watch: `RegistryClient.watch(target)` (no admin token needed); every assignment it yields
  becomes the wanted one (only the latest matters: versions skipped while a load ran are never
  loaded). A registry that is down is retried with backoff; the draft in service keeps serving.
- load: for a wanted version not yet in service and never refused, `fetch_version` (checksummed
  download into `cache_dir`, a cached copy re-hashed first) then `Eagle3Drafter.from_checkpoint`
  against the worker's model, served with prompt lookup (`HybridDrafter`; TIDE_PROMPT_LOOKUP=0:
  the draft alone). An empty version means "no draft": the weightless `fallback`
  (n-gram) takes over. Download failures that a retry can fix (S3 unreachable) are retried with
  backoff; a draft that cannot serve (checksum mismatch, missing file, DraftIncompatible, a
  corrupt or unloadable checkpoint) is *refused*: the drafter in service stays, the refusal is
  logged, counted (`tide_inference_draft_refusals{reason}`) and remembered (`refusals`), and that
  version is never tried again by this process. The worker's GetStatus reports the refusals with
  the version in service and the one the registry wants (`report`), so that the controller can
  move the registry's pointer back to what the worker serves (services/controller/refusals.py).

The drafter named "eagle3" on a worker is whatever `drafter()` returns: the latest loaded draft,
or the fallback until one is. A newly loaded draft is offered to the worker through the `install`
callable given to `attach` (`Worker.offer_drafter("eagle3", ...)`), which swaps it in only while
the worker runs "eagle3". No gRPC server code here; the registry is reached through its client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import grpc
from minio.error import S3Error
from prometheus_client import Counter, Gauge

from tide.blobs import ChecksumMismatch
from tide.eagle3 import DraftIncompatible
from tide.engine.drafters import Drafter, NgramDrafter
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.drafters.hybrid import HybridDrafter
from tide.registry_client import RegistryClient, fetch_version
from tide.resources import one_torch_thread

log = logging.getLogger(__name__)

DRAFTER_NAME = "eagle3"  # the worker's drafter name this module serves

DRAFT_LOADS = Counter("tide_inference_draft_loads", "Registry draft versions loaded (the fallback included)")
DRAFT_REFUSALS = Counter("tide_inference_draft_refusals",
                         "Registry draft versions refused: the drafter in service kept serving", ["reason"])
DRAFT_FETCH_ERRORS = Counter("tide_inference_draft_fetch_errors", "Draft downloads that failed and are retried")
DRAFT_WATCH_ERRORS = Counter("tide_inference_draft_watch_errors", "Registry watch streams that failed fatally")
DRAFT_LOADED_AT = Gauge("tide_inference_draft_loaded_unix_s", "When the draft in service was loaded")

_MISSING = ("NoSuchKey", "NoSuchBucket")


@dataclass(frozen=True)
class Refusal:
    """A version this worker will not run; reason: checksum | missing | incompatible | load_failed."""

    version: str
    reason: str
    detail: str
    at_unix_s: float


@dataclass(frozen=True)
class DraftsReport:
    """What the worker's status says of the registry's drafts (GetStatus): the version in service
    as "eagle3" ("" = the fallback), the effective version as last heard from the registry ("" =
    none, or not heard yet) and the refusals, oldest first. The controller compares them with the
    registry's pointer."""

    version: str
    wanted: str
    refusals: tuple[Refusal, ...]


class _Refused(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class DraftWatcher:
    """Keeps "eagle3" = the registry's effective version for `target_model` (see the module doc).

    `model` is the worker's engine LlamaModel; `max_batch`/`max_len` size the draft's KV cache
    (the engine's max batch and cache length). `fallback` builds the weightless drafter served
    while the registry has no version (or none has loaded yet)."""

    def __init__(self, target_model: str, *, s3, cache_dir: str | Path, model, max_batch: int, max_len: int,
                 registry_addr: str | None = None, fallback: Callable[[], Drafter | None] = NgramDrafter,
                 prompt_lookup: bool = False,
                 retry_min_s: float = 0.5, retry_max_s: float = 30.0, watch_max_backoff_s: float = 5.0,
                 install_timeout_s: float = 60.0) -> None:
        self.target_model = target_model
        self.s3, self.cache_dir, self.model = s3, Path(cache_dir), model
        self.max_batch, self.max_len = max_batch, max_len
        self.registry_addr = registry_addr
        self.fallback = fallback
        self.prompt_lookup = prompt_lookup  # serve each draft as a HybridDrafter (copies where the context repeats)
        self.retry_min_s, self.retry_max_s = retry_min_s, retry_max_s
        self.watch_max_backoff_s, self.install_timeout_s = watch_max_backoff_s, install_timeout_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._install: Callable[[Drafter | None], Future] | None = None
        self._wanted = None  # latest TargetAssignment (None: nothing heard from the registry yet)
        self._current: Drafter | None = None  # what "eagle3" means now
        self._current_version: str | None = None  # registry version of _current ("" = fallback, None = none yet)
        self._refused: dict[str, Refusal] = {}
        self._settled = threading.Event()  # the registry's first assignment was acted on (see wait_settled)
        self.stats = {"loads": 0, "refusals": 0, "fetch_errors": 0, "watch_errors": 0, "assignments": 0}

    # ---- any thread ------------------------------------------------------------------------------

    def attach(self, install: Callable[[Drafter | None], Future]) -> None:
        """Where new drafts go: `install(drafter)` -> Future[bool] (swapped in or not)."""
        with self._lock:
            self._install = install
            current = self._current
        if current is not None:
            install(current)

    def start(self) -> DraftWatcher:
        """Start watching (idempotent)."""
        with self._lock:
            if self._threads or self._stop.is_set():
                return self
            self._threads = [threading.Thread(target=self._watch_loop, name="draft-watch", daemon=True),
                             threading.Thread(target=self._load_loop, name="draft-load", daemon=True)]
        for t in self._threads:
            t.start()
        return self

    def wait_settled(self, timeout_s: float) -> bool:
        """Block until the registry's first assignment for the target has been acted on (its draft in
        service, refused, or "no draft"), at most `timeout_s`; whether it was. A worker waits for
        this before it serves, so its first request already runs the registry's draft."""
        self.start()
        return self._settled.wait(timeout_s)

    def drafter(self) -> Drafter | None:
        """The drafter "eagle3" means now (starts watching on first use): the latest loaded draft,
        else the fallback."""
        self.start()
        with self._lock:
            if self._current is None and self._current_version is None:
                self._current, self._current_version = self.fallback(), ""
            return self._current

    @property
    def version(self) -> str:
        """Registry version in service as "eagle3" ("" = the fallback)."""
        with self._lock:
            return self._current_version or ""

    @property
    def wanted_version(self) -> str | None:
        """The registry's effective version as last heard (None: not heard yet)."""
        with self._lock:
            return None if self._wanted is None else self._wanted.version

    @property
    def refusals(self) -> list[Refusal]:
        with self._lock:
            return list(self._refused.values())

    def report(self) -> DraftsReport:
        """One consistent snapshot of `version`, `wanted_version` and `refusals` (for GetStatus)."""
        with self._lock:
            wanted = "" if self._wanted is None else self._wanted.version
            return DraftsReport(self._current_version or "", wanted, tuple(self._refused.values()))

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=timeout_s)

    # ---- watch thread ----------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            client = RegistryClient(self.registry_addr, timeout_s=10.0)
            log.info("watching draft registry %s for target %s", client.address, self.target_model)
            try:
                for assignment in client.watch(self.target_model, self._stop, max_backoff_s=self.watch_max_backoff_s):
                    log.info("registry assigns %s to target %s%s", assignment.version or "(no draft)",
                             self.target_model, " (pinned)" if assignment.pinned else "")
                    with self._lock:
                        self._wanted = assignment
                        self.stats["assignments"] += 1
                    self._wake.set()
            except grpc.RpcError as e:  # a retry cannot fix it (bad target, auth): say so, try again slowly
                self.stats["watch_errors"] += 1
                DRAFT_WATCH_ERRORS.inc()
                log.error("registry watch for target %s failed: %s %s; retrying in %.0f s", self.target_model,
                          e.code(), e.details(), self.retry_max_s)
                self._stop.wait(self.retry_max_s)
            except Exception:  # never let the watcher die
                self.stats["watch_errors"] += 1
                DRAFT_WATCH_ERRORS.inc()
                log.exception("registry watch for target %s failed", self.target_model)
                self._stop.wait(self.retry_min_s)
            finally:
                client.close()

    # ---- load thread -----------------------------------------------------------------------------

    def _load_loop(self) -> None:
        backoff = self.retry_min_s
        retry_in: float | None = None
        while not self._stop.is_set():
            self._wake.wait(retry_in)
            self._wake.clear()
            if self._stop.is_set():
                return
            retry_in = None
            with self._lock:
                want = self._wanted
                skip = want is None or want.version == self._current_version or want.version in self._refused
            if skip:
                if want is not None:
                    self._settled.set()
                continue
            try:
                with one_torch_thread():  # the engine's thread keeps the cores' OpenMP pool to itself
                    drafter = self._load(want)
            except _Refused as r:
                self._refuse(want.version, r.reason, r.detail)
                self._settled.set()
                continue
            except Exception as e:  # transient (S3 unreachable, ...): retry while it is still wanted
                self.stats["fetch_errors"] += 1
                DRAFT_FETCH_ERRORS.inc()
                log.warning("draft %s for target %s not fetched (%s: %s); retrying in %.1f s", want.version,
                            self.target_model, type(e).__name__, e, backoff)
                retry_in, backoff = backoff, min(backoff * 2, self.retry_max_s)
                continue
            backoff = self.retry_min_s
            self._put_in_service(want.version, drafter)
            self._settled.set()

    def _load(self, want) -> Drafter | None:
        if not want.version:
            return self.fallback()
        t0 = time.monotonic()
        try:
            path = fetch_version(self.s3, want.version, want.artifact, self.cache_dir, verify_cached=True)
        except ChecksumMismatch as e:
            raise _Refused("checksum", str(e)) from None
        except S3Error as e:
            if e.code in _MISSING:
                raise _Refused("missing", f"s3://{e.bucket_name}/{e.object_name}: {e.code}") from None
            raise
        try:
            drafter = Eagle3Drafter.from_checkpoint(path, self.model, want.version, self.max_batch, self.max_len)
        except DraftIncompatible as e:
            raise _Refused("incompatible", str(e)) from None
        except Exception as e:  # corrupt weights, out of memory, ...: this version cannot serve here
            raise _Refused("load_failed", f"{type(e).__name__}: {e}") from None
        log.info("draft %s for target %s loaded from %s in %.2f s", want.version, self.target_model, path,
                 time.monotonic() - t0)
        return HybridDrafter(drafter) if self.prompt_lookup else drafter

    def _refuse(self, version: str, reason: str, detail: str) -> None:
        with self._lock:
            self._refused[version] = Refusal(version, reason, detail, time.time())
            self.stats["refusals"] += 1
            serving = self._current_version
        DRAFT_REFUSALS.labels(reason).inc()
        log.error("draft %s for target %s refused (%s): %s; still serving %s", version, self.target_model, reason,
                  detail, serving or "the fallback drafter")

    def _put_in_service(self, version: str, drafter: Drafter | None) -> None:
        with self._lock:
            self._current, self._current_version = drafter, version
            self.stats["loads"] += 1
            install = self._install
        DRAFT_LOADS.inc()
        DRAFT_LOADED_AT.set(time.time())
        if install is None:
            return
        try:
            swapped = install(drafter).result(timeout=self.install_timeout_s)
        except Exception as e:  # the worker stopped or is wedged: it picks the draft up on its next "eagle3"
            log.warning("draft %s loaded but not handed to the worker: %s", version or "(fallback)", e)
            return
        log.info("draft %s for target %s %s", version or "(none: fallback drafter)", self.target_model,
                 "in service" if swapped else "ready (the worker runs another drafter now)")
