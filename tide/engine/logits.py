"""Logits processing: logit_bias, the repetition penalty, presence / frequency penalties, the grammar
mask and min_tokens' stop mask, applied to the target's raw logits before temperature / top-k / top-p
and before greedy argmax (vLLM's order: bias, then repetition, then presence / frequency).

Lossless under speculation: verification row j of a request is the target's distribution of the
token after drafts[:j], so it is processed as plain decoding would process that position — penalty
counts and the repetition penalty's seen tokens include drafts[:j], min_tokens counts num_output + j
output tokens, the grammar mask is the matcher's state after drafts[:j]. Each row gets the
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
            or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0 or params.min_tokens > 0)


def has_penalties(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def process(logits: torch.Tensor, params: SamplingParams, counts: Counter | None, drafts: list[int],
            matcher: GrammarMatcher | None, *, seen: set[int] | None = None, num_output: int = 0,
            stop_ids: frozenset[int] = frozenset()) -> torch.Tensor:
    """logits [R, V] (R <= len(drafts) + 1, raw, any dtype) -> processed float32 copy.

    `counts`: occurrences of each output token so far (None: no penalties). `matcher`: the grammar's
    state after the output so far; it is walked through the drafts and rolled back before returning.
    Row j after a draft the grammar rejects keeps no mask: that draft's target probability is 0, so
    verification stops at it and later rows are never read. `seen`: the distinct tokens of the prompt
    and the output so far (the repetition penalty's; None: no repetition penalty). `num_output`:
    output tokens so far; `stop_ids`: the tokens min_tokens masks (EOS unless ignore_eos, and
    stop_token_ids)."""
    out = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=out.device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=out.device)
        out.index_add_(1, ids, bias.expand(out.shape[0], -1))
    if seen is not None and params.repetition_penalty != 1.0:
        _repetition(out, params.repetition_penalty, seen, drafts)
    if counts is not None:
        _penalize(out, params, counts, drafts)
    if matcher is not None:
        _mask(out, matcher, drafts)
    if params.min_tokens > num_output and stop_ids:
        _min_tokens(out, params.min_tokens - num_output, stop_ids)
    return out


def _repetition(out: torch.Tensor, penalty: float, seen: set[int], drafts: list[int]) -> None:
    """CTRL's rule (Keskar et al. 2019, as HF and vLLM apply it): for each token in the prompt or the
    output so far, logit / penalty if the logit is > 0, else logit * penalty. Each element is
    penalised once, so row j (seen + drafts[:j]) is what plain decoding computes at its position."""
    def apply(rows: slice | int, ids: list[int]) -> None:
        at = torch.tensor(ids, dtype=torch.long, device=out.device)
        sub = out[rows, at]
        out[rows, at] = torch.where(sub > 0, sub / penalty, sub * penalty)

    if seen:
        apply(slice(None), sorted(seen))
    new: list[int] = []  # drafts not yet seen, in order: row j penalises those among drafts[:j]
    for j in range(1, out.shape[0]):
        d = drafts[j - 1]
        if d not in seen and d not in new:
            new.append(d)
        if new:
            apply(j, new)


def _min_tokens(out: torch.Tensor, masked_rows: int, stop_ids: frozenset[int]) -> None:
    """Mask the stop tokens in the first `masked_rows` rows (row j: num_output + j output tokens exist).
    Last, after the grammar's mask: where a constraint allows only stop tokens (a complete JSON value
    allows only EOS) the row is left as it is rather than left with nothing to emit."""
    ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=out.device)
    for j in range(min(masked_rows, out.shape[0])):
        masked = out[j].clone()
        masked[ids] = float("-inf")
        if bool(torch.isfinite(masked).any()):
            out[j] = masked


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
