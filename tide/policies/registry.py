"""Policies by name: what the controller pushes is `(name, params)`, both JSON-serialisable.

`make_policy("tide", {"gamma": 3}, profile)` → a fresh policy. Params are the constructor's
keyword arguments (see each policy's module); unknown keys raise TypeError, so a typo in a pushed
policy fails loudly instead of silently running defaults. Policies marked `needs_profile` raise
ValueError without a LatencyProfile.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tide.policies.adaptive import AdaptivePolicy
from tide.policies.base import FixedGamma, GammaPolicy
from tide.policies.dsd import DSDPolicy
from tide.policies.fsm import CacheFSMPolicy, FSMPolicy
from tide.policies.nightjar import NightjarPolicy
from tide.policies.onthefly import OnTheFlyPolicy
from tide.policies.profile import LatencyProfile
from tide.policies.sglang_ema import SGLangEMAPolicy
from tide.policies.tide_model import TideLatencyPolicy
from tide.policies.vllm_table import VllmBatchTablePolicy

_Factory = Callable[[dict[str, Any], LatencyProfile | None], GammaPolicy]


def _needs(profile: LatencyProfile | None, name: str) -> LatencyProfile:
    if profile is None:
        raise ValueError(f"policy {name!r} needs a LatencyProfile")
    return profile


_FACTORIES: dict[str, _Factory] = {
    "static": lambda p, prof: FixedGamma(**p),
    "tide": lambda p, prof: TideLatencyPolicy(_needs(prof, "tide"), **p),
    "nightjar": lambda p, prof: NightjarPolicy(prof, **p),
    "onthefly": lambda p, prof: OnTheFlyPolicy(prof, **p),
    "fsm": lambda p, prof: FSMPolicy(**p),
    "cache-fsm": lambda p, prof: CacheFSMPolicy(**p),
    "vllm": lambda p, prof: VllmBatchTablePolicy(profile=prof, **p),
    "sglang": lambda p, prof: SGLangEMAPolicy(**p),
    "dsd": lambda p, prof: DSDPolicy(prof, **p),
    "adaptive": lambda p, prof: AdaptivePolicy(_needs(prof, "adaptive"), **p),
}

POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)

# Policies that adapt to acceptance online (the deadlock guarantee applies to these).
ADAPTIVE_NAMES: tuple[str, ...] = ("tide", "nightjar", "onthefly", "fsm", "cache-fsm", "sglang", "dsd", "adaptive")


def make_policy(
    name: str, params: Mapping[str, Any] | None = None, profile: LatencyProfile | None = None
) -> GammaPolicy:
    """A new policy `name` built from JSON-serialisable `params` (defaults when None/empty)."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}") from None
    params = dict(params or {})
    if name == "static":
        params.setdefault("gamma", 3)
    return factory(params, profile)
