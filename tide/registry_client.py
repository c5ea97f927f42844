"""Client side of the draft registry, for workers, the trainer and `tidectl`.

- Artifacts: `upload_checkpoint` puts a checkpoint directory's files into object storage at a
  content-addressed prefix (`artifact_prefix`, the registry's own layout, so the registry need not
  copy them) and returns the `DraftArtifact` to register. `download_artifact` streams files to disk
  verifying each file's size and SHA-256 (`ChecksumMismatch` names the object); `fetch_version`
  does it into a per-version cache directory, atomically (temp dir + rename), once per version.
- `RegistryClient`: the gRPC API with the admin token and actor attached, `register_dir` (upload +
  RegisterDraft) and `watch` (a generator of assignments that reconnects with backoff).

File objects are duck-typed: anything with `.name`, `.sha256`, `.size_bytes` (the proto `FileRef`
and the registry's `FileEntry` both are), and artifacts anything with `.bucket`, `.prefix`, `.files`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from urllib.parse import quote

import grpc
from minio import Minio

from tide import grpcutil
from tide.blobs import ChecksumMismatch
from tide.proto.tide.v1 import common_pb2, registry_pb2
from tide.proto.tide.v1 import registry_pb2_grpc as registry_grpc

REGISTRY_ADDR_ENV = "TIDE_REGISTRY_ADDR"
DEFAULT_REGISTRY_ADDR = "127.0.0.1:50055"
DEFAULT_ROOT = "registry"  # key prefix of everything the registry owns in its bucket
_VERIFIED = ".tide-verified.json"  # marker written last into a complete cache directory
_BUFSIZE = 1 << 20


# --------------------------------------------------------------------------------- artifacts


def artifact_digest(files: Iterable) -> str:
    """SHA-256 identifying a checkpoint's content: over the sorted (name, sha256, size) triples."""
    triples = sorted([f.name, f.sha256, int(f.size_bytes)] for f in files)
    return hashlib.sha256(json.dumps(triples, separators=(",", ":")).encode()).hexdigest()


def target_key(target_model: str) -> str:
    """A target id as one key segment ('/' escaped)."""
    return quote(target_model, safe="")


def artifact_prefix(target_model: str, digest: str, root: str = DEFAULT_ROOT) -> str:
    return f"{root}/targets/{target_key(target_model)}/artifacts/{digest}"


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_BUFSIZE):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_files(path: str | Path) -> list[common_pb2.FileRef]:
    """FileRefs for the regular, non-hidden files at the top of a checkpoint directory."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a directory")
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    return [common_pb2.FileRef(name=p.name, sha256=_hash_file(p), size_bytes=p.stat().st_size) for p in files]


def upload_checkpoint(
    s3: Minio, bucket: str, path: str | Path, target_model: str, root: str = DEFAULT_ROOT
) -> common_pb2.DraftArtifact:
    """Upload a checkpoint directory to its content-addressed prefix; returns what to register."""
    files = checkpoint_files(path)
    prefix = artifact_prefix(target_model, artifact_digest(files), root)
    for f in files:
        s3.fput_object(bucket, f"{prefix}/{f.name}", str(Path(path) / f.name), metadata={"sha256": f.sha256})
    return common_pb2.DraftArtifact(bucket=bucket, prefix=prefix, files=files)


def download_file(s3: Minio, bucket: str, key: str, dest: Path, sha256: str, size_bytes: int) -> None:
    """Stream one object to `dest`, verifying size and SHA-256 (ChecksumMismatch otherwise)."""
    h, n = hashlib.sha256(), 0
    resp = s3.get_object(bucket, key)
    try:
        with open(dest, "wb") as out:
            for chunk in resp.stream(_BUFSIZE):
                h.update(chunk)
                n += len(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
    finally:
        resp.close()
        resp.release_conn()
    actual = h.hexdigest()
    if actual != sha256.lower() or n != size_bytes:
        raise ChecksumMismatch(bucket, key, f"{sha256.lower()} ({size_bytes} bytes)", f"{actual} ({n} bytes)")


def download_artifact(s3: Minio, artifact, dest_dir: str | Path) -> Path:
    """Download every file of `artifact` into `dest_dir` (created), verifying each one."""
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    for f in artifact.files:
        download_file(s3, artifact.bucket, f"{artifact.prefix}/{f.name}", dest_dir / f.name, f.sha256, f.size_bytes)
    return dest_dir


def fetch_version(s3: Minio, version: str, artifact, cache_dir: str | Path, *, verify_cached: bool = False) -> Path:
    """The local directory holding `version`'s checkpoint, downloaded and verified once.

    A complete copy is `cache_dir/<quoted version>/` with a marker naming the artifact's digest; it
    appears atomically (download into a temp dir, rename), so a crash leaves no half directory and
    concurrent fetches of one version are safe. `verify_cached` re-hashes a cached copy's files."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / target_key(version)
    digest = artifact_digest(artifact.files)
    if _cached_ok(final, digest, artifact.files if verify_cached else None):
        return final
    if final.exists():  # stale or damaged copy: replace it
        shutil.rmtree(final, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache_dir))
    try:
        download_artifact(s3, artifact, tmp)
        (tmp / _VERIFIED).write_text(json.dumps({"version": version, "digest": digest}))
        try:
            os.rename(tmp, final)
        except OSError:  # another fetch of the same version won the race
            if not _cached_ok(final, digest, None):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _cached_ok(path: Path, digest: str, files) -> bool:
    try:
        if json.loads((path / _VERIFIED).read_text()).get("digest") != digest:
            return False
    except (OSError, ValueError):
        return False
    return files is None or all(_hash_file(path / f.name) == f.sha256 for f in files)


# ------------------------------------------------------------------------------------ client


class RegistryClient:
    """Thin wrapper over `RegistryService` (admin token and actor sent with every call)."""

    def __init__(
        self, address: str | None = None, *, token: str | None = None, actor: str | None = None, timeout_s: float = 30.0
    ):
        self.address = address or os.environ.get(REGISTRY_ADDR_ENV) or DEFAULT_REGISTRY_ADDR
        self.timeout_s = timeout_s
        self.channel = grpcutil.channel(self.address, token=token, actor=actor)
        self.stub = registry_grpc.RegistryServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # unary calls
    def register(
        self,
        target_model: str,
        artifact: common_pb2.DraftArtifact,
        *,
        eval_metrics: Mapping[str, float] | None = None,
        provenance: dict | str | None = None,
        parent_version: str = "",
        drafter: str = "eagle3",
    ) -> registry_pb2.DraftVersion:
        prov = provenance if isinstance(provenance, str) else json.dumps(provenance or {}, sort_keys=True)
        req = registry_pb2.RegisterDraftRequest(
            target_model=target_model,
            artifact=artifact,
            eval_metrics=dict(eval_metrics or {}),
            provenance_json=prov,
            parent_version=parent_version,
            drafter=drafter,
        )
        return self.stub.RegisterDraft(req, timeout=max(self.timeout_s, 300.0))

    def register_dir(
        self, path: str | Path, target_model: str, *, s3: Minio, bucket: str, root: str = DEFAULT_ROOT, **kwargs
    ) -> registry_pb2.DraftVersion:
        """Upload a checkpoint directory and register it (retry-safe: same files, same version)."""
        return self.register(target_model, upload_checkpoint(s3, bucket, path, target_model, root), **kwargs)

    def list(self, target_model: str = "") -> registry_pb2.ListDraftsResponse:
        return self.stub.ListDrafts(registry_pb2.ListDraftsRequest(target_model=target_model), timeout=self.timeout_s)

    def get(self, version: str) -> registry_pb2.DraftVersion:
        return self.stub.GetDraft(registry_pb2.GetDraftRequest(version=version), timeout=self.timeout_s)

    def pointer(self, target_model: str) -> registry_pb2.PointerState:
        return self.stub.GetPointer(registry_pb2.GetPointerRequest(target_model=target_model), timeout=self.timeout_s)

    def promote(
        self, version: str, target_model: str = "", reason: str = "", expected_current: str | None = None
    ) -> registry_pb2.PointerState:
        req = registry_pb2.PromoteRequest(target_model=target_model, version=version, reason=reason)
        return self._move_pointer(self.stub.Promote, req, expected_current)

    def pin(self, version: str, target_model: str = "", reason: str = "") -> registry_pb2.PointerState:
        req = registry_pb2.PinRequest(target_model=target_model, version=version, reason=reason)
        return self.stub.Pin(req, timeout=self.timeout_s)

    def unpin(self, target_model: str, reason: str = "") -> registry_pb2.PointerState:
        return self.stub.Unpin(
            registry_pb2.UnpinRequest(target_model=target_model, reason=reason), timeout=self.timeout_s
        )

    def rollback(
        self, target_model: str, reason: str = "", to_version: str = "", expected_current: str | None = None
    ) -> registry_pb2.PointerState:
        req = registry_pb2.RollbackRequest(target_model=target_model, reason=reason, to_version=to_version)
        return self._move_pointer(self.stub.Rollback, req, expected_current)

    def _move_pointer(self, rpc, req, expected_current: str | None) -> registry_pb2.PointerState:
        """`rpc(req)`, a pointer move that the registry refuses (FAILED_PRECONDITION) unless the
        current version is `expected_current` (None: whatever it is)."""
        if expected_current is not None:
            req.expected_current = expected_current
        return rpc(req, timeout=self.timeout_s)

    # watch
    _FATAL = (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
    )

    def watch(
        self,
        target_model: str,
        stop: threading.Event | None = None,
        *,
        min_backoff_s: float = 0.2,
        max_backoff_s: float = 10.0,
    ) -> Iterator[registry_pb2.TargetAssignment]:
        """Yield the target's assignment now and on every change, forever (until `stop` is set or
        the generator is closed, or the client closed). Reconnects with jittered exponential backoff
        when the stream ends or the registry is unreachable; an assignment equal to the last one
        yielded (same version and pin) is not repeated, e.g. the first message after a reconnect.
        Raises grpc.RpcError for errors a retry cannot fix (bad target, missing auth)."""
        stop = stop or threading.Event()
        active: list[grpc.Call] = []
        closed = threading.Event()

        def cancel_on_stop() -> None:
            while not closed.is_set() and not stop.wait(0.5):
                pass
            for call in list(active):
                call.cancel()

        threading.Thread(target=cancel_on_stop, name="registry-watch-stop", daemon=True).start()
        last, backoff = None, min_backoff_s
        try:
            while not stop.is_set():
                try:
                    call = self.stub.WatchTarget(registry_pb2.WatchTargetRequest(target_model=target_model))
                except ValueError:  # the client was closed
                    return
                active[:] = [call]
                try:
                    for msg in call:
                        backoff = min_backoff_s
                        key = (msg.version, msg.pinned)
                        if key != last:
                            last = key
                            yield msg
                except grpc.RpcError as e:
                    if e.code() in self._FATAL:
                        raise
                finally:
                    call.cancel()
                if stop.wait(backoff * random.uniform(0.5, 1.0)):
                    break
                backoff = min(backoff * 2, max_backoff_s)
        finally:
            closed.set()
            for call in list(active):
                call.cancel()
