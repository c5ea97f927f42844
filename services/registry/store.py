"""The registry's durable state, all in S3 (no other database): immutable manifests, atomic pointers.

Layout under `<root>/targets/<target, '/' escaped>/` in the registry's bucket:

    pointer.json             PointerState (the only mutable object that matters), conditional writes
    allocator.json           {"next": N, "digests": {content digest: version}}, conditional writes
    versions/v0007.json      DraftManifest, created once with If-None-Match (never overwritten)
    artifacts/<digest>/...   the checkpoint files, content-addressed (`tide.registry_client.artifact_prefix`)

Why S3 alone: it already holds the weights, every service can reach it, and conditional writes
(If-Match / If-None-Match, see `tide.blobs`) give compare-and-swap on single objects, which is
all the pointer and the version allocator need. Several registry replicas can share one bucket.

Register: validate the request; copy the files to the content-addressed prefix unless they are
already there (server-side copy); download that copy, verifying every file's size and SHA-256;
validate the checkpoint (`tide.eagle3.validate_checkpoint_dir`) and its fit with the target's
earlier versions; allocate the next version id atomically (or find the one these exact bytes
already got: registration is idempotent); write the manifest. Pointer changes are read-modify-
write loops (`tide.blobs.update_pointer`) around the pure transitions in `services.registry.model`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from urllib.parse import unquote

from minio import Minio

from services.registry import model as m
from services.registry.model import Artifact, DraftManifest, InvalidArgument, NotFound, PointerState
from services.registry.validation import check_fits, copy_artifact, verify_checkpoint
from tide import blobs
from tide.registry_client import DEFAULT_ROOT, artifact_digest, artifact_prefix, target_key

log = logging.getLogger("tide.registry.store")


class _Known(Exception):
    def __init__(self, version: str):
        self.version = version


class RegistryStore:
    """Draft versions and pointers of every target. Thread-safe; share one per process."""

    def __init__(
        self,
        s3: Minio,
        bucket: str,
        root: str = DEFAULT_ROOT,
        *,
        work_dir: str | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.s3, self.bucket, self.root = s3, bucket, root.strip("/")
        self.work_dir, self.clock = work_dir, clock
        self._manifests: dict[str, DraftManifest] = {}  # immutable, so cached forever
        self._listeners: list[Callable[[PointerState], None]] = []
        self._lock = threading.Lock()

    def add_listener(self, fn: Callable[[PointerState], None]) -> None:
        """Call `fn(state)` after each pointer change this process makes (the watch hub's fast path)."""
        self._listeners.append(fn)

    def _key(self, target: str, name: str) -> str:
        return f"{self.root}/targets/{target_key(target)}/{name}"

    # ---------------------------------------------------------------------------- versions

    def get(self, version: str) -> DraftManifest:
        """The manifest of `version`; NotFound when there is none (or the id is not one we issue)."""
        if version in self._manifests:
            return self._manifests[version]
        try:
            target, n = m.parse_version(version)
        except InvalidArgument:
            raise NotFound(f"no draft version {version!r}") from None
        ptr = blobs.get_pointer(self.s3, self.bucket, self._key(target, f"versions/v{n:04d}.json"))
        if ptr is None:
            raise NotFound(f"no draft version {version!r}")
        manifest = DraftManifest.from_json(ptr.value)
        if manifest.version != version:  # "t/v00007" is not another name of "t/v0007"
            raise NotFound(f"no draft version {version!r} (did you mean {manifest.version!r}?)")
        with self._lock:
            self._manifests[version] = manifest
        return manifest

    def list(self, target: str = "") -> list[DraftManifest]:
        """Versions of `target` (all targets when ""), oldest first."""
        targets = [m.check_target(target)] if target else self.targets()
        out = []
        for t in targets:
            prefix = self._key(t, "versions/")
            names = [k[len(prefix) :] for k in blobs.list_keys(self.s3, self.bucket, prefix)]
            numbers = sorted(int(n[1:-5]) for n in names if n.startswith("v") and n.endswith(".json"))
            out += [self.get(m.version_id(t, n)) for n in numbers]
        return out

    def targets(self) -> list[str]:
        """Every target with registry state, sorted."""
        prefix = f"{self.root}/targets/"
        objs = self.s3.list_objects(self.bucket, prefix=prefix, recursive=False)
        return sorted(unquote(o.object_name[len(prefix) :].rstrip("/")) for o in objs if o.is_dir)

    def register(
        self,
        target: str,
        artifact: Artifact,
        *,
        eval_metrics: Mapping[str, float] | None = None,
        provenance_json: str = "",
        parent_version: str = "",
        drafter: str = "",
    ) -> DraftManifest:
        """Verify, validate and record a candidate; the same files registered again give the same version."""
        m.check_target(target)
        artifact.check()
        metrics = m.check_metrics(dict(eval_metrics or {}))
        drafter = drafter or "eagle3"
        if drafter not in m.DRAFTERS:
            raise InvalidArgument(f"drafter {drafter!r} is not one the registry distributes ({list(m.DRAFTERS)})")
        if provenance_json:
            _check_json(provenance_json)
        if parent_version and self.get(parent_version).target_model != target:
            raise InvalidArgument(f"parent {parent_version!r} is a draft of another target than {target!r}")
        digest = artifact_digest(artifact.files)
        known = self._allocated(target).get(digest)
        if known:
            try:
                return self.get(known)  # a retry: same bytes, same version
            except NotFound:
                pass  # allocated by a registration that died before writing the manifest: finish it
        canonical = Artifact(self.bucket, artifact_prefix(target, digest, self.root), artifact.files)
        copied = (artifact.bucket, artifact.prefix) != (canonical.bucket, canonical.prefix)
        if copied:
            copy_artifact(self.s3, artifact, canonical)
        try:
            summary = verify_checkpoint(self.s3, canonical, target, self.work_dir)
            earlier = self.list(target)
            if earlier:
                check_fits(summary, earlier[-1].config, f"target {target!r} as {earlier[-1].version} does")
        except InvalidArgument:
            if copied:  # our copy of a refused checkpoint: leave nothing behind
                for f in canonical.files:
                    self.s3.remove_object(canonical.bucket, f"{canonical.prefix}/{f.name}")
            raise
        version = known or self._allocate(target, digest)
        manifest = DraftManifest(
            version=version,
            target_model=target,
            artifact=canonical,
            content_digest=digest,
            eval_metrics=metrics,
            provenance_json=provenance_json,
            parent_version=parent_version,
            drafter=drafter,
            created_unix_s=self.clock(),
            config=summary,
        )
        key = self._key(target, f"versions/{version.rsplit('/', 1)[1]}.json")
        try:
            blobs.put_pointer(self.s3, self.bucket, key, manifest.to_json(), expected_etag=None)
        except blobs.PointerConflict:  # a concurrent registration of the same bytes won
            manifest = self.get(version)
        with self._lock:
            self._manifests[version] = manifest
        log.info("registered %s", version, extra={"version": version, "digest": digest})
        return manifest

    def _allocated(self, target: str) -> dict[str, str]:
        ptr = blobs.get_pointer(self.s3, self.bucket, self._key(target, "allocator.json"))
        return dict(ptr.value.get("digests", {})) if ptr else {}

    def _allocate(self, target: str, digest: str) -> str:
        def change(value: dict | None) -> dict:
            d = value or {"next": 1, "digests": {}}
            if digest in d["digests"]:
                raise _Known(d["digests"][digest])
            return {"next": d["next"] + 1, "digests": {**d["digests"], digest: m.version_id(target, d["next"])}}

        try:
            ptr = blobs.update_pointer(self.s3, self.bucket, self._key(target, "allocator.json"), change)
        except _Known as k:
            return k.version
        return ptr.value["digests"][digest]

    # ---------------------------------------------------------------------------- pointers

    def pointer(self, target: str) -> PointerState:
        """The target's pointer state (generation 0 and no draft when nothing was ever promoted)."""
        ptr = blobs.get_pointer(self.s3, self.bucket, self._key(m.check_target(target), "pointer.json"))
        return PointerState.from_json(ptr.value) if ptr else PointerState(target)

    def _version_of(self, target: str, version: str) -> tuple[str, str]:
        """(target, version) after checking the version exists and belongs to the target ("" = infer)."""
        manifest = self.get(version)
        if target and manifest.target_model != m.check_target(target):
            raise InvalidArgument(f"{version} is a draft of {manifest.target_model!r}, not {target!r}")
        return manifest.target_model, version

    def _mutate(self, target: str, transition: Callable[[PointerState], PointerState]) -> PointerState:
        def change(value: dict | None) -> dict:
            return transition(PointerState.from_json(value) if value else PointerState(target)).to_json()

        try:
            ptr = blobs.update_pointer(self.s3, self.bucket, self._key(target, "pointer.json"), change, attempts=100)
        except m.NoChange as nc:
            return nc.state
        state = PointerState.from_json(ptr.value)
        event = state.history[0]
        log.info(
            "%s %s: %s -> %s",
            event.action,
            target,
            event.from_version or "-",
            event.to_version or "-",
            extra={
                "target_model": target,
                "generation": state.generation,
                "reason": event.reason,
                "actor": event.actor,
            },
        )
        for fn in self._listeners:
            fn(state)
        return state

    def promote(
        self, target: str, version: str, reason: str = "", actor: str = "", expected_current: str | None = None
    ) -> PointerState:
        target, version = self._version_of(target, version)
        now = self.clock()
        return self._mutate(target, lambda s: m.promote(s, version, reason, actor, now, expected_current))

    def pin(self, target: str, version: str, reason: str = "", actor: str = "") -> PointerState:
        target, version = self._version_of(target, version)
        now = self.clock()
        return self._mutate(target, lambda s: m.pin(s, version, reason, actor, now))

    def unpin(self, target: str, reason: str = "", actor: str = "") -> PointerState:
        now = self.clock()
        return self._mutate(m.check_target(target), lambda s: m.unpin(s, reason, actor, now))

    def rollback(
        self, target: str, reason: str = "", actor: str = "", to_version: str = "", expected_current: str | None = None
    ) -> PointerState:
        if to_version:
            target, to_version = self._version_of(target, to_version)
        now = self.clock()
        return self._mutate(m.check_target(target),
                            lambda s: m.rollback(s, reason, actor, now, to_version, expected_current))


def _check_json(text: str) -> None:
    try:
        json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"provenance_json is not valid JSON: {e}") from None
