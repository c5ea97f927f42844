"""What a candidate must pass before it becomes a version: its bytes, its format, its fit.

- `copy_artifact`: server-side copy of uploaded files into the registry's content-addressed
  prefix (refusing missing files and declared sizes that do not match before copying anything).
- `verify_checkpoint`: download the registry's copy, verifying each file's size and SHA-256, then
  validate it as an EAGLE-3 checkpoint (`tide.eagle3.validate_checkpoint_dir`: config, tensor
  names, shapes, dtypes, vocabulary maps, finiteness) and check the target it says it was
  trained for. Returns the config summary recorded in the manifest.
- `check_fits`: a target's versions must agree on what ties a draft to its target (vocabulary,
  hidden sizes, captured layers), so every version of a target loads on the same workers.

Every refusal is `InvalidArgument` with a message naming the file and the problem.
"""

from __future__ import annotations

import tempfile
from typing import Any

from minio import Minio
from minio.commonconfig import CopySource
from minio.error import S3Error

from services.registry.model import Artifact, InvalidArgument
from tide import blobs
from tide.eagle3 import DraftIncompatible, read_extra, validate_checkpoint_dir
from tide.registry_client import download_artifact

COMPAT_KEYS = ("vocab_size", "hidden_size", "target_hidden_size", "aux_layers")
_MISSING = ("NoSuchKey", "NoSuchBucket")


def config_summary(cfg) -> dict[str, Any]:
    """What a draft must agree on with its target's other versions (plus facts worth showing)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.target_hidden_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "aux_layers": list(cfg.aux_layers) if cfg.aux_layers is not None else None,
        "torch_dtype": cfg.torch_dtype,
    }


def copy_artifact(s3: Minio, src: Artifact, dst: Artifact) -> None:
    for f in src.files:
        key = f"{src.prefix}/{f.name}"
        try:
            st = blobs.stat(s3, src.bucket, key)
        except S3Error as e:
            if e.code in _MISSING:
                raise InvalidArgument(f"artifact file s3://{src.bucket}/{key} does not exist") from None
            raise
        if st.size_bytes != f.size_bytes:
            raise InvalidArgument(f"s3://{src.bucket}/{key} has {st.size_bytes} bytes, declared {f.size_bytes}")
    for f in src.files:
        s3.copy_object(dst.bucket, f"{dst.prefix}/{f.name}", CopySource(src.bucket, f"{src.prefix}/{f.name}"))


def verify_checkpoint(s3: Minio, artifact: Artifact, target: str, work_dir: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tide-registry-", dir=work_dir) as tmp:
        try:
            download_artifact(s3, artifact, tmp)
        except blobs.ChecksumMismatch as e:
            raise InvalidArgument(f"checksum mismatch: {e}") from None
        except S3Error as e:
            if e.code in _MISSING:
                raise InvalidArgument(f"artifact file missing: s3://{e.bucket_name}/{e.object_name}") from None
            raise
        try:
            cfg = validate_checkpoint_dir(tmp)
            extra = read_extra(tmp)
        except (DraftIncompatible, ValueError, TypeError) as e:
            why = str(e).replace(tmp, "<checkpoint>")
            raise InvalidArgument(f"not a valid EAGLE-3 checkpoint: {why}") from None
    claimed = extra.get("target_model")
    if claimed and claimed != target:
        raise InvalidArgument(f"checkpoint says it was trained for target {claimed!r}, registering for {target!r}")
    return config_summary(cfg)


def check_fits(summary: dict[str, Any], reference: dict[str, Any], what: str) -> None:
    """InvalidArgument unless `summary` agrees with `reference` on COMPAT_KEYS (None = unknown, skipped)."""
    diff = [
        f"{k} {summary[k]} != {reference.get(k)}"
        for k in COMPAT_KEYS
        if reference.get(k) is not None and summary.get(k) is not None and summary[k] != reference[k]
    ]
    if diff:
        raise InvalidArgument(f"checkpoint does not fit {what}: " + "; ".join(diff))
