"""Profiled latency tables: target forward T(b, n), draft step D(b), catch-up cost c(lag, b).

Units: every latency is in milliseconds. `b` is the number of sequences in the batch, `n` the
number of tokens *per sequence* in one target forward (γ + 1 when verifying γ drafted tokens),
`lag` the number of tokens a request's draft has not yet seen target features for.

Interpolation is piecewise linear (in b, in n, in lag), with linear extrapolation past the last
measured point. Why not log-linear: forward latency is affine in the token count on both sides
of the roofline knee (flat where memory/overhead-bound, a straight line once compute-bound), so
piecewise linear reproduces a measured roofline exactly, while interpolating in log n bends the
compute-bound line and under-predicts between widely spaced points (e.g. n = 4 → 8). Slopes used
for extrapolation are clamped at ≥ 0: a forward never gets cheaper with more tokens.

Two table shapes are accepted, as JSON too:
  * ``T_ms`` = ``{batch: {n: ms}}`` (what the engine benchmark writes; n per sequence);
  * ``T_total_ms`` = ``{N: ms}`` with N = b·n total tokens in the forward (TIDE Table 5's shape,
    seed 000 Eq. 3 writes T(b(γ+1))); used only when ``T_ms`` is empty.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LatencyProfile", "interp1", "synthetic_profile"]


def interp1(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y(x) through sorted `points`; linear extrapolation, slopes clamped ≥ 0."""
    return _Curve(points)(x)


class _Curve:
    """A sorted piecewise-linear curve with its x's precomputed (lookups are on the step path)."""

    __slots__ = ("xs", "ys")

    def __init__(self, points: list[tuple[float, float]]) -> None:
        if not points:
            raise ValueError("no points to interpolate")
        self.xs = [float(p[0]) for p in points]
        self.ys = [float(p[1]) for p in points]

    def segment(self, x: float) -> int:
        """Index i of the segment (i, i+1) used for x (first/last one when outside the range)."""
        i = bisect.bisect_right(self.xs, x)
        return min(max(i - 1, 0), len(self.xs) - 2)

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0]
        i = self.segment(x)
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        slope = (y1 - y0) / (x1 - x0)
        if x < x0 or x > x1:  # extrapolating: never let latency fall with more work
            anchor_x, anchor_y = (x0, y0) if x < x0 else (x1, y1)
            return max(anchor_y + max(slope, 0.0) * (x - anchor_x), 0.0)
        return y0 + slope * (x - x0)


class _Grid:
    """f(b, n) on a ragged grid: interpolate the two bracketing batch rows in n, then in b."""

    def __init__(self, table: Mapping[int, Mapping[int, float]]) -> None:
        rows = sorted(table.items())
        self.bs = _Curve([(float(b), 0.0) for b, _ in rows]) if len(rows) > 1 else None
        self.rows = [(float(b), _Curve(sorted((float(n), float(v)) for n, v in row.items()))) for b, row in rows]

    def __call__(self, b: float, n: float) -> float:
        if self.bs is None:
            return self.rows[0][1](n)
        i = self.bs.segment(b)
        (b0, r0), (b1, r1) = self.rows[i], self.rows[i + 1]
        return _Curve([(b0, r0(n)), (b1, r1(n))])(b)


def _int_keys(d: Mapping[Any, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in d.items()}


@dataclass
class LatencyProfile:
    """Latency tables of one target + draft pair on one machine (all values in ms).

    ``D_ms`` missing → D(b) = D0 for every b (seed 000 §4.1: draft latency is dominated by
    launch overhead and roughly independent of batch size). ``C_ms`` (``{batch: {lag: ms}}``,
    Nightjar Table 1's c_prefill(L_max, B)) missing → c(lag, b) = D(b) + catchup_ms_per_token·b·lag,
    one draft forward over the b·lag lagging tokens.
    """

    T_ms: dict[int, dict[int, float]] = field(default_factory=dict)
    D0_ms: float = 0.0
    D_ms: dict[int, float] = field(default_factory=dict)
    C_ms: dict[int, dict[int, float]] = field(default_factory=dict)
    T_total_ms: dict[int, float] = field(default_factory=dict)
    catchup_ms_per_token: float = 0.0
    prefill_ms_per_token: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    # T_tree(b, N): one tree-verification forward over b sequences × a tree of N draft nodes each
    # (N + 1 rows; tide.engine.model_runner.run_tree). Missing → T(b, N + 1).
    tree_ms: dict[int, dict[int, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.T_ms and not self.T_total_ms:
            raise ValueError("a LatencyProfile needs T_ms or T_total_ms")
        self._t = _Grid(self.T_ms) if self.T_ms else None
        self._t_total = _Curve(sorted(self.T_total_ms.items())) if self.T_total_ms else None
        self._d = _Curve(sorted(self.D_ms.items())) if self.D_ms else None
        self._c = _Grid(self.C_ms) if self.C_ms else None
        self._tree = _Grid(self.tree_ms) if self.tree_ms else None
        self._t_cache: dict[tuple[float, float], float] = {}

    # ---------------------------------------------------------------- lookups (ms)
    def target_ms(self, b: float, n: float) -> float:
        """T(b, n): one target forward over b sequences × n tokens each (n may be fractional)."""
        key = (b, n)
        got = self._t_cache.get(key)
        if got is None:
            got = self._t(b, n) if self._t is not None else self._t_total(b * n)
            if len(self._t_cache) > 65536:  # fractional n from mixed γ: keep the memo bounded
                self._t_cache.clear()
            self._t_cache[key] = got
        return got

    def draft_ms(self, b: float) -> float:
        """D(b): one draft step (one token for each of b sequences)."""
        return self._d(b) if self._d is not None else self.D0_ms

    def catchup_ms(self, lag: float, b: float) -> float:
        """c(lag, b): feed b sequences' `lag` missed tokens to the draft when speculation resumes."""
        if lag <= 0 or b <= 0:
            return 0.0
        if self._c is not None:
            return self._c(b, lag)
        return self.draft_ms(b) + self.catchup_ms_per_token * b * lag

    def step_ms(self, b: float, gamma: float, lag: float = 0.0) -> float:
        """One draft+verify step at uniform γ: T(b, γ+1) + γ·D(b) + c(lag, b) (seed 000 Eq. 3)."""
        extra = self.catchup_ms(lag, b) if gamma > 0 else 0.0
        return self.target_ms(b, gamma + 1) + gamma * self.draft_ms(b) + extra

    def tree_target_ms(self, b: float, nodes: float) -> float:
        """T_tree(b, N): verify b trees of N draft nodes each in one forward."""
        return self._tree(b, nodes) if self._tree is not None else self.target_ms(b, nodes + 1)

    def tree_step_ms(self, b: float, depth: int, topk: int, nodes: int, lag: float = 0.0) -> float:
        """One tree draft+verify step: T_tree(b, N) + the draft's levels. Level 1 comes from the
        extend every step pays, D(b), as a chain's first draft token does (step_ms's γ·D(b));
        each further level is one draft step over the b·topk frontier rows, D(b·topk)."""
        return (self.tree_target_ms(b, nodes) + self.draft_ms(b) + (depth - 1) * self.draft_ms(b * topk)
                + self.catchup_ms(lag, b))

    def prefill_ms(self, tokens: int) -> float:
        return self.prefill_ms_per_token * tokens

    @property
    def batches(self) -> list[int]:
        """Measured batch sizes (for T_total-only profiles, powers of two up to N_max)."""
        if self.T_ms:
            return sorted(self.T_ms)
        top = int(max(self.T_total_ms))
        return [1 << k for k in range(int(math.log2(top)) + 1)]

    # ---------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"D0_ms": self.D0_ms}
        if self.T_ms:
            out["T_ms"] = {str(b): {str(n): v for n, v in row.items()} for b, row in self.T_ms.items()}
        if self.T_total_ms:
            out["T_total_ms"] = {str(n): v for n, v in self.T_total_ms.items()}
        if self.D_ms:
            out["D_ms"] = {str(b): v for b, v in self.D_ms.items()}
        if self.C_ms:
            out["C_ms"] = {str(b): {str(k): v for k, v in row.items()} for b, row in self.C_ms.items()}
        if self.tree_ms:
            out["tree_ms"] = {str(b): {str(n): v for n, v in row.items()} for b, row in self.tree_ms.items()}
        out["catchup_ms_per_token"] = self.catchup_ms_per_token
        out["prefill_ms_per_token"] = self.prefill_ms_per_token
        if self.meta:
            out["meta"] = self.meta
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LatencyProfile:
        """Accepts the engine benchmark's ``{"T_ms": {b: {n: ms}}, "D0_ms": x}`` and the full shape."""
        t = {b: {int(n): float(v) for n, v in row.items()} for b, row in _int_keys(data.get("T_ms", {})).items()}
        c = {b: {int(k): float(v) for k, v in row.items()} for b, row in _int_keys(data.get("C_ms", {})).items()}
        d0 = data.get("D0_ms")
        d_tab = {b: float(v) for b, v in _int_keys(data.get("D_ms", {})).items()}
        if d0 is None:
            if 1 not in d_tab:
                raise ValueError("profile needs D0_ms (or D_ms with batch 1)")
            d0 = d_tab[1]
        return cls(
            T_ms=t,
            D0_ms=float(d0),
            D_ms=d_tab,
            C_ms=c,
            T_total_ms={n: float(v) for n, v in _int_keys(data.get("T_total_ms", {})).items()},
            catchup_ms_per_token=float(data.get("catchup_ms_per_token", 0.0)),
            prefill_ms_per_token=float(data.get("prefill_ms_per_token", 0.0)),
            meta=dict(data.get("meta", {})),
            tree_ms={b: {int(n): float(v) for n, v in row.items()}
                     for b, row in _int_keys(data.get("tree_ms", {})).items()},
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> LatencyProfile:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        return cls.from_json(Path(path).read_text())


# --------------------------------------------------------------------------- synthetic profile
# BRIEF §5, SmolLM2-135M bf16 on the CPU machines, KV cache 200: (batch, n per seq) → ms.
BRIEF_ANCHORS_MS: dict[tuple[int, int], float] = {
    (1, 1): 42.0,
    (1, 4): 45.0,
    (1, 8): 53.0,
    (16, 1): 103.0,
    (16, 4): 121.0,
}


def _softplus(x: float, width: float) -> float:
    return x if x > 30 * width else width * math.log1p(math.exp(x / width))


def _solve5(rows: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (5×5; avoids a numpy dependency here)."""
    m = [r[:] + [y] for r, y in zip(rows, rhs, strict=True)]
    size = len(m)
    for col in range(size):
        piv = max(range(col, size), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        for r in range(size):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col], strict=True)]
    return [m[i][size] / m[i][i] for i in range(size)]


def synthetic_profile(
    *,
    batches: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64),
    max_n: int = 9,
    knee_tokens: float = 96.0,
    knee_width: float = 16.0,
    compute_ms_per_token: float = 3.0,
    d0_ms: float = 1.7,
    draft_ms_per_seq: float = 0.045,
    catchup_ms_per_token: float = 0.022,
    prefill_ms_per_token: float = 0.65,
) -> LatencyProfile:
    """A profile shaped like BRIEF §5: memory/overhead-bound at small batch, compute-bound at large.

    T(b, n) = a + s·b + (n−1)(u + v·b) + q(n−1)² + k·softplus(b·n − N_knee):
      * a, s, u, v, q are solved so the model passes exactly through the five measured points
        (42/45/53 ms at b=1, n=1/4/8; 103/121 ms at b=16, n=1/4) — per-sequence overhead (s ≈ 4 ms,
        KV-cache traffic) dominates, extra verify tokens are cheap (u + v·b ≈ 0.6–5.6 ms);
      * the compute-bound term is an assumption (nothing above b·n = 64 was measured): past
        N_knee = 96 tokens per forward every extra token costs k = 3 ms, i.e. close to what a whole
        sequence costs at b = 64, so verification there is nearly as dear as decoding — the regime
        where speculation must switch off (seed 000 Fig. 4, seed 001 Fig. 2). The softplus (width
        16 tokens) keeps T smooth so policies do not see an artificial cliff.
    D(b) = 1.7 ms + 0.045 ms per extra sequence: the 8192-vocab EAGLE-3 draft step (BRIEF §5) plus
    ≈18 MFLOP per token (one layer + draft lm_head) at 415 GFLOP/s. Catch-up: 0.022 ms per lagging
    token (one layer + fc, no lm_head). Prefill: 0.65 ms/token ≈ 2·135M FLOP at 415 GFLOP/s.
    """

    def knee(b: float, n: float) -> float:
        return compute_ms_per_token * _softplus(b * n - knee_tokens, knee_width)

    rows, rhs = [], []
    for (b, n), ms in BRIEF_ANCHORS_MS.items():
        rows.append([1.0, float(b), float(n - 1), float((n - 1) * b), float((n - 1) ** 2)])
        rhs.append(ms - knee(b, n))
    a, s, u, v, q = _solve5(rows, rhs)

    def t(b: int, n: int) -> float:
        return a + s * b + (n - 1) * (u + v * b) + q * (n - 1) ** 2 + knee(b, n)

    return LatencyProfile(
        T_ms={b: {n: round(t(b, n), 3) for n in range(1, max_n + 1)} for b in batches},
        D0_ms=d0_ms,
        D_ms={b: round(d0_ms + draft_ms_per_seq * (b - 1), 4) for b in batches},
        catchup_ms_per_token=catchup_ms_per_token,
        prefill_ms_per_token=prefill_ms_per_token,
        meta={
            "source": "synthetic (BRIEF §5 anchors + assumed compute-bound knee)",
            "knee_tokens": knee_tokens,
            "compute_ms_per_token": compute_ms_per_token,
        },
    )
