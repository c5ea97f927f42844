"""Starter drafts: the first version of a target whose registry has none.

A starter is a directory in the SGLang/vLLM EAGLE-3 layout (config.json + model.safetensors) with a
`card.json` beside it that names its target (`target_model`), its held-out evaluation
(`eval_metrics`, floats) and how it was made. The repository ships one for the reference target
under `tide/starter_drafts/`; `TIDE_REGISTRY_STARTER_DRAFTS` names the directory searched (empty:
none).

At start, for every starter whose target has no version at all, the registry uploads it, registers
it (provenance `{"source": "starter", ...}`) and promotes it — only while the target still has no
current version (`expected_current=""`), so two registries starting together, or a version an
operator registered meanwhile, win over the starter. A target that had versions is never touched:
a starter is a first version, not a default that comes back after a rollback to "no draft".
A starter that cannot be read or verified is logged and skipped: the registry serves regardless.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from minio import Minio
from minio.error import MinioException

from services.registry.model import RegistryError
from services.registry.server import artifact_from_pb
from services.registry.store import RegistryStore
from tide.blobs import PointerConflict
from tide.registry_client import upload_checkpoint

log = logging.getLogger(__name__)

CARD = "card.json"


def starter_dirs(root: Path) -> list[Path]:
    """Directories under `root` (or `root` itself) that hold a starter card."""
    if (root / CARD).is_file():
        return [root]
    return sorted(p.parent for p in root.glob(f"*/{CARD}")) if root.is_dir() else []


def seed(store: RegistryStore, s3: Minio, bucket: str, root: str, starters: Path) -> list[str]:
    """Register and promote each starter whose target has no versions; returns the versions made."""
    made = []
    for path in starter_dirs(starters):
        try:
            card = json.loads((path / CARD).read_text())
            target = str(card["target_model"])
            metrics = {k: float(v) for k, v in (card.get("eval_metrics") or {}).items()}
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.error("starter draft %s skipped: unreadable %s (%s)", path, CARD, e)
            continue
        try:
            if store.list(target):
                continue
            artifact = artifact_from_pb(upload_checkpoint(s3, bucket, path, target, root))
            provenance = {"source": "starter", "card": card}
            version = store.register(target, artifact, eval_metrics=metrics,
                                     provenance_json=json.dumps(provenance, sort_keys=True)).version
            store.promote(target, version, reason="starter draft (no version registered yet)", actor="registry",
                          expected_current="")
        except (RegistryError, PointerConflict, MinioException, OSError) as e:  # another one won, or a bad starter
            log.warning("starter draft %s for %s not promoted: %s", path, target, e)
            continue
        log.info("starter draft %s registered and promoted for %s", version, target)
        made.append(version)
    return made
