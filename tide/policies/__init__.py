"""Speculation policies: per step, how many tokens (γ) each request drafts; γ = 0 means plain decode.

Policies run inside the inference worker, once per engine step, and must decide in
microseconds from local state; their parameters and tables come from the controller.
"""

from tide.policies.base import (
    Action,
    DraftAware,
    Estimate,
    FixedGamma,
    FixedTree,
    GammaPolicy,
    Introspectable,
    RequestView,
    StepContext,
    StepFeedback,
    TreeShape,
    action_depth,
)

__all__ = ["Action", "DraftAware", "Estimate", "FixedGamma", "FixedTree", "GammaPolicy", "Introspectable",
           "RequestView", "StepContext", "StepFeedback", "TreeShape", "action_depth"]
