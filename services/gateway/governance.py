"""Which requests may be trained on: the gateway's side of TIDE's opt-out (docs/data-handling.md).

A request is *eligible* (its rows may be captured while collection is on) unless one of these says
no, checked in this order; the first that applies is the reason reported:

- `TIDE_TRAIN_ON_TRAFFIC=0`: the stack-wide switch (the workers read it too and refuse collection);
- `store: false` in the body (OpenAI's parameter; absent or true = eligible);
- the API key is one of `TIDE_API_KEYS_NO_TRAIN` (accepted like `TIDE_API_KEYS`' keys, never trained on);
- the operator's exclusions, `TIDE_CAPTURE_EXCLUDE`: `logprobs` (logprobs / top_logprobs /
  prompt_logprobs asked), `tools` (tools declared), `tool_results` (a message of role "tool"),
  `response_format` (a JSON / schema / grammar constraint on the output).

The worker gets `no_capture` on its GenerateRequest and drops such a request's rows before the
exporter sees them: no chunk bytes, no stream entry, no spool file. Every response carries the
decision in the `X-TIDE-Training` header: `eligible`, or `excluded; reason=<reason>`.

The key id recorded with captured rows (for `tidectl data forget --key-id`) is a hash of the key,
never the key: the first 16 hex digits of SHA-256("tide-key-id:" + key); `tidectl data key-id KEY`
computes it. No auth: "".
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

TRAINING_HEADER = "X-TIDE-Training"
EXCLUSIONS = ("logprobs", "tools", "tool_results", "response_format")


def key_id(key: str) -> str:
    """An API key's id: a hash prefix, safe to store and log (64 bits: collisions are not a concern
    for a deployment's few keys)."""
    return hashlib.sha256(b"tide-key-id:" + key.encode()).hexdigest()[:16] if key else ""


@dataclass(frozen=True)
class Eligibility:
    eligible: bool = True
    reason: str = ""  # why not ("" when eligible)
    key_id: str = ""  # the caller's API key id ("" without auth)

    @property
    def may_remember(self) -> bool:
        """Whether the worker's speculation memory may keep the request's text: not when the client or
        its key opted out of keeping it (`store: false`, a no-train key); the operator's training
        exclusions and the stack switch concern training only."""
        return self.reason not in ("store_false", "api_key_policy")

    def header(self) -> str:
        return "eligible" if self.eligible else f"excluded; reason={self.reason}"


def _excluded_by(request, exclude: frozenset[str]) -> str:
    if "logprobs" in exclude and (
        getattr(request, "logprobs", None)
        or getattr(request, "top_logprobs", None)
        or getattr(request, "prompt_logprobs", None) is not None
    ):
        return "logprobs"
    if "tools" in exclude and getattr(request, "tools", None):
        return "tools"
    if "tool_results" in exclude and any(m.role == "tool" for m in getattr(request, "messages", None) or ()):
        return "tool_results"
    if "response_format" in exclude:
        fmt = getattr(request, "response_format", None)
        guided = any(
            getattr(request, name, None)
            for name in ("guided_json", "guided_regex", "guided_grammar", "guided_choice", "structured_outputs")
        )
        if (fmt is not None and getattr(fmt, "type", "text") != "text") or guided:
            return "response_format"
    return ""


def decide(settings, request, key: str) -> Eligibility:
    """The eligibility of `request` (a parsed chat or completion body) sent with API key `key`."""
    kid = key_id(key) if settings.auth_enabled else ""
    if not settings.train_on_traffic:
        return Eligibility(False, "stack_off", kid)
    if getattr(request, "store", None) is False:
        return Eligibility(False, "store_false", kid)
    if key and key in settings.api_keys_no_train:
        return Eligibility(False, "api_key_policy", kid)
    reason = _excluded_by(request, settings.capture_exclude)
    return Eligibility(not reason, reason, kid)


# The decision for a parsed request, for the serving classes of the APIs that run as chat requests
# (Responses, Messages): the router binds the settings and the caller's key.
Decide = Callable[[object], Eligibility]


def undecided(request) -> Eligibility:
    """No decision (a caller outside the router, e.g. a test): not captured."""
    return Eligibility(False, "undecided")
