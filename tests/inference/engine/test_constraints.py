"""Output constraints (json_schema, json_object, regex, grammar): compile errors, the matcher, greedy
identity with speculation on/off, termination, and valid JSON from the reference model.

Engine tests use a tiny random target over the reference tokenizer's 49152-token vocabulary (a real
tokenizer, so real grammars; four layers, the fewest EAGLE-3 capture allows, keep a step cheap); the
last test uses SmolLM2 itself.
"""

from __future__ import annotations

import json

import jsonschema_rs
import pytest
import torch
from support.engine import save_tiny_target, tiny_eagle3_drafter

from services.inference.requests import ErrorKind, GenerationRequest, RequestRejected
from services.inference.worker import Worker
from tide.decisions import PolicySpec
from tide.engine.drafters import NgramDrafter
from tide.engine.drafters.hybrid import HybridDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.sequence import FinishReason, GrammarKind, GrammarSpec, SamplingParams
from tide.policies import FixedGamma
from tide.prompts import Prompt, encode_prompt
from tide.target import load_tokenizer

EOS = 2  # <|im_end|>: the reference tokenizer's EOS and the tiny target's eos_token_id

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"]}
SPECS = {
    "json_schema": GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(PERSON)),
    "json_object": GrammarSpec(GrammarKind.JSON_OBJECT),
    "regex": GrammarSpec(GrammarKind.REGEX, r"(yes|no), because [a-z ]{1,20}\."),
    "grammar": GrammarSpec(GrammarKind.GRAMMAR, 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'),
}


@pytest.fixture(scope="module")
def tokenizer(ref_target):
    return load_tokenizer(ref_target)


@pytest.fixture(scope="module")
def vocab_model(tmp_path_factory) -> LlamaModel:
    target = save_tiny_target(tmp_path_factory.mktemp("tiny-49k"), vocab=49152, layers=4, seed=3, init_std=0.3)
    return LlamaModel.load(target, dtype=torch.float32)


def _engine(model, tokenizer, drafter=None, gamma=4, max_batch=4) -> LLMEngine:
    return LLMEngine(model, EngineConfig(max_batch=max_batch, max_seq_len=256), tokenizer=tokenizer,
                     drafter=drafter, policy=FixedGamma(gamma))


# ---- compiling and matching ----------------------------------------------------------------------

@pytest.mark.parametrize("spec,needle", [
    (GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "objectx"}'), "objectx"),
    (GrammarSpec(GrammarKind.JSON_SCHEMA, "{not json"), "not JSON"),
    (GrammarSpec(GrammarKind.JSON_SCHEMA, "[1, 2]"), "must be a JSON object"),
    (GrammarSpec(GrammarKind.JSON_SCHEMA, '{"properties": {"a": {"$ref": "#/nowhere"}}}'), "nowhere"),
    (GrammarSpec(GrammarKind.REGEX, "a(b"), "unclosed group"),
    (GrammarSpec(GrammarKind.GRAMMAR, "start: undefined_rule"), "unknown name"),
])
def test_invalid_constraints_raise_value_error(vocab_model, tokenizer, spec, needle):
    engine = _engine(vocab_model, tokenizer)
    with pytest.raises(ValueError, match=f"(?s)invalid {spec.kind.value} constraint.*{needle}"):
        engine.compile_grammar(spec)
    with pytest.raises(ValueError, match=needle):  # the engine compiles when not handed a compiled grammar
        engine.add_request("r", [5, 6], SamplingParams(grammar=spec))
    assert len(engine.scheduler) == 0


def test_constraint_needs_a_tokenizer(vocab_model):
    engine = LLMEngine(vocab_model, EngineConfig(max_batch=1, max_seq_len=64))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("r", [5, 6], SamplingParams(grammar=SPECS["json_object"]))


def test_worker_refuses_a_bad_schema_as_invalid_argument(vocab_model, tokenizer):
    engine = _engine(vocab_model, tokenizer)
    worker = Worker(engine, policy=PolicySpec("static", {"gamma": 0}), drafter="ngram", tokenizer=tokenizer)
    bad = GenerationRequest("bad", prompt_ids=(5, 6), max_tokens=4, temperature=0.0,
                            grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": 12}'))
    with pytest.raises(RequestRejected) as info:
        worker.submit(bad)
    assert info.value.kind is ErrorKind.INVALID_ARGUMENT and "json_schema" in info.value.message
    good = worker.submit(GenerationRequest("good", prompt_ids=(5, 6), max_tokens=4, temperature=0.0,
                                           grammar=SPECS["regex"]))
    assert good.grammar is not None and good.grammar.spec == SPECS["regex"]  # compiled before the loop


def test_matcher_masks_accepts_and_rolls_back(vocab_model, tokenizer):
    m = _engine(vocab_model, tokenizer).compile_grammar(GrammarSpec(GrammarKind.REGEX, r"(yes|no)\.")).matcher()
    yes, no, dot = (tokenizer.encode(t, add_special_tokens=False) for t in ("yes", "no", "."))
    allowed = m.allowed()
    assert allowed.shape == (49152,) and allowed[yes[0]] and allowed[no[0]] and not allowed[EOS]
    assert not allowed[dot[0]]
    assert m.validate([*yes, *dot, EOS, 7]) == len(yes) + 2  # EOS allowed once complete, nothing after it
    assert m.validate([*yes, EOS]) == len(yes)  # not complete yet: no EOS
    for t in [*yes, *dot]:
        assert m.accept(t)
    assert m.is_complete and m.is_terminated and m.allowed().nonzero().flatten().tolist() == [EOS]
    assert m.accept(EOS) and not m.allowed().any()
    m.rollback(1 + len(dot))  # EOS and "." (EOS counts as one token: llguidance's own rollback would not)
    assert not m.is_complete and m.allowed()[dot[0]] and not m.allowed()[yes[0]]


# ---- the engine ----------------------------------------------------------------------------------

# Earlier JSON, answers and sums in the prompt give the n-gram drafter something grammatical to copy.
CONTEXT = ('{"name": "Ann", "age": 3, "tags": ["a"]} {"name": "Bo", "age": 41, "tags": ["b", "c"]} '
           'yes, because it is. no, because it is not. (1+2+33)')


def _prompts(tokenizer, n):
    texts = [" Give me JSON about a person:", " Answer yes or no:", " Sum:", " Describe a cat in JSON:"]
    return [tokenizer.encode(CONTEXT + texts[i % len(texts)]) for i in range(n)]


def _check_identity(model, tokenizer, spec, drafter, batch):
    params = SamplingParams(max_tokens=16, grammar=spec)
    prompts = _prompts(tokenizer, batch)
    plain = _engine(model, tokenizer).generate(prompts, params, speculative=False)
    spec_seqs = _engine(model, tokenizer, drafter).generate(prompts, params, speculative=True)
    assert [s.output_ids for s in spec_seqs] == [s.output_ids for s in plain]
    assert [s.finish_reason for s in spec_seqs] == [s.finish_reason for s in plain]
    for s in plain:  # every output is a valid prefix (a complete sentence when it stopped)
        m = _engine(model, tokenizer).compile_grammar(spec).matcher()
        assert all(m.accept(t) for t in s.output_ids)
        assert m.is_complete or s.finish_reason is FinishReason.LENGTH
    return spec_seqs


def _drafter(kind, model):
    if kind == "ngram":
        return NgramDrafter()
    eagle = tiny_eagle3_drafter(model, draft_vocab=49152, max_batch=4, max_len=256)
    return HybridDrafter(eagle) if kind == "hybrid" else eagle  # hybrid: copies cut to the grammar, else drafts


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("drafter_kind", ["ngram", "eagle3", "hybrid"])
def test_greedy_output_identical_with_speculation_on_and_off(vocab_model, tokenizer, kind, drafter_kind):
    seqs = _check_identity(vocab_model, tokenizer, SPECS[kind], _drafter(drafter_kind, vocab_model), batch=3)
    if (drafter_kind, kind) != ("ngram", "json_object"):  # the random target's free keys never recur
        assert sum(s.draft_tokens for s in seqs) > 0
    if drafter_kind == "eagle3" and kind != "json_object":  # masked to the grammar, the random draft
        assert sum(s.accepted_tokens for s in seqs) > 0  # gets the forced tokens (keys, enums, literals) right


@pytest.mark.parametrize("drafter_kind", ["ngram", "eagle3", "hybrid"])
def test_greedy_identity_batch_of_one(vocab_model, tokenizer, drafter_kind):
    seqs = _check_identity(vocab_model, tokenizer, SPECS["json_schema"], _drafter(drafter_kind, vocab_model), 1)
    assert seqs[0].draft_tokens > 0


def test_unmasked_eagle3_drafts_leave_the_grammar_state_alone(vocab_model, tokenizer):
    """mask_to_grammar off (benchmarks.features' baseline): drafts the grammar refuses are verified
    and rejected like any other, and never walk the request's matcher (they once left it corrupt)."""
    drafter = _drafter("eagle3", vocab_model)
    drafter.mask_to_grammar = False
    seqs = _check_identity(vocab_model, tokenizer, SPECS["json_schema"], drafter, batch=3)
    assert sum(s.draft_tokens for s in seqs) > 0


def test_constraint_and_unconstrained_requests_share_a_batch(vocab_model, tokenizer):
    prompts = _prompts(tokenizer, 3)
    mixed = [SamplingParams(max_tokens=16, grammar=SPECS["regex"]), SamplingParams(max_tokens=16, ignore_eos=True),
             SamplingParams(max_tokens=16, grammar=SPECS["json_object"])]
    together = _engine(vocab_model, tokenizer, NgramDrafter()).generate(prompts, mixed, speculative=True)
    alone = [_engine(vocab_model, tokenizer).generate([p], sp, speculative=False)[0]
             for p, sp in zip(prompts, mixed, strict=True)]
    assert [s.output_ids for s in together] == [s.output_ids for s in alone]


def test_tree_policy_gives_constrained_requests_chains(vocab_model, tokenizer):
    """Draft trees are for unconstrained requests: a constrained request under a tree policy drafts a
    chain of the tree's depth (masked to its grammar), an unconstrained one in the same batch a tree."""
    from tide.policies import FixedTree

    prompts = _prompts(tokenizer, 2)
    mixed = [SamplingParams(max_tokens=16, grammar=SPECS["json_schema"]),
             SamplingParams(max_tokens=16, ignore_eos=True)]
    engine = LLMEngine(vocab_model, EngineConfig(max_batch=4, max_seq_len=256), tokenizer=tokenizer,
                       drafter=_drafter("eagle3", vocab_model), policy=FixedTree(3, 3, 7))
    together = engine.generate(prompts, mixed, speculative=True)
    alone = [_engine(vocab_model, tokenizer).generate([p], sp, speculative=False)[0]
             for p, sp in zip(prompts, mixed, strict=True)]
    assert [s.output_ids for s in together] == [s.output_ids for s in alone]
    constrained, free = together
    assert 0 < constrained.draft_tokens <= 3 * constrained.verify_steps  # chains of at most 3
    assert free.draft_tokens > 3 * free.verify_steps  # trees of 7 nodes


def test_termination_stop_when_complete_length_when_cut(vocab_model, tokenizer):
    prompt = _prompts(tokenizer, 2)[1]
    done = _engine(vocab_model, tokenizer).generate([prompt], SamplingParams(max_tokens=40, grammar=SPECS["regex"]))[0]
    text = tokenizer.decode(done.output_ids)
    assert done.finish_reason is FinishReason.STOP and text.endswith(".") and text.startswith(("yes, ", "no, "))
    assert EOS not in done.output_ids  # "." completes the regex and nothing may follow: no EOS step needed
    cut = _engine(vocab_model, tokenizer).generate([prompt], SamplingParams(max_tokens=3, grammar=SPECS["regex"]))[0]
    assert cut.finish_reason is FinishReason.LENGTH and cut.output_ids == done.output_ids[:3]


# ---- the reference model -------------------------------------------------------------------------

SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"status": {"enum": ["active", "inactive"]}, "level": {"type": "integer"}},
     "required": ["status", "level"]},
    {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "stops": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string",
                                                                                        "maxLength": 16}},
                                             "required": ["name"]}, "minItems": 1, "maxItems": 2}},
     "required": ["city", "stops"], "additionalProperties": False},
]


@pytest.mark.slow
def test_reference_model_samples_valid_json_for_each_schema(ref_model_fp32, tokenizer):
    engine = _engine(ref_model_fp32, tokenizer, NgramDrafter(), gamma=3)
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        text = f"Reply with JSON matching this schema: {json.dumps(schema)}"
        prompts.append(encode_prompt(tokenizer, Prompt(text=text, domain="json", source="test")))
        params.append(SamplingParams(max_tokens=120, temperature=0.7, seed=i,
                                     grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))))
    seqs = engine.generate(prompts, params)
    # A sample may nest without end (this small model does, for an open array of objects) and meet
    # max_tokens: the grammar held every token (the engine raises otherwise); every sample that ends
    # is a document of its schema, and most end.
    finished = [(seq, schema) for seq, schema in zip(seqs, SCHEMAS, strict=True)
                if seq.finish_reason is FinishReason.STOP]
    assert len(finished) >= len(SCHEMAS) - 1, [tokenizer.decode(s.output_ids) for s in seqs]
    for seq, schema in finished:
        doc = json.loads(tokenizer.decode(seq.output_ids, skip_special_tokens=True))
        jsonschema_rs.validate(schema, doc)
