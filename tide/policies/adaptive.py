"""Ours: TIDE's latency model as a prior, corrected online per batch bucket, per-request α, probing.

Arms are the uniform draft depths m ∈ {0..Γ} of a step, per batch bucket B (largest power of two
≤ b). Each arm's reward — goodput, tokens per ms — is *predicted* from a model whose prior is the
profile (seed 000 Eq. 3–5 terms) and whose parameters are corrected from every step's feedback:

    G(m) = Σ_i E_i(m) / (κ(B, m+1)·T(b, m+1) + m·κ_d(B)·D(b) + c(L, b)/H)
    E_i(m) = 1 + Σ_{j=1..m} Π_{l≤j} min(α̂_i · r_l, 0.98)

The step plays argmax_m G(m) and then trims each request to the deepest token whose acceptance
probability still pays for its verify cost (Π_{l≤k} α̂_i r_l ≥ G(m)·δ, δ = marginal verify ms per
token of one request): weak requests in a batch draft shallower while good ones go deep. Trimming
stops at depth 1 — a request that stopped drafting would build lag, and catch-up is paid padded
to the largest lag of the batch (c(L_max, b), Nightjar Table 1) when it resumes.

Online corrections (all exponentially forgetting, so they follow drift):
* κ(B, n): measured / profiled verify ms per bucket and tokens-per-sequence (falls back to the
  bucket's mean ratio, then 1); κ_d(B) likewise for draft ms — a stale or wrong profile heals.
  The κ(B, n) of a width not played relaxes toward the bucket's level (`stale_relax` per step),
  so a cost measured in a busy spell cannot keep an arm that is never played again priced wrong.
  κ_c(B) corrects the catch-up cost c(L, b) separately, from the steps whose draft had to catch
  up more than `REGULAR_LAG` rows (their draft ms minus κ_d·γ·D(b)): on the reference CPU the
  engine's catch-up of 23 rows at batch 1 took ≈ 5 ms where the profile measured 0.2 ms, and
  one such step folded into κ_d used to inflate the price of every ordinary draft after it.
  A catch-up step still bounds κ_d from above (its whole draft ms over γ·D(b)): while speculation
  is off, ordinary draft steps never run, and a κ_d inflated by a stall used to keep it off for
  good, learning only from the probes, which all catch up (bench b4 in
  docs/results/adapt, on a Zen 4 guest: 550 s of plain decoding at 0.88x the
  speculative rate). Every κ observation is clipped to
  [1/MAX_CORRECTION, MAX_CORRECTION].
* r_j: the depth-j acceptance relative to the geometric model — accepted tokens at depth j over
  Σ α̂_i of the requests that reached depth j (prior r_j = 1 with 20 pseudo-attempts). EAGLE
  drafts decay with depth; every step informs all depths it reached, so deep levels are learnt
  from any γ ≥ j, not only from playing arm m = j.
* α̂_i: seed 004 Eq. 2 counts of the request's last `history` speculation steps shrunk toward
  the global estimate α̂_g with `prior_weight` pseudo-observations (new requests start at α̂_g);
  the request's own counts fade by `stale_decay` per step it does not speculate, so after an off
  period every request follows α̂_g, which itself ages toward its prior (`AcceptanceEMA`).
* c(L, b): Nightjar's switching cost (catch-up of the largest lag L), amortised over
  `switch_horizon` = 16 steps since one catch-up enables many speculative steps.

Sources of draft tokens (`RequestView.drafter`, per request and step): a drafter may propose from
more than one source, and the engine names the one each request will use before the policy
decides (the hybrid drafter: "ngram" where the request's context repeats its last tokens, a copy
with no forward, else "eagle3", the draft's chain); with `by_match` a copy is keyed by its match
length too (`source_key`: "ngram/1" .. "ngram/3"). Each source has its own α̂_g and r_j, and each
request its own history per source: a copy is accepted at a rate a draft chain is not (HumanEval,
starter draft, γ = 3: accept length 2.32 copying against 1.23 drafting). A copying source costs no
draft step (`tide.telemetry.COPY_SOURCES`), so its requests are priced by verification alone and go deeper. The
step plays one depth per source present, m_s, chosen jointly:

    G(m_s for s) = Σ_i E_i(m_{s_i}) / (T(b, 1 + max_s m_s) + max_{s costly} m_s · κ_d·D(b) + switch)

(padded; unpadded, the verify width is 1 + the mean of the requests' m), searched from the best
uniform depth one source at a time. Catch-up is the costly sources' lag only (a copy does not feed
the draft). With one source this is the formula above.

Trees (EAGLE-2; `trees`, where the drafter grows them: StepContext.trees): for a source that pays
a draft forward, at its chosen depth m, the arms TreeShape(m, tree_topk, m + w) for w in
`tree_extra` are priced as a tree step costs (T_tree(b, N), every sequence padded to the largest
tree's rows, plus D(b) + (m − 1)·D(b·topk) for the levels) and credited with the chain's expected
tokens times a gain learnt per (source, shape) from the tree steps played (emitted over the chain's
E_i(m) at decision time; prior +3 % per extra node, worth a few steps). A tree is played where it
beats the chain by `min_gain`, tried by exploration where it comes within `explore_margin`. Tree
steps teach only the gain: a tree's acceptance is not its chain's, so α̂ and r_j learn from chains.
Where every verified row costs about a decode step (the AVX2 CPUs: docs/results/speculation,
"An AVX2 CPU (Zen 3)") trees never pay and are not played; where rows are nearly free (GPUs) they are.

Padded verification (`padded_verify`, default: the profile's ``meta["verify_padding"]``, which
tide.engine.profiling sets for our engine): when the engine pads every sequence of a verify
forward to the longest draft, a step costs T(b, 1 + max_i γ_i) whatever the others draft. Then
trimming saves nothing and is skipped (every request drafts m), the κ corrections compare with
T(b, 1 + max γ), and a probe drafts for the whole batch (same cost, b samples instead of b/4).

Two guards against the model's own error (docs/results/defaults, runs 8-9): a step drafts only
where the best arm's predicted goodput beats plain decoding by `min_gain` (5 %), and a wider
verify's κ(B, n) never falls below the plain step's κ(B, 1) (the profile's width ratio, measured
back to back, is the floor: each width's κ is learnt at other times and loads).

Exploration: with probability `explore` (2 %) the step plays a neighbour of the best arm so
untried depths/latencies get measured — only a neighbour predicted within `explore_margin` (10 %)
of the best, so a clearly dominated arm (γ > 0 at a compute-bound batch) is never paid for.
No deadlock: after `probe_interval` steps with speculation off everywhere, a quarter of the batch
(rotating, `OffProbe`; all of it when padded) drafts γ = 1 for one step to refresh α̂_g — and α̂_i
of every request leans on α̂_g, so a recovered draft turns speculation back on. The interval
stretches where a probe is dear: to at least (predicted probe-step ms / plain-step ms − 1) /
`probe_budget`, so probing costs ≤ 1 % of throughput (at b = 16 on our CPU a γ = 1 step costs
≈ 1.5 plain steps: one probe per ≈ 50 off steps instead of 24).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from itertools import accumulate

from tide.policies.base import Action, Estimate, RequestView, StepContext, StepFeedback, TreeShape
from tide.policies.costs import MIN_GAIN
from tide.policies.estimators import (
    ALPHA_CAP,
    AcceptanceEMA,
    History,
    OffProbe,
    RequestStates,
    batch_bucket,
)
from tide.policies.profile import LatencyProfile
from tide.telemetry import COPY_SOURCES

_DEPTH_PRIOR = 20.0  # pseudo-attempts behind r_j = 1: a few steps' evidence before trusting r_j
# Lags up to this are ordinary drafting (the previous step's bonus and accepted rows, ≤ γ + 1):
# their cost is in D(b) and κ_d. Longer lags are catch-ups after speculation was off (κ_c).
REGULAR_LAG = 4
# A κ observation is clipped to [1/16, 16] × the profile. The profile was measured on this machine,
# so a step 16× off it is a stall (the process descheduled, a collector pause, another thread holding
# the GIL), not a new cost; unclipped, one such step could lift κ_d past speculation's break-even.
MAX_CORRECTION = 16.0
# A tree's expected tokens before it has run: its chain's times (1 + TREE_GAIN_PRIOR · extra nodes),
# worth TREE_PRIOR_TOKENS of its chains' expected tokens as evidence (a few steps). Measured on the
# starter draft, held-out mix, batch 1: the EAGLE-3 draft's tree of depth 3 with 1 node more than its
# chain accepted 1.53 against 1.44 (+6 %), depth 4 with 3 more 1.60 against 1.47 (+9 %)
# (docs/results/speculation, "An AVX2 CPU (Zen 3)").
TREE_GAIN_PRIOR = 0.03
TREE_PRIOR_TOKENS = 16.0


def source_key(view: RequestView) -> str:
    """The source a request's drafts come from this step, as the policy keeps state for it: the
    drafter's source, and for a copy the length of its match ("ngram/3"): on the held-out mix a
    copy from a 1-token match was accepted 0.71 drafts of 5, from a 3-token match 2.67."""
    return f"{view.drafter}/{view.match}" if view.match > 0 else view.drafter


def is_free(key: str) -> bool:
    """A source that takes no draft forward (a copy), whatever its match length."""
    return key.split("/", 1)[0] in COPY_SOURCES


class _ReqState:
    __slots__ = ("hists", "h", "off")

    def __init__(self, h: int) -> None:
        self.h = h
        self.hists: dict[str, History] = {}  # per source of the request's drafts
        self.off = 0  # consecutive steps without speculating

    def hist(self, source: str) -> History:
        got = self.hists.get(source)
        if got is None:
            got = self.hists[source] = History(self.h)
        return got


class _SourceState:
    """What is learnt of one source of draft tokens: its global α̂_g and depth ratios r_j
    (depth j → [accepted tokens, Σ α̂ of attempts], index 0 unused)."""

    def __init__(self, alpha_decay: float, alpha_prior: float, max_gamma: int) -> None:
        self.alpha = AcceptanceEMA(decay=alpha_decay, prior=alpha_prior)
        self.depth = [[_DEPTH_PRIOR, _DEPTH_PRIOR] for _ in range(max_gamma + 1)]

    def depth_ratio(self, j: int) -> float:
        acc, expected = self.depth[j]
        return acc / expected if expected > 0 else 1.0

    def reset(self) -> None:
        self.alpha.reset()
        self.depth = [[_DEPTH_PRIOR, _DEPTH_PRIOR] for _ in self.depth]


class AdaptivePolicy:
    """Model-prior goodput maximiser with online corrections, per-request trimming and probing."""

    def __init__(
        self,
        profile: LatencyProfile,
        max_gamma: int = 8,
        # At batch 1 both α̂_i and α̂_g see only the one running request: with 8 steps of history,
        # 4 pseudo-observations and α̂_g over ≈ 20 steps, a run of 6 rejections (26 % likely at
        # α = 0.2, above the break-even 0.15 of the reference CPU) switched speculation off, and
        # adaptive ran at 0.91x static-1 over 30 s at batch 1; with 16 / 8 / ≈ 200 steps, 1.02x
        # (docs/results/policies, Intel AMX guest, "Estimator settings"). α̂_g still follows a
        # shift within ≈ 200 steps.
        history: int = 16,
        prior_weight: float = 8.0,
        alpha_decay: float = 0.995,
        alpha_prior: float = 0.5,
        stale_decay: float = 0.95,
        correction_decay: float = 0.95,
        stale_relax: float = 0.99,
        depth_decay: float = 0.995,
        switch_horizon: float = 16.0,
        explore: float = 0.02,
        probe_interval: int = 24,
        probe_fraction: float = 0.25,
        probe_budget: float = 0.01,
        explore_margin: float = 0.1,
        padded_verify: bool | None = None,
        # Speculate only where the predicted goodput beats plain decoding by this fraction. Near
        # break-even the prediction's error decides: served through the gateway at 4 streams, the
        # policy drafted at accept length 1.2-1.5 in half the phases and ran 0.97-1.0x plain
        # (docs/results/defaults, run 7); a gain under 5 % is not worth that risk.
        min_gain: float = MIN_GAIN,
        # False: one estimate and one depth for every request whatever its source (the policy before
        # sources were told apart; the ablation in benchmarks/experiments/lookup_ab.py).
        per_source: bool = True,
        # True: a copy's state is split by its match length too (`source_key`). Measured at batch 1
        # on the held-out mix: 1.47x plain against 1.53x unsplit (docs/results/speculation, Ice Lake
        # server): the split halves each copy state's evidence and did not pay; off.
        by_match: bool = False,
        # EAGLE-2 trees for a source that pays a draft forward, where the drafter grows them
        # (StepContext.trees): at a source's chosen depth m, TreeShape(m, tree_topk, m + w) for each w
        # in tree_extra is priced (T_tree(b, N) + D(b) + (m - 1) D(b · topk)) against the chain, its
        # tokens the chain's times a gain learnt from the tree steps played. () or trees=False: chains.
        trees: bool = True,
        tree_topk: int = 2,
        tree_extra: tuple[int, ...] = (1, 3),
        # The deepest chain of a free source whose proposal length is known (a recall from the
        # speculation memory, RequestView.limit), where the engine allows it (StepContext.max_recall_gamma).
        max_recall_gamma: int = 32,
        seed: int = 0,
    ) -> None:
        self.name = "adaptive"
        self.profile = profile
        self.max_gamma = max_gamma
        self.max_recall_gamma = max_recall_gamma
        self.history = history
        self.prior_weight = prior_weight
        self.stale_decay = stale_decay
        self.decay = correction_decay
        self.stale_relax = stale_relax
        self.depth_decay = depth_decay
        self.switch_horizon = switch_horizon
        self.explore = explore
        self.probe = OffProbe(probe_interval, fraction=probe_fraction)
        self.probe_budget = probe_budget
        self.explore_margin = explore_margin
        self.min_gain = min_gain
        self.padded = bool(profile.meta.get("verify_padding", False)) if padded_verify is None else padded_verify
        self.rng = random.Random(seed)
        self.alpha_decay, self.alpha_prior = alpha_decay, alpha_prior
        self.per_source, self.by_match = per_source, by_match
        self.trees, self.tree_topk, self.tree_extra = trees, tree_topk, tuple(tree_extra)
        # (source, shape) -> [tokens emitted, tokens its chain was expected to emit], fading per step played
        self.tree_gain: dict[tuple[str, TreeShape], list[float]] = {}
        self.sources: dict[str, _SourceState] = {}  # by RequestView.drafter; see `source`
        self.requests: RequestStates[_ReqState] = RequestStates()
        self.kv: dict[tuple[int, int], float] = {}
        self.kv_bucket: dict[int, float] = {}  # fallback for n not measured yet in the bucket
        self.kd: dict[int, float] = {}
        self.kc: dict[int, float] = {}  # measured / profiled catch-up ms per batch bucket
        self._pending: dict | None = None

    def draft_changed(self) -> None:
        """A hot swap: α̂_g, the requests' histories and the depth ratios restart from their priors, so
        the new draft is judged on its own steps. Kept, they described the old draft for hundreds of
        steps — and where that draft had switched speculation off, only the rare probes could
        show that the new one pays. The κ latency corrections stay (same target, same engine)."""
        for src in self.sources.values():
            src.reset()
        self.tree_gain = {}
        self.requests = RequestStates()

    def source(self, name: str = "none") -> _SourceState:
        """The state learnt for one source of draft tokens (RequestView.drafter), made on first use."""
        got = self.sources.get(name)
        if got is None:
            got = self.sources[name] = _SourceState(self.alpha_decay, self.alpha_prior,
                                                    max(self.max_gamma, self.max_recall_gamma))
        return got

    # ------------------------------------------------------------------ estimates
    def request_alpha(self, st: _ReqState, alpha_g: float, source: str = "none") -> float:
        s, f = st.hist(source).counts()
        fade = self.stale_decay**st.off
        w = self.prior_weight
        return min((fade * s + w * alpha_g) / (fade * (s + f) + w), ALPHA_CAP)

    def depth_ratio(self, j: int, source: str = "none") -> float:
        return self.source(source).depth_ratio(j)

    def accept_chain(self, alpha: float, m: int, ratios: list[float] | None = None) -> list[float]:
        """P(depth 1..k all accepted) for k = 0..m (index 0 = 1.0, the bonus token)."""
        ratios = ratios or [self.depth_ratio(j) for j in range(1, m + 1)]
        out, p = [1.0], 1.0
        for r in ratios[:m]:
            p *= min(alpha * r, ALPHA_CAP)
            out.append(p)
        return out

    def catchup_ratio(self, bucket: int) -> float:
        return self.kc.get(bucket, 1.0)

    def verify_ratio(self, bucket: int, n: int) -> float:
        got = self.kv.get((bucket, n))
        return got if got is not None else self.kv_bucket.get(bucket, 1.0)

    def _ema(self, table: dict, key, value: float) -> None:
        value = min(max(value, 1.0 / MAX_CORRECTION), MAX_CORRECTION)
        old = table.get(key)
        table[key] = value if old is None else self.decay * old + (1 - self.decay) * value

    def estimates(self) -> list[Estimate]:
        """α̂_g, the depth ratios r_j, and the κ corrections per batch bucket; a bucket without an
        observation yet has none (the profile is taken as it is there). Exported by the worker
        (`tide_inference_policy_estimate`)."""
        out = []
        fresh = [("none", _SourceState(self.alpha_decay, self.alpha_prior, self.max_gamma))]  # nothing seen yet
        for name, src in sorted(self.sources.items()) or fresh:
            # One source (a single drafter): the scopes as before; several: each names its source.
            tag = "" if len(self.sources) == 1 else f"source={name}"
            out.append(Estimate("alpha_global", src.alpha.value, tag))
            out += [Estimate("depth_ratio", src.depth_ratio(j), ",".join(filter(None, (tag, f"depth={j}"))))
                    for j in range(1, self.max_gamma + 1)]
        out += [Estimate("tree_gain", self.tree_gain_of(source, shape), f"source={source},shape={shape.key()}")
                for source, shape in sorted(self.tree_gain, key=lambda k: (k[0], k[1].key()))]
        out += [Estimate("kappa_verify", v, f"batch={b},tokens={n}") for (b, n), v in sorted(self.kv.items())]
        for name, table in (("kappa_draft", self.kd), ("kappa_catchup", self.kc)):
            out += [Estimate(name, v, f"batch={b}") for b, v in sorted(table.items())]
        return out

    # ------------------------------------------------------------------ decide
    def decide(self, ctx: StepContext) -> list[Action]:
        hists = self.requests.begin(ctx, lambda r: _ReqState(self.history))
        n, b = len(hists), ctx.batch_size
        gmax = min(self.max_gamma, ctx.max_gamma)
        self._pending = None
        if n == 0 or gmax <= 0:
            return [0] * n
        names = [(source_key(r) if self.by_match else r.drafter) if self.per_source else "none" for r in ctx.requests]
        kinds = sorted(set(names))  # the sources present, each with its own depth m_s
        # Each request's deepest chain: γmax, or for a free source of known length (a recall) that
        # length, up to the recall cap; each source's cap is its requests' deepest.
        rmax = max(min(self.max_recall_gamma, ctx.max_recall_gamma), gmax)
        lims = [min(r.limit, rmax) if r.limit > 0 and is_free(s) else gmax
                for r, s in zip(ctx.requests, names, strict=True)]
        caps = {s: max(lim for lim, name in zip(lims, names, strict=True) if name == s) for s in kinds}
        # α̂_i on a 0.005 grid: requests share chains, keeping decide O(#distinct (source, α, limit) · Γ)
        alphas = [round(self.request_alpha(h, self.source(s).alpha.value, s) * 200.0) / 200.0
                  for h, s in zip(hists, names, strict=True)]
        groups = Counter(zip(names, alphas, lims, strict=True))
        ratios = {s: [self.depth_ratio(j, s) for j in range(1, caps[s] + 1)] for s in kinds}
        chains = {(s, a, lim): self.accept_chain(a, lim, ratios[s]) for s, a, lim in groups}
        cum = {key: list(accumulate(ch)) for key, ch in chains.items()}  # E_i(m), tokens, m ≤ its limit
        bucket = batch_bucket(b)
        # A wider verify is never cheaper, relative to the profile, than a plain step: each width's κ is
        # learnt from the steps that played it, at other times and loads, and at batch 2 on the reference
        # CPU a slow spell of plain steps left κ(2, 1) = 1.92 over κ(2, 2) = 1.56, which priced a 2-token
        # verify below a plain step and kept the default stack drafting at a loss (docs/results/defaults,
        # run 8). The profile's own width ratio, measured back to back, is the floor.
        plain_ratio = self.verify_ratio(bucket, 1)

        widths: dict[float, float] = {}

        def verify_ms(width: float) -> float:  # tokens a sequence; memoised: arms share widths
            got = widths.get(width)
            if got is None:
                got = widths[width] = (max(self.verify_ratio(bucket, round(width)), plain_ratio)
                                       * self.profile.target_ms(b, width))
            return got

        d = self.kd.get(bucket, 1.0) * self.profile.draft_ms(b)
        costly = [s for s in kinds if not is_free(s)]
        lag = max((r.lag for r, s in zip(ctx.requests, names, strict=True) if not is_free(s)), default=0)
        switch = self.catchup_ratio(bucket) * self.profile.catchup_ms(lag, b) / self.switch_horizon if lag > 0 else 0.0
        # Expected tokens (and drafted rows) of each source's requests at each depth: an arm's total
        # is one sum. A request drafts no deeper than its limit.
        tokens_at = {s: [sum(c * cum[(src, a, lim)][min(m, lim)] for (src, a, lim), c in groups.items() if src == s)
                         for m in range(caps[s] + 1)] for s in kinds}
        rows_at = {s: [sum(c * min(m, lim) for (src, _, lim), c in groups.items() if src == s)
                       for m in range(caps[s] + 1)] for s in kinds}
        paid = [k for k, s in enumerate(kinds) if s in costly]
        cap = [caps[s] for s in kinds]

        def goodput(depths: tuple[int, ...]) -> float:
            pairs = tuple(zip(kinds, depths, strict=True))
            tokens = sum(tokens_at[s][m] for s, m in pairs)
            width = 1 + (max(depths) if self.padded else sum(rows_at[s][m] for s, m in pairs) / b)
            drafted = max((depths[k] for k in paid), default=0)
            return tokens / (verify_ms(width) + drafted * d + (switch if drafted else 0.0))

        arms: dict[tuple[int, ...], float] = {}

        def value(depths: tuple[int, ...]) -> float:
            got = arms.get(depths)
            if got is None:
                got = arms[depths] = goodput(depths)
            return got

        # The best uniform depth, then each source's depth in turn with the others held (twice):
        # ~(1 + 2k)(Γ + 1) arms for k sources where trying every combination is (Γ + 1)^k (a batch
        # may hold the draft and copies of three match lengths: 6,561 arms at Γ = 8).
        k_sources = len(kinds)
        off = (0,) * k_sources
        best = max((tuple(min(m, c) for c in cap) for m in range(max(cap) + 1)), key=value)
        for _ in range(2 if k_sources > 1 else 0):
            for k in range(k_sources):
                best = max((best[:k] + (m,) + best[k + 1:] for m in range(cap[k] + 1)), key=value)
        if value(best) < (1 + self.min_gain) * value(off):
            best = off  # a predicted gain within the model's error: drafting would as likely lose

        def tree_arms(depths: tuple[int, ...]) -> dict[tuple[str, TreeShape], float]:
            """Goodput of growing one costly source's requests a tree at its depth in `depths`
            (a tree step verifies every sequence padded to its rows: ModelRunner.run_tree)."""
            if not (self.trees and ctx.trees and self.tree_extra) or depths == off:
                return {}
            out = {}
            for k in paid:
                s, m = kinds[k], depths[k]
                if m < 1:
                    continue
                others = [depths[j] for j in range(k_sources) if j != k]
                tokens = sum(tokens_at[kinds[j]][depths[j]] for j in range(k_sources) if j != k)
                chain_draft = max((depths[j] for j in paid if j != k), default=0) * d
                for w in self.tree_extra:
                    shape = TreeShape(m, self.tree_topk, m + w)
                    if shape.tokens > shape.drafted:
                        continue
                    rows = max(shape.tokens + 1, 1 + max(others, default=0))
                    verify = (max(self.verify_ratio(bucket, rows), plain_ratio)
                              * self.profile.tree_target_ms(b, rows - 1))
                    grow = self.kd.get(bucket, 1.0) * (self.profile.draft_ms(b)
                                                       + (m - 1) * self.profile.draft_ms(b * self.tree_topk))
                    got = tokens + tokens_at[s][m] * self.tree_gain_of(s, shape)
                    out[(s, shape)] = got / (verify + chain_draft + grow + switch)
            return out

        trees = tree_arms(best)
        tree = max(trees, key=trees.get) if trees else None
        if tree is not None and trees[tree] < (1 + self.min_gain) * value(best):
            tree = None  # as for drafting at all: a gain within the model's error is no reason (exploration tries it)
        if self.explore > 0 and self.rng.random() < self.explore:
            top = trees[tree] if tree is not None else value(best)
            floor = (1 - self.explore_margin) * top
            steps = [best[:k] + (best[k] + step,) + best[k + 1:] for k in range(k_sources) for step in (-1, 1)
                     if 0 <= best[k] + step <= cap[k]]
            near = [(arm, None) for arm in steps if value(arm) >= floor]
            near += [(best, t) for t, v in trees.items() if t != tree and v >= floor]
            if tree is not None:
                near.append((best, None))  # the chain the tree beat
            best, tree = self.rng.choice(near) if near else (best, tree)
        depth = dict(zip(kinds, best, strict=True))

        if best == off:
            gammas = [0] * n
            if self._probe_due(b, n, verify_ms(1), d, switch):
                for i in range(n) if self.padded else self.probe.pick(n):
                    gammas[i] = 1
        elif self.padded:  # the step costs T(b, 1 + max m) whoever drafts less: trimming only loses tokens
            gammas = [min(depth[s], lim) for s, lim in zip(names, lims, strict=True)]
        else:
            gammas = []
            for s, a, lim in zip(names, alphas, lims, strict=True):
                ch, k = chains[(s, a, lim)], min(depth[s], lim)
                if k > 1:  # δ: ms per extra verified token of one request at this source's depth
                    delta = max(verify_ms(1 + k) - verify_ms(k), 0.0) / b
                    while k > 1 and ch[k] < value(best) * delta:
                        k -= 1
                gammas.append(k)
        actions: list[Action] = list(gammas)
        expected = [0.0] * n
        if tree is not None:  # the source's requests grow the tree at its depth, untrimmed
            src, shape = tree
            for i, (s, a, lim) in enumerate(zip(names, alphas, lims, strict=True)):
                if s == src:
                    gammas[i], actions[i] = shape.depth, shape
                    expected[i] = cum[(s, a, lim)][shape.depth]
        self._pending = {"lags": [r.lag for r in ctx.requests], "alphas": alphas, "gammas": gammas,
                         "sources": names, "expected": expected}
        return actions

    def tree_gain_of(self, source: str, shape: TreeShape) -> float:
        """Tokens a step of `shape` emits over what its chain of the same depth was expected to
        (E_i(depth) at decision time), learnt from the tree steps played, on top of a prior."""
        prior = TREE_PRIOR_TOKENS * (1.0 + TREE_GAIN_PRIOR * (shape.tokens - shape.depth))
        got, expected = self.tree_gain.get((source, shape), (0.0, 0.0))
        return (got + prior) / (expected + TREE_PRIOR_TOKENS)

    def _probe_due(self, b: int, n: int, plain_ms: float, d: float, switch: float) -> bool:
        """Off for long enough that a probe step fits `probe_budget` (see the module docstring)."""
        if self.probe.interval <= 0:
            return False
        k = n if self.padded else min(n, max(self.probe.requests, math.ceil(n * self.probe.fraction)))
        probe_ms = self.verify_ratio(batch_bucket(b), 2) * self.profile.target_ms(b, 2 if self.padded else 1 + k / b)
        extra = max(probe_ms + d + switch * self.switch_horizon - plain_ms, 0.0) / plain_ms if plain_ms > 0 else 0.0
        need = extra / self.probe_budget if self.probe_budget > 0 else 0.0
        return self.probe.off_steps >= max(self.probe.interval, need)

    def verify_n(self, b: int, gammas: tuple[int, ...]) -> float:
        """Tokens per sequence the verify forward costs: 1 + max γ when padded, else 1 + mean γ."""
        return 1 + (max(gammas, default=0) if self.padded else sum(gammas) / b)

    def raw_times(self, b: int, gammas: tuple[int, ...], lags: list[int],
                  sources: list[str] | None = None, shapes=()) -> tuple[float, float, float]:
        """Uncorrected profile (verify ms, draft ms, catch-up ms) for the γs the engine actually ran;
        the catch-up is 0 unless a drafting request lagged more than REGULAR_LAG rows (the draft ms
        then holds the ordinary catch-up, as D(b) was profiled). Requests of a free source (a copy)
        add neither. With trees (`shapes`, per request or ()), the step verified every sequence
        padded to the largest tree's rows, and the trees' levels drafted beside the chains."""
        paid = [not is_free(s) for s in sources] if sources is not None else [True] * len(gammas)
        grown = [sh for sh in shapes if sh is not None]
        chained = [g if (not shapes or shapes[i] is None) else 0 for i, g in enumerate(gammas)]
        spec = [lag for lag, g, p in zip(lags, gammas, paid, strict=False) if g > 0 and p]
        draft = max((g for g, p in zip(chained, paid, strict=False) if p), default=0) * self.profile.draft_ms(b)
        if grown:
            top = max(grown, key=lambda sh: sh.depth)
            draft += self.profile.draft_ms(b) + (top.depth - 1) * self.profile.draft_ms(b * top.topk)
        catchup = self.profile.catchup_ms(max(spec), len(spec)) if spec and max(spec) > 0 else 0.0
        if spec and max(spec) <= REGULAR_LAG:
            draft, catchup = draft + catchup, 0.0
        if grown:
            rows = max(max(sh.tokens for sh in grown) + 1, 1 + max(chained, default=0))
            return self.profile.tree_target_ms(b, rows - 1), draft, catchup
        return self.profile.target_ms(b, self.verify_n(b, gammas)), draft, catchup

    # ------------------------------------------------------------------ observe
    def observe(self, feedback: StepFeedback) -> None:
        states = self.requests.take(len(feedback.gammas))
        p, self._pending = self._pending, None
        asked = self.asked(p["gammas"] if p is not None else (), feedback.gammas)
        names = p["sources"] if p is not None and len(p["sources"]) == len(asked) else ["none"] * len(asked)
        shapes = feedback.shapes if len(feedback.shapes) == len(asked) else (None,) * len(asked)
        # A tree's acceptance is not its chain's: tree steps teach the tree's gain, chains the rest.
        chain = [sh is None for sh in shapes]
        for st, s, g, v, c in zip(states, names, asked, feedback.accepted, chain, strict=False):
            if c:
                st.hist(s).add(g, v)
            st.off = 0 if g > 0 else st.off + 1
        for s in set(names) | set(self.sources):  # every source ages each step, drafting or not
            mine = [(g, v) for name, g, v, c in zip(names, asked, feedback.accepted, chain, strict=False)
                    if name == s and c]
            self.source(s).alpha.update([g for g, _ in mine], [v for _, v in mine])
        self.probe.record(asked)
        b = feedback.batch_size
        if p is None or not states or b <= 0:
            return
        self._learn_tree_gains(names, shapes, feedback.accepted, p.get("expected", ()))
        bucket = batch_bucket(b)
        verify, draft, catchup = self.raw_times(b, feedback.gammas, p["lags"], names, shapes)
        if feedback.verify_ms > 0 and verify > 0:
            ratio = feedback.verify_ms / verify
            grown = [sh.tokens + 1 for sh in shapes if sh is not None]
            played = max(max(grown), 1 + max(feedback.gammas)) if grown else round(self.verify_n(b, feedback.gammas))
            self._ema(self.kv, (bucket, played), ratio)
            self._ema(self.kv_bucket, bucket, ratio)
            self._relax_unplayed(bucket, played)
        if feedback.draft_ms > 0 and catchup > 0:  # a catch-up step: what the ordinary draft leaves
            if draft > 0:  # its whole draft time bounds the ordinary part: a κ_d above is wrong
                bound = max(feedback.draft_ms / draft, 1.0 / MAX_CORRECTION)
                self.kd[bucket] = min(self.kd.get(bucket, 1.0), bound)
            extra = max(feedback.draft_ms - self.kd.get(bucket, 1.0) * draft, 0.0)
            self._ema(self.kc, bucket, extra / catchup)
        elif feedback.draft_ms > 0 and draft > 0:
            self._ema(self.kd, bucket, feedback.draft_ms / draft)
        for s in set(names):
            rows = [(a, g, v) for name, a, g, v, c in zip(names, p["alphas"], asked, feedback.accepted, chain,
                                                           strict=False) if name == s and c]
            if rows:
                self._learn_depths(self.source(s).depth, *map(tuple, zip(*rows, strict=True)))

    def _learn_tree_gains(self, names: list[str], shapes, accepted: tuple[int, ...], expected) -> None:
        """Per (source, shape) played this step: tokens emitted against the chain's expectation."""
        played: dict[tuple[str, TreeShape], list[float]] = {}
        for s, shape, v, e in zip(names, shapes, accepted, expected, strict=False):
            if shape is not None and e > 0:
                row = played.setdefault((s, shape), [0.0, 0.0])
                row[0] += v + 1
                row[1] += e
        for key, (got, exp) in played.items():
            old = self.tree_gain.get(key, [0.0, 0.0])
            self.tree_gain[key] = [self.depth_decay * old[0] + got, self.depth_decay * old[1] + exp]

    @staticmethod
    def asked(decided, ran: tuple[int, ...]) -> tuple[int, ...]:
        """Per request, the γ this policy asked for where it asked for one, else the γ that ran.

        Acceptance is learnt per *decision*: a drafter that proposes fewer tokens than asked (the
        n-gram drafter finds no match for ≈ half the rows on our prompt mix) yields a failure at
        the depth where it stopped, because the padded verify step is paid all the same; counting
        only the drafted tokens would overrate α and switch speculation on where it loses."""
        if len(decided) != len(ran):
            return ran
        return tuple(a if a > 0 else g for a, g in zip(decided, ran, strict=True))

    def _relax_unplayed(self, bucket: int, played: int) -> None:
        """κ(B, n) of the verify widths this step did not play drift toward the bucket's level κ(B)
        (`stale_relax` per step of the bucket). Learnt only from the width played, the κ of an arm not
        played stays whatever it was when last played: in bench b6
        (docs/results/adapt, on a Zen 3 guest) a spell of slow plain steps left κ(2, 1)
        at 1.97 while speculating steps ran at 1.3, and the policy kept drafting at α̂ ≈ 0.19, below
        break-even, for 600 s: plain decoding looked 1.5x dearer than it was and was never tried
        again to find out."""
        level = self.kv_bucket[bucket]
        for key, v in self.kv.items():
            if key[0] == bucket and key[1] != played:
                self.kv[key] = v + (1 - self.stale_relax) * (level - v)

    def _learn_depths(self, depth: list[list[float]], alphas: tuple[float, ...], gammas: tuple[int, ...],
                      accepted: tuple[int, ...]) -> None:
        touched = False
        for a, g, v in zip(alphas, gammas, accepted, strict=False):
            if g <= 0:
                continue
            if not touched:
                for row in depth:
                    row[0] *= self.depth_decay
                    row[1] *= self.depth_decay
                touched = True
            for j in range(1, min(v + 1, g) + 1):  # depths reached: accepted ones + the rejected one
                if j < len(depth):
                    depth[j][0] += 1.0 if j <= v else 0.0
                    depth[j][1] += a
