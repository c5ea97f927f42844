"""logit_bias, presence / frequency penalties and the grammar mask under speculation: row-by-row
processing, greedy identity with speculation on/off, raw logprobs, the fast path, and (chi-square)
speculative sampling from exactly the processed target distribution."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from inference.engine.test_lossless_sampling import chi_square_p_value
from support.engine import RandomDrafter, ScriptedDrafter, save_tiny_target, tiny_eagle3_drafter

from tide.engine import engine as engine_module
from tide.engine.drafters import NgramDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import ForwardBatch, LlamaModel
from tide.engine.logits import needs_processing, process
from tide.engine.sampling import target_probs
from tide.engine.sequence import FinishReason, GrammarKind, GrammarSpec, SamplingParams
from tide.policies import FixedGamma
from tide.target import load_tokenizer

ALPHA = 1e-3  # chi-square significance, as in test_lossless_sampling.py


def test_penalties_follow_openai_and_count_drafts_per_row():
    logits = torch.zeros(3, 8)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((1, 2.0), (7, -1.0)))
    out = process(logits, params, Counter({3: 2}), drafts=[3, 5], matcher=None)
    assert out[:, 1].tolist() == [2.0] * 3 and out[:, 7].tolist() == [-1.0] * 3
    assert out[0, 3] == -(0.5 + 0.25 * 2) and out[0, 5] == 0  # row 0: the output so far
    assert out[1, 3] == -(0.5 + 0.25 * 3) and out[1, 5] == 0  # row 1: + drafts[0]
    assert out[2, 3] == -(0.5 + 0.25 * 3) and out[2, 5] == -(0.5 + 0.25)  # row 2: + drafts[:2]
    assert logits.abs().sum() == 0  # the raw logits are untouched (logprobs read them)


def test_each_row_is_bitwise_what_one_token_decoding_computes():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 96, generator=g) * 4
    params = SamplingParams(presence_penalty=1.3, frequency_penalty=-0.7, logit_bias=((4, 3.3), (9, -2.1)))
    counts, drafts = Counter({4: 1, 9: 3, 11: 2}), [9, 4, 4, 50]
    rows = process(logits, params, counts, drafts, None)
    for j in range(5):
        alone = process(logits[j:j + 1], params, counts + Counter(drafts[:j]), [], None)
        assert torch.equal(rows[j], alone[0])


def test_default_params_take_the_fast_path(tiny_model, monkeypatch):
    assert not needs_processing(SamplingParams(temperature=0.8, top_k=5, logprobs=2))
    assert needs_processing(SamplingParams(logit_bias=((1, 1.0),)))
    assert needs_processing(SamplingParams(frequency_penalty=0.1))

    def refuse(*args, **kwargs):
        raise AssertionError("processed a request that asked for no processing")
    monkeypatch.setattr(engine_module, "process", refuse)
    engine = LLMEngine(tiny_model, EngineConfig(max_batch=2, max_seq_len=64), drafter=NgramDrafter(),
                       policy=FixedGamma(3))
    engine.generate([[5, 6, 5, 6]], [SamplingParams(max_tokens=8, ignore_eos=True)])
    with pytest.raises(AssertionError, match="processed"):  # and the patch is live
        engine.generate([[5, 6]], [SamplingParams(max_tokens=2, presence_penalty=1.0)])


PROCESSED = [
    SamplingParams(max_tokens=24, ignore_eos=True, logit_bias=((7, 4.0), (11, 2.5), (3, -100.0))),
    SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=1.5),
    SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=0.8, presence_penalty=-0.4),
    SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=2.0, logit_bias=((7, 4.0),)),
]


@pytest.mark.parametrize("drafter_kind", ["ngram", "eagle3", "scripted"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_identity_with_bias_and_penalties(tiny_model, drafter_kind, batch):
    prompts = [[5, 6, 7, 5, 6, 7, 8][: 4 + i] for i in range(batch)]
    params = PROCESSED[:batch] if batch > 1 else [PROCESSED[3]]
    plain = LLMEngine(tiny_model, EngineConfig(max_batch=4, max_seq_len=128)).generate(prompts, params, False)
    drafter = {"ngram": NgramDrafter, "eagle3": lambda: tiny_eagle3_drafter(tiny_model, max_batch=4),
               # the right continuation, one proposal in 3 corrupted: accepted rows j > 0 are processed too
               "scripted": lambda: ScriptedDrafter({f"gen-0-{i}": s.output_ids for i, s in enumerate(plain)},
                                                   tiny_model.cfg.vocab_size, corrupt_every=3)}[drafter_kind]()
    spec = LLMEngine(tiny_model, EngineConfig(max_batch=4, max_seq_len=128), drafter=drafter,
                     policy=FixedGamma(4)).generate(prompts, params, True)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    assert sum(s.draft_tokens for s in spec) > 0
    if drafter_kind == "scripted":
        assert sum(s.accepted_tokens for s in spec) > len(spec) * 8
    unprocessed = LLMEngine(tiny_model, EngineConfig(max_batch=4, max_seq_len=128)).generate(
        prompts, SamplingParams(max_tokens=24, ignore_eos=True), False)
    assert [s.output_ids for s in plain] != [s.output_ids for s in unprocessed]  # processing did something


def test_penalties_change_repetition_and_logprobs_stay_raw(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(max_batch=2, max_seq_len=128))
    free, penal = engine.generate([[5, 6, 7]] * 2, [SamplingParams(max_tokens=30, ignore_eos=True, logprobs=0),
                                                    SamplingParams(max_tokens=30, ignore_eos=True, logprobs=0,
                                                                   frequency_penalty=2.0, presence_penalty=2.0)])
    assert max(Counter(penal.output_ids).values()) < max(Counter(free.output_ids).values())
    # The first token sees no penalty (no output yet): same token, same raw logprob.
    assert penal.output_ids[0] == free.output_ids[0] and penal.logprobs[0] == free.logprobs[0]
    biased = LLMEngine(tiny_model, EngineConfig(max_batch=1, max_seq_len=128)).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=1, logprobs=3, logit_bias=((40, 100.0),)))[0]
    assert biased.output_ids == [40]
    raw = torch.log_softmax(_last_logits(tiny_model, [5, 6, 7]).double(), -1)
    assert biased.logprobs[0].logprob == pytest.approx(float(raw[40]), abs=1e-4)  # not ~0: the raw logprob


# ---- exact distribution of constrained + penalized speculative sampling -----------------------------

def _last_logits(model, ids: list[int]) -> torch.Tensor:
    t = torch.tensor([ids])
    pos = torch.arange(len(ids))[None]
    mask = torch.arange(len(ids))[None, None, None, :] <= pos[:, None, :, None]
    logits, _, _ = model.forward(ForwardBatch(t, pos, torch.tensor([0]), len(ids), mask, slot_range=(0, 1)),
                                 model.new_cache(1, len(ids) + 1))
    return logits[-1]


def _exact_outputs(model, engine, prompt, params) -> dict[tuple[int, ...], float]:
    """Probability of every complete output (the regex allows at most 2 tokens), by enumeration."""
    def probs(output: list[int]) -> torch.Tensor:
        m = engine.compile_grammar(params.grammar).matcher()
        for t in output:
            assert m.accept(t)
        if m.is_terminated:
            return None
        row = process(_last_logits(model, prompt + output)[None], params, Counter(output), [], m)
        return target_probs(row, params)[0].double()

    exact: dict[tuple[int, ...], float] = {}
    p1 = probs([])
    for t1 in torch.nonzero(p1 > 0).flatten().tolist():
        p2 = probs([t1])
        if p2 is None:
            exact[(t1,)] = float(p1[t1])
            continue
        for t2 in torch.nonzero(p2 > 0).flatten().tolist():
            exact[(t1, t2)] = float(p1[t1] * p2[t2])
    return exact


@pytest.fixture(scope="module")
def vocab_model(tmp_path_factory) -> LlamaModel:
    target = save_tiny_target(tmp_path_factory.mktemp("tiny-49k-sampling"), vocab=49152, layers=4, seed=5,
                              init_std=0.3)
    return LlamaModel.load(target, dtype=torch.float32)


@pytest.mark.parametrize("drafter_kind", ["ngram", "eagle3", "random-q"])
def test_constrained_penalized_sampling_is_exact(vocab_model, ref_target, drafter_kind):
    tokenizer = load_tokenizer(ref_target)
    a, b, c = (tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abc")
    params = SamplingParams(max_tokens=3, temperature=1.0, grammar=GrammarSpec(GrammarKind.REGEX, "[abc]{2}"),
                            presence_penalty=1.5, frequency_penalty=0.5, logit_bias=((b, 2.0), (a, 1.0)))
    # single-letter tokens: the n-gram drafter finds grammatical continuations to copy (a prompt of
    # words would give it " a", " b", which the grammar refuses, and no draft would be verified)
    prompt = [a, b, c, a, b, b, a, c, a, b, a, a, b, c]
    drafter = {"ngram": NgramDrafter,
               "eagle3": lambda: tiny_eagle3_drafter(vocab_model, draft_vocab=49152, max_batch=64, max_len=64),
               "random-q": lambda: RandomDrafter(vocab_model.cfg.vocab_size, seed=3, sharpness=1.0)}[drafter_kind]()
    engine = LLMEngine(vocab_model, EngineConfig(max_batch=64, max_seq_len=64), tokenizer=tokenizer,
                       drafter=drafter, policy=FixedGamma(2))
    exact = _exact_outputs(vocab_model, engine, prompt, params)
    n, seqs = 512, []
    for start in range(0, n, 64):
        batch = [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(start, start + 64)]
        seqs += engine.generate([prompt] * 64, batch)
    assert all(s.finish_reason is FinishReason.STOP for s in seqs)
    assert sum(s.draft_tokens for s in seqs) > 0
    if drafter_kind == "eagle3":  # masked drafts follow the grammar: some are accepted
        assert sum(s.accepted_tokens for s in seqs) > 0
    outcomes = sorted(exact)
    seen = Counter(tuple(s.output_ids) for s in seqs)
    assert set(seen) <= set(exact), "an output the processed distribution gives probability 0"
    counts = torch.tensor([seen[o] for o in outcomes], dtype=torch.float64)
    probs = torch.tensor([exact[o] for o in outcomes], dtype=torch.float64)
    assert chi_square_p_value(counts, probs / probs.sum()) > ALPHA
