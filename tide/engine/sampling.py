"""Token selection and lossless verification of drafted tokens.

Greedy: accept drafts while they equal the target's argmax, then emit the target's argmax at the
first mismatch (or after the last draft: the bonus token) — output identical to plain greedy.
Sampling (Leviathan et al., speculative sampling): accept draft x with probability
min(1, p(x)/q(x)); on rejection sample from norm(max(0, p - q)); if every draft is accepted sample
the bonus from p. The emitted tokens are distributed exactly as sampling from p alone.
`p` is the target's distribution after temperature / top-k / min-p / top-p; `q` the drafter's proposal
distribution over the target vocabulary (one-hot for deterministic drafters such as n-gram).
Draft trees (tide.engine.tree): `verify_tree_greedy` and `verify_tree_sampling` below.

Coupled sampling (`verify_coupled`, `verify_tree_coupled`): the token at output position n is
drawn by inverse CDF from the target's distribution with a uniform that is a pure function of
(seed, n) (`position_uniform`), in plain decoding and in verification alike. The draw is exact
(P(token v) = p(v)), and since it depends on nothing else, a seeded request gives the same tokens
whatever γ, tree, drafter, draft version, batch or load; verifying a draft only checks whether it
guessed the token the target draws there, as greedy verification does. For a deterministic draft
token x the acceptance probability is p(x), as rejection sampling's; a drafter that draws its own
guess from its q with the same uniform (`coupled_draws`) accepts where p and q agree.
"""

from __future__ import annotations

import enum

import torch

from tide import kernels
from tide.engine.sequence import SamplingParams, TokenLogprob
from tide.engine.tree import DraftTree


class SamplingScheme(enum.Enum):
    """How a sampled request draws its tokens and verifies drafts."""

    COUPLED = "coupled"  # inverse CDF with position_uniform(seed, position): reproducible per seed
    REJECTION = "rejection"  # the request's torch generator; drafts by speculative (rejection) sampling


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Rows of logits [R, V] -> the distribution sampling draws from (float32)."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        # vLLM's min_p (after temperature, before top-p): drop tokens whose probability is below
        # min_p * the row's largest; the most probable token always stays.
        drop = probs < params.min_p * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax per row of logits [R, V]. bf16 -> float32 is exact, so this is the bf16 argmax (ties
    included: both return the first maximum); on CPU torch's bf16 argmax is unvectorised and took
    173 us for the reference model's 49k-entry rows, float32 36 us with the conversion: 0.6-0.8 ms
    a 17-row tree verification, where tide.kernels' argmax_rows (AVX-512) takes ~3 us a row."""
    ops = kernels.use_for(logits)
    if ops is not None and ops.has_argmax and logits.dim() == 2 and logits.dtype in (torch.bfloat16, torch.float32):
        return ops.argmax_rows(logits)
    return logits.float().argmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


_MASK64 = 2**64 - 1
_GOLDEN64 = 0x9E3779B97F4A7C15  # SplitMix64's increment (2^64 / the golden ratio, odd)


def _mix64(z: int) -> int:
    """SplitMix64's output function (Steele, Lea, Flood 2014): a bijection of 64-bit words."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_uniform(seed: int, index: int) -> float:
    """The uniform in [0, 1) that draws output token `index` (0 = the first) of a request sampled
    with `seed` (taken mod 2^64): output `index` of a SplitMix64 generator whose state starts at
    the mixed seed, read at its counter directly, 53 bits (a double's mantissa)."""
    state = (_mix64(seed & _MASK64) + (index + 1) * _GOLDEN64) & _MASK64
    return (_mix64(state) >> 11) * 2.0**-53


def coupled_draws(probs: torch.Tensor, uniforms: list[float]) -> list[int]:
    """Row j of probs [R, V] (any non-negative weights with a positive sum) drawn by inverse CDF
    with uniforms[j]: the first token whose cumulative weight exceeds uniforms[j] * total, in
    vocabulary order. Tokens of weight 0 are never drawn. float64 sums keep the draw a function of
    the row's values alone (the same row, the same token, in decoding and in verification)."""
    cdf = probs.to(torch.float64).cumsum(-1)
    x = torch.tensor(uniforms, dtype=torch.float64, device=cdf.device) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, x[:, None], right=True)[:, 0].tolist()
    vocab = probs.shape[-1]
    for j, t in enumerate(tokens):
        if t >= vocab:  # x rounded up to the total (u within 2^-53 of 1): the last token with weight
            tokens[j] = int(torch.nonzero(probs[j] > 0).max())
    return tokens


def verify_greedy(target_argmax: list[int], drafts: list[int]) -> tuple[int, int]:
    """target_argmax[j] = argmax of the target at verification row j (len(drafts) + 1 rows).

    Returns (accepted draft count k, the token emitted after them).
    """
    k = 0
    while k < len(drafts) and drafts[k] == target_argmax[k]:
        k += 1
    return k, target_argmax[k]


def verify_sampling(
    probs: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """probs: target distributions [len(drafts) + 1, V]; draft_probs: q rows [len(drafts), V] or
    None for a deterministic (one-hot) proposal. Returns (accepted count k, next token)."""
    n = len(drafts)
    if n:
        u = torch.rand(n, generator=generator, device=probs.device)
    for j, tok in enumerate(drafts):
        p = probs[j, tok].item()
        q = 1.0 if draft_probs is None else draft_probs[j, tok].item()
        if q > 0 and u[j].item() * q < p:  # accept with probability min(1, p/q)
            continue
        residual = probs[j].clone()
        if draft_probs is None:
            residual[tok] = 0.0
        else:
            residual = (residual - draft_probs[j]).clamp_min_(0.0)
        total = residual.sum()
        if total.item() <= 0:  # p == q exactly: any rejection is measure-zero; fall back to p
            residual = probs[j]
        return j, sample(residual, generator)
    return n, sample(probs[n], generator)


def verify_coupled(probs: torch.Tensor, drafts: list[int], uniforms: list[float]) -> tuple[int, int]:
    """Coupled verification of a chain: probs [len(drafts) + 1, V] the target's distributions,
    uniforms[j] the uniform of the output position row j draws (position_uniform). The target's
    own draws decide, as greedy verification's argmax does. Returns (accepted count k, next token)."""
    return verify_greedy(coupled_draws(probs, uniforms[:len(drafts) + 1]), drafts)


def verify_tree_coupled(probs: torch.Tensor, tree: DraftTree, uniforms: list[float]) -> tuple[list[int], int]:
    """Coupled verification of a tree: row j draws with the uniform of its depth's output position
    (uniforms[depth of node j]: every node at one depth stands for the same position); then the
    walk of verify_tree_greedy over those draws. Returns (accepted path, root included; next token)."""
    return verify_tree_greedy(coupled_draws(probs, [uniforms[d] for d in tree.depths]), tree)


def verify_tree_greedy(target_argmax: list[int], tree: DraftTree) -> tuple[list[int], int]:
    """target_argmax[j] = the target's argmax at tree row j (after node j's path).

    Walks from the root to the child carrying the target's choice while there is one (siblings
    carry distinct tokens: at most one matches). Returns (accepted path: node ids from the root,
    root included; the token emitted after it) — what plain greedy decoding emits, token for
    token, as long as the rows are plain decoding's (ModelRunner.run_tree)."""
    path = [0]
    while True:
        token = target_argmax[path[-1]]
        child = tree.child_with(path[-1], token)
        if child is None:
            return path, token
        path.append(child)


def verify_tree_sampling(probs: torch.Tensor, tree: DraftTree,
                         generator: torch.Generator | None) -> tuple[list[int], int]:
    """Multi-branch rejection sampling with deterministic candidates (EAGLE-2's tree sampling;
    SpecInfer's multi-step speculative sampling with one-hot proposals). probs: the target's
    distribution at every tree row [len(tree.tokens), V]. Returns (accepted path, root included;
    the token emitted after it).

    At node u with p = probs[u], try its children c_1..c_m in order: accept c_i with probability
    p_{i-1}(c_i), where p_0 = p and p_i = p_{i-1} with c_i's entry zeroed and renormalised (the
    residual norm(max(p_{i-1} - q, 0)) for the one-hot proposal q = δ_{c_i}); after an accept move
    to c_i and repeat with its row, after m rejections emit a sample of p_m.

    Exactness. The children are fixed before the target is consulted (the draft builds the tree
    deterministically from its own distributions, tide.engine.drafters.eagle3), and are distinct.
    Claim: the token emitted at u (accepted child or residual sample) is distributed as p. Let
    X_i be the output of stages i+1 .. m+1 given they are reached; X_m ~ p_m. If X_i ~ p_i then
    stage i emits c_i with probability p_{i-1}(c_i) + (1 - p_{i-1}(c_i)) · p_i(c_i) = p_{i-1}(c_i)
    (p_i(c_i) = 0), and x != c_i with (1 - p_{i-1}(c_i)) · p_{i-1}(x) / (1 - p_{i-1}(c_i)) =
    p_{i-1}(x): X_{i-1} ~ p_{i-1}, so X_0 ~ p_0 = p. When child c is accepted, the next token is
    drawn at c the same way from row c, which is the target's distribution given the context and
    c; the uniforms are fresh at every node, so by the chain rule the emitted tokens are
    distributed as sampling from the target token by token. (Drawing the children from q and
    accepting with min(1, p/q) is the other exact scheme only for children sampled without
    replacement and all kept; EAGLE-2 keeps the most probable nodes, which is not such a sample.)"""
    path = [0]
    while True:
        node = path[-1]
        p = probs[node]
        kids = tree.children[node]
        accepted = None
        rejected: list[int] = []
        if kids:
            toks = [tree.tokens[c] for c in kids]
            p_kids = p[toks].tolist()
            u = torch.rand(len(kids), generator=generator, device=p.device).tolist()
            # p_{i-1}(c_i) = p(c_i) / rest with rest = 1 - p(c_1) - ... - p(c_{i-1}): the
            # renormalised residual without materialising it (one row copy only if all are rejected).
            rest = 1.0
            for child, tok, pc, ui in zip(kids, toks, p_kids, u, strict=True):
                if ui * rest < pc:
                    accepted = child
                    break
                rejected.append(tok)
                rest -= pc
                if rest <= 0.0:  # all mass was on the rejected tokens: a measure-zero rejection
                    break
        if accepted is None:
            if rejected:
                residual = p.clone()
                residual[rejected] = 0.0
                p = residual if residual.sum().item() > 0 else p  # as verify_sampling's fallback
            return path, sample(p, generator)  # multinomial normalises the residual
        path.append(accepted)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Row j of logits [R, V] is the target's distribution for tokens[j] (R >= len(tokens); extra rows
    are ignored): its log-probability under log_softmax of the raw logits (no temperature / top-k /
    top-p, so finite for greedy requests too) and the `top` most likely tokens, most likely first."""
    n = len(tokens)
    if n == 0:
        return []
    lp = torch.log_softmax(logits[:n].float(), dim=-1)
    chosen = lp.gather(-1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    top = min(top, lp.shape[-1])
    if top <= 0:
        return [TokenLogprob(t, v) for t, v in zip(tokens, chosen, strict=True)]
    values, ids = torch.topk(lp, top, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprob(t, v, tuple(zip(i, tv, strict=True)))
            for t, v, i, tv in zip(tokens, chosen, ids, values, strict=True)]
