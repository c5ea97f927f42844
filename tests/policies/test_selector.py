"""Per-request drafter selection (seed 004 §5): features, and learning which drafter to prefer."""

import random

import pytest

from tide.policies.selector import FEATURE_NAMES, DrafterSelector, DrafterSpec, prompt_features

WORDS = ["the", "model", "reads", "a", "question", "and", "answers", "it", "with", "care", "about", "physics"]


def prose(rng: random.Random, n: int = 60) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def repetitive(rng: random.Random, n: int = 60) -> str:
    block = " ".join(rng.choice(WORDS) for _ in range(6))
    return " ".join([block] * (n // 6))


def test_features():
    assert len(prompt_features("hi")) == len(FEATURE_NAMES)
    f = prompt_features("x = f(a[1]); y = {2: 3}")
    assert f[0] == 1.0 and f[3] > 0.1 and f[4] > 0.2
    assert prompt_features("a b c a b c a b c")[2] > 0.5
    assert prompt_features("a b c d e f g h")[2] == 0.0
    assert prompt_features(tokens=[5, 6, 7, 5, 6, 7])[2] == pytest.approx(0.25)  # 1 of 4 trigrams repeats
    assert prompt_features(tokens=list(range(4095)))[1] == pytest.approx(1.0)
    assert prompt_features("") == (1.0, 0.0, 0.0, 0.0, 0.0)


def true_alpha(drafter: str, text: str) -> float:
    """The world: prompt lookup shines on repetitive prompts, the EAGLE-3 draft everywhere else."""
    rep = prompt_features(text)[2]
    return 0.85 if drafter == "ngram" and rep > 0.5 else 0.15 if drafter == "ngram" else 0.6


def run_requests(sel: DrafterSelector, rng: random.Random, n: int) -> list[tuple[bool, str]]:
    picks = []
    for _ in range(n):
        is_rep = rng.random() < 0.5
        text = repetitive(rng) if is_rep else prose(rng)
        feats = prompt_features(text)
        name = sel.select(feats)
        alpha = true_alpha(name, text)
        gammas, accepted = [], []
        for _ in range(30):  # the request's speculation steps at γ = 3
            v = 0
            while v < 3 and rng.random() < alpha:
                v += 1
            gammas.append(3)
            accepted.append(v)
        sel.observe(name, feats, gammas, accepted)
        picks.append((is_rep, name))
    return picks


def test_learns_to_prefer_the_drafter_that_accepts_more_on_a_feature():
    rng = random.Random(0)
    sel = DrafterSelector(
        [
            DrafterSpec("eagle3:v1", cost_ratio=0.04, prior_alpha=0.5),
            DrafterSpec("ngram", cost_ratio=0.005, prior_alpha=0.3),
        ]
    )
    feats = prompt_features(repetitive(rng))
    assert sel.predict_alpha("eagle3:v1", feats) > sel.predict_alpha("ngram", feats)  # priors
    picks = run_requests(sel, rng, 300)
    late = picks[-100:]
    rep = [n for r, n in late if r]
    other = [n for r, n in late if not r]
    assert rep.count("ngram") / len(rep) > 0.9
    assert other.count("eagle3:v1") / len(other) > 0.9
    assert sel.predict_alpha("ngram", prompt_features(repetitive(rng))) == pytest.approx(0.85, abs=0.1)


def test_cost_matters_when_acceptance_is_equal():
    sel = DrafterSelector([DrafterSpec("big", 0.2, 0.6), DrafterSpec("small", 0.02, 0.6)], explore=0.0)
    assert sel.select(prompt_features("anything")) == "small"


def test_drafters_come_and_go():
    sel = DrafterSelector(["eagle3:v1"], explore=0.0)
    sel.add(DrafterSpec("eagle3:v2", prior_alpha=0.9))
    assert sel.select(prompt_features("x")) == "eagle3:v2"
    sel.remove("eagle3:v2")
    assert sel.select(prompt_features("x")) == "eagle3:v1"
    assert sel.observe("gone", prompt_features("x"), [3], [3]) is None
    with pytest.raises(ValueError):
        DrafterSelector([])
