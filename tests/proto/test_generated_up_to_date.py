"""The committed generated code must be exactly what the generator produces from the .proto files."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

from tide.proto import generate

COMMITTED = generate.OUTPUT_ROOT


def _tree(root: Path) -> dict[str, bytes]:
    base = root / "tide"
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(base.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    generate.generate(tmp_path)
    fresh, committed = _tree(tmp_path), _tree(COMMITTED)
    hint = (
        "generated code is stale: run `python -m tide.proto.generate` and commit tide/proto/tide "
        f"(grpcio-tools {version('grpcio-tools')}, protobuf {version('protobuf')})"
    )
    assert sorted(fresh) == sorted(committed), hint
    changed = [name for name in fresh if fresh[name] != committed[name]]
    assert not changed, f"{hint}; differing files: {changed}"


def test_generated_imports_resolve_and_admin_option_is_readable() -> None:
    from tide.proto.tide.v1 import common_pb2, controller_pb2_grpc, inference_pb2  # noqa: F401

    service = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]
    admin = {m.name for m in service.methods if m.GetOptions().Extensions[common_pb2.admin]}
    assert admin == {"ApplyDecision"}
