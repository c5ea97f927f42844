"""How `tidectl` shows registry messages: plain dicts for --json, aligned text for people."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from tide.proto.tide.v1 import registry_pb2

# How the controller's rollback of a draft that workers refused begins its reason
# (services.controller.refusals.REFUSAL_REASON_PREFIX; not imported: tidectl stays light).
REFUSAL_REASON_PREFIX = "draft refused by a worker"

_ACTIONS = {
    registry_pb2.POINTER_ACTION_PROMOTE: "promote",
    registry_pb2.POINTER_ACTION_PIN: "pin",
    registry_pb2.POINTER_ACTION_UNPIN: "unpin",
    registry_pb2.POINTER_ACTION_ROLLBACK: "rollback",
}


def utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t else "-"


def draft_dict(d: registry_pb2.DraftVersion) -> dict:
    try:
        provenance = json.loads(d.provenance_json) if d.provenance_json else {}
    except ValueError:
        provenance = d.provenance_json
    files = [{"name": f.name, "sha256": f.sha256, "size_bytes": f.size_bytes} for f in d.artifact.files]
    return {
        "version": d.version,
        "target_model": d.target_model,
        "drafter": d.drafter,
        "parent_version": d.parent_version,
        "created_unix_s": d.created_unix_s,
        "created": utc(d.created_unix_s),
        "eval_metrics": dict(sorted(d.eval_metrics.items())),
        "provenance": provenance,
        "artifact": {"bucket": d.artifact.bucket, "prefix": d.artifact.prefix, "files": files},
    }


def pointer_dict(p: registry_pb2.PointerState) -> dict:
    history = [
        {
            "action": _ACTIONS.get(e.action, "unspecified"),
            "from_version": e.from_version,
            "to_version": e.to_version,
            "reason": e.reason,
            "actor": e.actor,
            "time_unix_s": e.time_unix_s,
            "time": utc(e.time_unix_s),
        }
        for e in p.history
    ]
    return {
        "target_model": p.target_model,
        "effective": p.effective,
        "current": p.current,
        "pinned": p.pinned,
        "previous": list(p.previous),
        "generation": int(p.generation),
        "history": history,
    }


def refused(version: str, pointer: dict | None) -> bool:
    """Whether the pointer's (recent) history has the controller rolling `version` back because workers
    refused to run it (services/controller/refusals.py)."""
    return any(e["action"] == "rollback" and e["from_version"] == version
               and e["reason"].startswith(REFUSAL_REASON_PREFIX) for e in (pointer or {}).get("history", ()))


def states(version: str, pointer: dict | None) -> list[str]:
    """Labels of `version` in its target's pointer: effective / current / pinned / previous, and
    refused when workers refused to run it (the registry then went back to what they serve)."""
    if not pointer:
        return []
    labels = [k for k in ("effective", "current", "pinned") if pointer.get(k) == version]
    labels += ["previous"] if version in pointer.get("previous", ()) else []
    return labels + (["refused"] if refused(version, pointer) else [])


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]
    lines = [headers, *rows]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in lines)


def _metrics(m: dict) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in m.items()) or "-"


def drafts_text(drafts: list[dict], pointers: dict[str, dict]) -> str:
    if not drafts:
        return "no draft versions registered"
    rows = [
        [
            d["version"],
            d["created"],
            ",".join(states(d["version"], pointers.get(d["target_model"]))) or "-",
            d["parent_version"] or "-",
            _metrics(d["eval_metrics"]),
        ]
        for d in drafts
    ]
    return table(["VERSION", "CREATED", "STATE", "PARENT", "EVAL"], rows)


def draft_text(d: dict, pointer: dict | None) -> str:
    fields = [
        ("version", d["version"]),
        ("target", d["target_model"]),
        ("state", ", ".join(states(d["version"], pointer)) or "-"),
        ("drafter", d["drafter"]),
        ("parent", d["parent_version"] or "-"),
        ("created", d["created"]),
        ("eval", _metrics(d["eval_metrics"])),
        ("provenance", json.dumps(d["provenance"], sort_keys=True) if d["provenance"] else "-"),
        ("location", f"s3://{d['artifact']['bucket']}/{d['artifact']['prefix']}/"),
    ]
    files = table(
        ["FILE", "BYTES", "SHA256"], [[f["name"], str(f["size_bytes"]), f["sha256"]] for f in d["artifact"]["files"]]
    )
    return "\n".join(f"{k:<11}{v}" for k, v in fields) + "\n\n" + files


def pointer_text(p: dict, limit: int = 10) -> str:
    effective = p["effective"] or "none (serving without an EAGLE-3 draft)"
    if p["pinned"]:
        effective += " (pinned)"
    fields = [
        ("target", p["target_model"]),
        ("effective", effective),
        ("current", p["current"] or "-"),
        ("pinned", p["pinned"] or "-"),
        ("previous", ", ".join(p["previous"]) or "-"),
        ("generation", str(p["generation"])),
    ]
    out = "\n".join(f"{k:<11}{v}" for k, v in fields)
    if p["history"]:
        rows = [
            [
                e["time"],
                e["action"],
                f"{e['from_version'] or '-'} -> {e['to_version'] or '-'}",
                e["actor"] or "-",
                e["reason"] or "-",
            ]
            for e in p["history"][:limit]
        ]
        out += "\n\n" + table(["TIME", "ACTION", "CHANGE", "ACTOR", "REASON"], rows)
    return out
