import sys, time, torch, json
from services.inference.engine.llama import LlamaModel
from services.inference.engine.sequence import SamplingParams
from services.trainer.generation import make_engine
from tide.target import resolve_target, load_tokenizer
t = resolve_target("ref"); tok = load_tokenizer(t)
qs = [json.loads(l) for l in open("/work/shared/data/spec_bench_questions.jsonl")][:32]
prompts = [tok.apply_chat_template([{"role":"user","content":q["turns"][0]}], add_generation_prompt=True) for q in qs]
m = LlamaModel.load(t, dtype=torch.float32)
B = int(sys.argv[1]) if len(sys.argv) > 1 else 32
eng = make_engine(m, B, 512, 96)
p = SamplingParams(max_tokens=96)
seqs = [eng.add_request(f"r{i}", (ids if isinstance(ids, list) else list(ids["input_ids"])), p, False) for i, ids in enumerate(prompts[:B])]
# prefill + a few steps first
for _ in range(40):
    eng.step()
from torch.profiler import profile, ProfilerActivity
t0 = time.perf_counter(); n0 = sum(s.num_output for s in seqs)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(20):
        eng.step()
dt = time.perf_counter() - t0; n = sum(s.num_output for s in seqs) - n0
print(f"decode: {n} tokens in {dt:.2f}s = {n/dt:.1f} tok/s, {dt/20*1e3:.0f} ms/step, active {len(eng.scheduler.active)}")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
