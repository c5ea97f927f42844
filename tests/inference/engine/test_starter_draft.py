"""The starter draft shipped in the repository (tide/starter_drafts/, made by tools/draft/card.py):
it loads in the serving engine against the reference target, keeps greedy output identical to
plain decoding, and its accept length on the card's check prompts is within 5 % of the card."""

from __future__ import annotations

import json

import pytest
import torch

from services.registry.settings import SHIPPED_STARTERS
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma
from tide.prompts import Prompt, encode_prompt
from tide.target import load_tokenizer, reference_gguf_path, resolve_target
from tools.draft.card import accept_length, sha256

STARTERS = sorted(p.parent for p in SHIPPED_STARTERS.glob("*/card.json"))


@pytest.fixture(scope="module")
def ref():
    target = resolve_target("ref")
    return target, LlamaModel.load(target, dtype=torch.bfloat16), load_tokenizer(target)


def test_the_reference_target_has_a_starter():
    cards = [json.loads((p / "card.json").read_text()) for p in STARTERS]
    assert [c["target_model"] for c in cards] == [resolve_target("ref").model_id]
    card = cards[0]
    assert card["target_gguf_sha256"] == sha256(reference_gguf_path())  # made for these exact weights
    assert sum(f["bytes"] for f in card["files"].values()) <= 25e6
    for name, f in card["files"].items():
        assert sha256(STARTERS[0] / name) == f["sha256"], name


@pytest.mark.parametrize("path", STARTERS, ids=lambda p: p.name)
def test_the_starter_accepts_as_its_card_says_and_stays_lossless(path, ref):
    target, model, tok = ref
    card = json.loads((path / "card.json").read_text())
    check = card["check"]
    prompts = [encode_prompt(tok, Prompt(p["text"], "check", "card", p["chat"])) for p in check["prompts"]]
    measured, _ = accept_length(model, path, prompts, check["gamma"], check["max_tokens"])
    assert measured == pytest.approx(check["accept_length"], rel=0.05)
    assert measured >= 1.5  # a draft that pays: well above one token per step
    # greedy output with the draft equals the target's own
    plain = LLMEngine(model, EngineConfig(max_batch=2, max_seq_len=1024)).generate(
        prompts[:2], SamplingParams(max_tokens=32))
    spec = LLMEngine(model, EngineConfig(max_batch=2, max_seq_len=1024), policy=FixedGamma(3),
                     drafter=Eagle3Drafter.from_checkpoint(path, model, "starter", 2, 1024)).generate(
        prompts[:2], SamplingParams(max_tokens=32), speculative=True)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]


@pytest.mark.parametrize("shape", [(4, 4, 10), (6, 8, 32)], ids=lambda s: "d{}k{}n{}".format(*s))
def test_the_starter_grows_trees_that_stay_lossless_and_accept_more(ref, shape):
    """EAGLE-2 trees from the starter on the reference target: greedy output identical to plain
    decoding at batch 1 and 2, and longer accepted paths than the chain of the same depth."""
    from tide.policies import FixedTree

    target, model, tok = ref
    card = json.loads((STARTERS[0] / "card.json").read_text())
    prompts = [encode_prompt(tok, Prompt(p["text"], "check", "card", p["chat"])) for p in card["check"]["prompts"]][:2]
    params = SamplingParams(max_tokens=32)
    cfg = EngineConfig(max_batch=2, max_seq_len=1024)
    plain = [s.output_ids for s in LLMEngine(model, cfg).generate(prompts, params)]

    def run(policy, batch):
        drafter = Eagle3Drafter.from_checkpoint(STARTERS[0], model, "starter", 2, 1024)
        seqs = []
        for i in range(0, len(prompts), batch):
            seqs += LLMEngine(model, cfg, policy=policy, drafter=drafter).generate(prompts[i:i + batch], params)
        return seqs

    for batch in (1, 2):
        trees = run(FixedTree(*shape), batch)
        assert [s.output_ids for s in trees] == plain
    chains = run(FixedGamma(shape[0]), 2)
    accept = lambda seqs: sum(s.accepted_tokens + s.verify_steps for s in seqs) / sum(s.verify_steps for s in seqs)  # noqa: E731
    assert accept(trees) > accept(chains)
