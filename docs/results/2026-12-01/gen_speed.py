import sys, time, torch
from services.inference.engine.llama import LlamaModel
from services.inference.engine.sequence import SamplingParams
from services.trainer.generation import make_engine
from tide.target import resolve_target, load_tokenizer
import json
t = resolve_target("ref"); tok = load_tokenizer(t)
qs = [json.loads(l) for l in open("/work/shared/data/spec_bench_questions.jsonl")][:32]
def text(q):
    return q.get("turns", [q.get("prompt") or q.get("instruction") or str(q)])[0] if isinstance(q, dict) else str(q)
prompts = [tok.apply_chat_template([{"role":"user","content":text(q)}], add_generation_prompt=True) for q in qs]
for name in sys.argv[1:]:
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
    m = LlamaModel.load(t, dtype=dt)
    eng = make_engine(m, 16, 512, 64)
    p = SamplingParams(max_tokens=64)
    t0 = time.perf_counter()
    seqs = [eng.add_request(f"r{i}", ids if isinstance(ids, list) else list(ids["input_ids"]), p, False) for i, ids in enumerate(prompts)]
    while eng.has_work(): eng.step()
    dtm = time.perf_counter() - t0
    n = sum(s.num_output for s in seqs)
    print(name, n, f"{dtm:.1f}s", f"{n/dtm:.1f} tok/s", flush=True)
