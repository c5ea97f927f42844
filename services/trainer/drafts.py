"""The trainer's side of the draft registry: the base draft a run fine-tunes from, registration of
candidates, promotion. An adapter over tide.registry_client (the same client and verified download,
`fetch_version`, that inference workers use): gRPC and storage errors become `RegistryError` with
a message that says what failed, so the training cycle (cycle.py) handles no gRPC.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from minio import Minio
from minio.error import S3Error

from tide.blobs import ChecksumMismatch
from tide.registry_client import RegistryClient, fetch_version

log = logging.getLogger(__name__)


class RegistryError(Exception):
    """The registry could not be reached, refused the request, or a version could not be fetched."""


class PointerMoved(RegistryError):
    """Promotion refused: the target's current draft changed since the run started."""


@dataclass(frozen=True)
class BaseDraft:
    """What the workers run when a run starts: `version` (the pointer's effective one, "" = no
    draft), `current` (the pointer's current, what a promotion replaces), `pinned`, and `path`
    (the verified local checkpoint; None without a version)."""

    version: str
    current: str
    pinned: bool
    path: Path | None


def _why(e: grpc.RpcError) -> str:
    return f"{e.code().name}: {e.details()}"


class DraftRegistry:
    def __init__(self, address: str, token: str | None, s3: Minio, bucket: str, cache_dir: str | Path,
                 timeout_s: float = 30.0) -> None:
        self.address, self.s3, self.bucket, self.cache_dir = address, s3, bucket, Path(cache_dir)
        self.client = RegistryClient(address, token=token, actor="trainer", timeout_s=timeout_s)

    def close(self) -> None:
        self.client.close()

    def base(self, target: str) -> BaseDraft:
        """The target's effective version, downloaded and verified into the cache directory."""
        try:
            pointer = self.client.pointer(target)
            if not pointer.effective:
                return BaseDraft("", pointer.current, False, None)
            version = self.client.get(pointer.effective)
        except grpc.RpcError as e:
            raise RegistryError(f"registry at {self.address}: cannot read the draft of {target} ({_why(e)})") from None
        try:
            path = fetch_version(self.s3, version.version, version.artifact, self.cache_dir, verify_cached=True)
        except (ChecksumMismatch, S3Error, OSError) as e:
            raise RegistryError(f"base draft {version.version} could not be downloaded: {e}") from None
        return BaseDraft(version.version, pointer.current, bool(pointer.pinned), path)

    def register(self, target: str, path: Path, *, eval_metrics: dict[str, float], provenance: dict,
                 parent_version: str) -> str:
        """Upload the checkpoint and register it; returns the version (the same files: the same version)."""
        try:
            dv = self.client.register_dir(path, target, s3=self.s3, bucket=self.bucket, eval_metrics=eval_metrics,
                                          provenance=provenance, parent_version=parent_version)
        except grpc.RpcError as e:
            raise RegistryError(f"registry at {self.address} did not register the candidate ({_why(e)})") from None
        except (S3Error, OSError) as e:
            raise RegistryError(f"the candidate could not be uploaded: {e}") from None
        return dv.version

    def promote(self, target: str, version: str, reason: str, expected_current: str) -> None:
        """Make `version` current, only if the current draft is still `expected_current`."""
        try:
            self.client.promote(version, target, reason, expected_current=expected_current)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise PointerMoved(e.details()) from None
            raise RegistryError(f"registry at {self.address} did not promote {version} ({_why(e)})") from None
