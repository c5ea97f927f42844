"""Logits processing: logit_bias, presence / frequency penalties and the grammar mask, applied to the
target's raw logits before temperature / top-k / top-p and before greedy argmax.

Lossless under speculation: verification row j of a request is the target's distribution of the
token after drafts[:j], so it is processed as plain decoding would process that position — penalty
counts include drafts[:j], the grammar mask is the matcher's state after drafts[:j]. Each row gets the
same element-wise operations in the same order whatever the number of rows, so a processed row is
bitwise what one-token decoding computes and greedy output stays token-identical with speculation on.

Requests without any processing never reach this module (the engine's fast path).
"""

from __future__ import annotations

from collections import Counter

import torch

from tide.engine.constraints import GrammarMatcher
from tide.engine.sequence import SamplingParams


def needs_processing(params: SamplingParams) -> bool:
    return (params.grammar is not None or bool(params.logit_bias) or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def has_penalties(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def process(logits: torch.Tensor, params: SamplingParams, counts: Counter | None, drafts: list[int],
            matcher: GrammarMatcher | None) -> torch.Tensor:
    """logits [R, V] (R <= len(drafts) + 1, raw, any dtype) -> processed float32 copy.

    `counts`: occurrences of each output token so far (None: no penalties). `matcher`: the grammar's
    state after the output so far; it is walked through the drafts and rolled back before returning.
    Row j after a draft the grammar rejects keeps no mask: that draft's target probability is 0, so
    verification stops at it and later rows are never read."""
    out = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=out.device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=out.device)
        out.index_add_(1, ids, bias.expand(out.shape[0], -1))
    if counts is not None:
        _penalize(out, params, counts, drafts)
    if matcher is not None:
        _mask(out, matcher, drafts)
    return out


def _penalize(out: torch.Tensor, params: SamplingParams, counts: Counter, drafts: list[int]) -> None:
    """OpenAI's rule: logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)."""
    row_counts = Counter(counts)
    for j in range(out.shape[0]):
        if j > 0:
            row_counts[drafts[j - 1]] += 1
        if not row_counts:
            continue
        ids = torch.tensor(list(row_counts.keys()), dtype=torch.long, device=out.device)
        c = torch.tensor(list(row_counts.values()), dtype=torch.float32, device=out.device)
        out[j, ids] -= params.frequency_penalty * c + params.presence_penalty
        # (every listed token occurs at least once, so the presence term applies to each)


def _mask(out: torch.Tensor, matcher: GrammarMatcher, drafts: list[int]) -> None:
    walked = 0
    try:
        for j in range(out.shape[0]):
            if matcher.ended:  # after an EOS draft: nothing may follow, the row is never read
                break
            allowed = matcher.allowed()
            out[j].masked_fill_(~allowed.to(out.device), float("-inf"))
            # Check the mask before accepting: a refused token would leave the matcher in its error state.
            if j == len(drafts) or not bool(allowed[drafts[j]]):
                break
            if not matcher.accept(drafts[j]):
                raise RuntimeError(f"grammar matcher refused an allowed token {drafts[j]}: {matcher.error}")
            walked += 1
    finally:
        matcher.rollback(walked)
