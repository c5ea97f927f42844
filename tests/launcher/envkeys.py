"""Which `TIDE_*` variables each service reads (import as `launcher.envkeys`; also used by tests/compose).

A service reads a variable when its settings' `from_env` asks for it (observed by running it on a
recording mapping, so nothing is hard-coded here) or when its own code names it as a string literal
(`__main__` reads e.g. TIDE_SHUTDOWN_GRACE_S from os.environ). Shared modules the service uses add
what they read (tide.target: TIDE_CACHE_DIR, for services that load a target; tide.service:
TIDE_LOG_LEVEL, for the services whose `__main__` is `run_service`; tide.kernels: TIDE_CPU_KERNELS,
for the services that run a model forward).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("registry", "trainer", "controller", "inference", "gateway")
_LITERAL = re.compile(r"""["'](TIDE_[A-Z0-9_]+)["']""")
_SHARED = {"inference": {"tide/target.py", "tide/service.py", "tide/kernels/__init__.py"},
           "gateway": {"tide/target.py"},
           "trainer": {"tide/target.py", "tide/service.py", "tide/kernels/__init__.py"},
           "controller": {"tide/service.py"},
           "registry": {"tide/service.py"}}


class RecordingEnv(Mapping):
    """An empty environment that remembers every key asked for."""

    def __init__(self) -> None:
        self.asked: set[str] = set()

    def __getitem__(self, key):
        self.asked.add(key)
        raise KeyError(key)

    def get(self, key, default=None):
        self.asked.add(key)
        return default

    def __contains__(self, key) -> bool:
        self.asked.add(key)
        return False

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


def _settings_class(service: str):
    if service == "registry":
        from services.registry.settings import RegistrySettings as cls
    elif service == "trainer":
        from services.trainer.settings import TrainerSettings as cls
    elif service == "controller":
        from services.controller.settings import ControllerSettings as cls
    elif service == "inference":
        from services.inference.settings import InferenceSettings as cls
    elif service == "gateway":
        from services.gateway.settings import GatewaySettings as cls
    else:
        raise ValueError(service)
    return cls


def literals(paths) -> set[str]:
    out: set[str] = set()
    for path in paths:
        out |= set(_LITERAL.findall(Path(path).read_text()))
    return out


@cache
def keys_read(service: str) -> frozenset[str]:
    env = RecordingEnv()
    _settings_class(service).from_env(env)
    own = literals((REPO / "services" / service).rglob("*.py"))
    shared = literals(REPO / p for p in _SHARED.get(service, ()))
    return frozenset(env.asked | own | shared)
