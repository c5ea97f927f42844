"""vLLM's decoding extensions: min_tokens, repetition_penalty (logits processing, tide.engine.logits) and
min_p (tide.engine.sampling.target_probs). Their rules row by row, their effect on the tiny model's
output, and greedy (and seeded coupled) output identical with speculation on and off."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from support.engine import ScriptedDrafter, target_last_probs

from tide.engine.drafters import NgramDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.logits import needs_processing, process
from tide.engine.sampling import target_probs
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma

PROMPT = [9, 3, 9]


def test_params_are_validated():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    for bad in (0.0, -1.0, 1e-4, 1e4, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="min_p"):
            SamplingParams(min_p=bad)
    assert needs_processing(SamplingParams(min_tokens=1)) and needs_processing(SamplingParams(repetition_penalty=1.2))
    assert not needs_processing(SamplingParams(min_p=0.3, temperature=1.0))  # min_p acts in target_probs


def test_repetition_penalty_follows_ctrl_and_counts_drafts_per_row():
    logits = torch.tensor([[2.0, -2.0, 4.0, -4.0, 1.0]] * 3)
    out = process(logits, SamplingParams(repetition_penalty=2.0), None, drafts=[2, 3], matcher=None, seen={0, 1})
    assert out[0].tolist() == [1.0, -4.0, 4.0, -4.0, 1.0]  # seen: positive / 2, negative * 2
    assert out[1].tolist() == [1.0, -4.0, 2.0, -4.0, 1.0]  # + drafts[0]
    assert out[2].tolist() == [1.0, -4.0, 2.0, -8.0, 1.0]  # + drafts[:2]
    assert logits[0, 0] == 2.0  # the raw logits are untouched


def test_repetition_rows_are_bitwise_one_token_decoding():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 96, generator=g) * 4
    params = SamplingParams(repetition_penalty=1.37, frequency_penalty=0.4, logit_bias=((4, 1.5),))
    seen, counts, drafts = {4, 9, 11, 60}, Counter({9: 2}), [9, 70, 70, 50]
    rows = process(logits, params, counts, drafts, None, seen=seen)
    for j in range(5):
        alone = process(logits[j:j + 1], params, counts + Counter(drafts[:j]), [], None,
                        seen=seen | set(drafts[:j]))
        assert torch.equal(rows[j], alone[0])


def test_min_tokens_masks_stop_tokens_per_row():
    logits = torch.zeros(4, 6)
    out = process(logits, SamplingParams(min_tokens=3), None, drafts=[1, 2, 3], matcher=None,
                  num_output=1, stop_ids=frozenset({0, 5}))
    # rows 0, 1 have 1 and 2 output tokens before them (< 3): masked; rows 2, 3 have 3 and 4
    assert out[:2, [0, 5]].isinf().all() and (out[2:, [0, 5]] == 0).all()
    assert (out[:, 1:5] == 0).all()
    # A row where only stop tokens are allowed (a constraint's end) is left as it is.
    only_eos = torch.full((1, 6), float("-inf"))
    only_eos[0, 0] = 1.0
    kept = process(only_eos, SamplingParams(min_tokens=3), None, [], None, num_output=0, stop_ids=frozenset({0}))
    assert kept[0, 0] == 1.0


def test_min_p_drops_tokens_below_the_fraction_of_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.4))  # threshold 0.2
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.allclose(target_probs(logits, SamplingParams(temperature=1.0, min_p=0.0)), logits.exp())
    top_only = target_probs(logits, SamplingParams(temperature=1.0, min_p=1.0))
    assert top_only.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def _engine(model, **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(max_batch=4, max_seq_len=128), **kw)


def test_min_tokens_suppresses_eos_and_stop_tokens(tiny_model):
    free = _engine(tiny_model).generate([PROMPT], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    eos = free.output_ids[3]  # declare a token the model emits early as its EOS (as test_stops.py)
    engine = _engine(tiny_model)
    engine.eos_ids = {eos}
    early = engine.generate([PROMPT], SamplingParams(max_tokens=40))[0]
    assert len(early.output_ids) <= 4 and early.output_ids[-1] == eos
    held = engine.generate([PROMPT], SamplingParams(max_tokens=40, min_tokens=12))[0]
    assert len(held.output_ids) >= 12 and eos not in held.output_ids[:11]
    assert held.output_ids[:3] == early.output_ids[:3]  # nothing changes before the masked position
    stopped = _engine(tiny_model).generate(
        [PROMPT], SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(eos,), min_tokens=12))[0]
    assert len(stopped.output_ids) >= 12 and eos not in stopped.output_ids[:11]


def test_repetition_penalty_changes_greedy_output_and_repeats_less(tiny_model):
    free, penal = _engine(tiny_model).generate(
        [PROMPT] * 2, [SamplingParams(max_tokens=30, ignore_eos=True),
                       SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.8)])
    assert penal.output_ids != free.output_ids
    assert max(Counter(penal.output_ids).values()) < max(Counter(free.output_ids).values())
    assert len(set(penal.output_ids)) > len(set(free.output_ids))
    # The prompt counts too (vLLM): the first token already sees the penalty on 9 and 3.
    logits_row = torch.log(target_last_probs(tiny_model, PROMPT, SamplingParams(temperature=1.0))).float()[None]
    expected = int(process(logits_row, penal.params, None, [], None, seen=set(PROMPT)).argmax())
    assert penal.output_ids[0] == expected


def test_min_p_samples_only_tokens_above_the_threshold(tiny_model):
    params = [SamplingParams(max_tokens=1, temperature=1.5, min_p=0.3, seed=s) for s in range(64)]
    raw = target_last_probs(tiny_model, PROMPT, SamplingParams(temperature=1.5))
    allowed = set(torch.nonzero(raw >= 0.3 * raw.max()).flatten().tolist())
    firsts = {s.output_ids[0] for s in _engine(tiny_model).generate([PROMPT] * 64, params)}
    assert firsts <= allowed
    free = [SamplingParams(max_tokens=1, temperature=1.5, seed=s) for s in range(64)]
    assert {s.output_ids[0] for s in _engine(tiny_model).generate([PROMPT] * 64, free)} - allowed  # min_p did it


GREEDY = [
    SamplingParams(max_tokens=24, min_tokens=20),
    SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.6),
    SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=0.7, presence_penalty=0.5),
    SamplingParams(max_tokens=24, min_tokens=16, repetition_penalty=1.3, stop_token_ids=(40,)),
]


@pytest.mark.parametrize("drafter_kind", ["ngram", "scripted"])
def test_greedy_identity_with_min_tokens_and_repetition_penalty(tiny_model, drafter_kind):
    prompts = [[5, 6, 7, 5, 6, 7, 8][: 4 + i] for i in range(4)]
    free = _engine(tiny_model).generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), False)
    eos = Counter(t for s in free for t in s.output_ids[:8]).most_common(1)[0][0]

    def run(**kw):
        engine = _engine(tiny_model, **kw)
        engine.eos_ids = {eos}  # an EOS the model emits, so min_tokens has something to hold back
        return engine.generate(prompts, GREEDY, bool(kw))

    plain = run()
    drafter = {"ngram": NgramDrafter,
               # the right continuation, one proposal in 3 corrupted: rows j > 0 are accepted and processed
               "scripted": lambda: ScriptedDrafter({f"gen-0-{i}": s.output_ids for i, s in enumerate(plain)},
                                                   tiny_model.cfg.vocab_size, corrupt_every=3)}[drafter_kind]()
    spec = run(drafter=drafter, policy=FixedGamma(4))
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    assert sum(s.draft_tokens for s in spec) > 0
    if drafter_kind == "scripted":
        assert sum(s.accepted_tokens for s in spec) > len(spec) * 8
    assert all(len(s.output_ids) >= s.params.min_tokens for s in plain)


def test_seeded_min_p_sampling_is_the_same_with_speculation(tiny_model):
    prompts = [[5, 6, 7, 5, 6, 7, 8][: 4 + i] for i in range(4)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, min_p=p, seed=i,
                             repetition_penalty=1.2 if i % 2 else 1.0)
              for i, p in enumerate((0.05, 0.1, 0.2, 0.4))]
    plain = _engine(tiny_model).generate(prompts, params, False)
    spec = _engine(tiny_model, drafter=NgramDrafter(), policy=FixedGamma(4)).generate(prompts, params, True)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    assert sum(s.draft_tokens for s in spec) > 0
