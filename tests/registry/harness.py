"""A real registry for tests: store on the shared S3 server, gRPC server on a loopback port.

Imported as `registry.harness` by tests/registry and tests/admin (tests/ is on sys.path)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.registry.server import build_server
from services.registry.store import RegistryStore
from services.registry.watch import WatchHub
from tide.eagle3 import save_checkpoint
from tide.eagle3.testing import make_draft
from tide.grpcutil import GrpcServer
from tide.registry_client import RegistryClient

TOKEN = "registry-test-token"
TARGET = "tiny-llama"


@dataclass
class Registry:
    store: RegistryStore
    hub: WatchHub
    server: GrpcServer
    s3: object
    bucket: str

    @property
    def address(self) -> str:
        return self.server.target

    def client(self, token: str | None = TOKEN, actor: str | None = "tests") -> RegistryClient:
        return RegistryClient(self.address, token=token, actor=actor, timeout_s=30.0)

    def stop(self) -> None:
        self.hub.stop()
        self.server.stop(grace_s=0)


def start_registry(
    s3,
    bucket: str,
    *,
    token: str | None = TOKEN,
    poll_s: float = 0.05,
    address: str = "127.0.0.1:0",
    root: str = "registry",
) -> Registry:
    store = RegistryStore(s3, bucket, root)
    hub = WatchHub(store, poll_s).start()
    server = build_server(store, hub, address, token, max_workers=64)
    server.start()
    return Registry(store, hub, server, s3, bucket)


def write_draft(path: Path, seed: int = 0, extra: dict | None = None, **kwargs) -> Path:
    """A tiny random EAGLE-3 checkpoint directory (config.json + model.safetensors)."""
    draft, _ = make_draft(seed=seed, **kwargs)
    return save_checkpoint(draft, path, extra=extra)
