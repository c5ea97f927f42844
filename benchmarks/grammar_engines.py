"""xgrammar vs llguidance on this CPU, with the reference target's tokenizer: which grammar engine
TIDE's constraints (tide.engine.constraints) use.

Each library lives in its own scratch virtualenv (xgrammar pulls triton + apache-tvm-ffi), so the
driver, run from the project's venv, tokenizes the sample documents and starts this same file once
per library with `--engine NAME` under that venv's python; the child measures and prints JSON:

    .venv/bin/python -m benchmarks.grammar_engines \
        --xgrammar-python /tmp/xg-venv/bin/python --llguidance-python /tmp/llg-venv/bin/python

Measured per library: building the tokenizer info (once per tokenizer), compiling each grammar
(5 JSON schemas + json_object; a fresh compiler per grammar, so no library cache helps), the first
mask after compiling (llguidance builds its lexer lazily), and the per-token mask time while walking
a valid document token by token (mask, then accept the document's token), plus the install footprint
(site-packages bytes of the library and the dependencies only it brings, torch excluded).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.report import cpu_name

SCHEMAS: dict[str, dict] = {
    "flat_required": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
        "required": ["name", "age", "email"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "status": {"enum": ["active", "inactive", "pending", "banned"]},
            "priority": {"type": "string", "enum": ["low", "medium", "high"]},
            "level": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["status", "priority", "level"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
                "required": ["sku", "qty"]}},
            "total": {"type": "number"},
        },
        "required": ["items", "total"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {
                "id": {"type": "integer"},
                "profile": {"type": "object", "properties": {
                    "first": {"type": "string"}, "last": {"type": "string"},
                    "address": {"type": "object", "properties": {
                        "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"]}},
                    "required": ["first", "last", "address"]}},
                "required": ["id", "profile"]},
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "mixed": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "rating": {"anyOf": [{"type": "number"}, {"type": "null"}]},
            "kind": {"enum": ["book", "film", "song"]},
            "meta": {"type": "object", "properties": {"year": {"type": "integer"}, "lang": {"type": "string"}},
                     "required": ["year"]},
        },
        "required": ["title", "tags", "kind", "meta"],
    },
}

# Both libraries compile with fixed separators (json.dumps' defaults, what small models write):
# flexible whitespace would let a model pad forever.
SEPARATORS = (", ", ": ")

# One valid document per grammar: the per-token mask time is measured while walking its tokens.
DOCUMENTS: dict[str, object] = {
    "flat_required": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
    "enums": {"status": "pending", "priority": "high", "level": 3},
    "array_of_objects": {"items": [{"sku": "A-100", "qty": 2, "price": 9.5}, {"sku": "B-7", "qty": 1}],
                         "total": 28.25},
    "nested": {"user": {"id": 42, "profile": {"first": "Grace", "last": "Hopper",
                                              "address": {"city": "Arlington", "zip": "22201"}}}, "active": True},
    "mixed": {"title": "Dune", "tags": ["sci-fi", "classic"], "rating": 4.5, "kind": "book",
              "meta": {"year": 1965, "lang": "en"}},
    "json_object": {"query": "weather", "days": [1, 2, 3], "units": {"temp": "C"}, "ok": False},
}


# ---- children: one library each -----------------------------------------------------------------

def _measure(build_tokinfo, compile_fn, new_matcher, fill, accept, grammars, docs) -> dict:
    t0 = time.perf_counter()
    info = build_tokinfo()
    tokinfo_ms = (time.perf_counter() - t0) * 1e3
    rows = {}
    for name, schema in grammars.items():
        t0 = time.perf_counter()
        compiled = compile_fn(info, schema)
        compile_ms = (time.perf_counter() - t0) * 1e3
        m = new_matcher(info, compiled)
        t0 = time.perf_counter()
        fill(m)
        first_mask_ms = (time.perf_counter() - t0) * 1e3
        per_token = []
        for tok in docs[name]:
            t0 = time.perf_counter()
            fill(m)
            per_token.append((time.perf_counter() - t0) * 1e6)
            if not accept(m, tok):
                raise RuntimeError(f"{name}: the document's token {tok} was rejected")
        per_token.sort()
        rows[name] = {"compile_ms": compile_ms, "first_mask_ms": first_mask_ms, "tokens": len(per_token),
                      "mask_us_mean": statistics.fmean(per_token), "mask_us_p50": per_token[len(per_token) // 2],
                      "mask_us_p99": per_token[min(len(per_token) - 1, int(0.99 * len(per_token)))]}
    return {"tokenizer_info_ms": tokinfo_ms, "grammars": rows}


def _child_xgrammar(tok_dir: str, vocab: int, eos: int, grammars, docs) -> dict:
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    def build():
        return xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tok_dir), vocab_size=vocab,
                                                  stop_token_ids=[eos])

    def compile_fn(info, schema):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema if schema is not None else {"type": "object"}),
                                            any_whitespace=False, separators=SEPARATORS)

    bitmask = xgr.allocate_token_bitmask(1, vocab)
    result = _measure(build, compile_fn, lambda info, c: xgr.GrammarMatcher(c),
                      lambda m: m.fill_next_token_bitmask(bitmask), lambda m, t: m.accept_token(t), grammars, docs)
    result["version"] = importlib.metadata.version("xgrammar")
    result["threads"] = torch.get_num_threads()
    return result


def _child_llguidance(tok_dir: str, vocab: int, eos: int, grammars, docs) -> dict:
    import array

    import llguidance as llg

    def build():
        return llg.LLTokenizer((Path(tok_dir) / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=eos)

    def compile_fn(info, schema):
        grammar = llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema if schema is not None else {"type": "object"}),
            defaults={"whitespace_flexible": False, "item_separator": SEPARATORS[0],
                      "key_separator": SEPARATORS[1]})
        m = llg.LLMatcher(info, grammar)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return grammar

    words = (vocab + 31) // 32
    buf = array.array("i", [0] * words)  # int32 words, one bit per token
    addr, _ = buf.buffer_info()

    def new_matcher(info, grammar):
        return llg.LLMatcher(info, grammar)

    result = _measure(build, compile_fn, new_matcher, lambda m: m.unsafe_compute_mask_ptr(addr, words * 4),
                      lambda m, t: m.consume_token(t), grammars, docs)
    result["version"] = llg.__version__
    return result


def _footprint(python: str, packages: list[str]) -> int:
    """Bytes on disk of these installed distributions' files (dist-info RECORD)."""
    code = ("import importlib.metadata as md, os, sys\n"
            "total = 0\n"
            "for name in sys.argv[1:]:\n"
            "    try: d = md.distribution(name)\n"
            "    except md.PackageNotFoundError: continue\n"
            "    for f in d.files or []:\n"
            "        p = d.locate_file(f)\n"
            "        total += os.path.getsize(p) if os.path.isfile(p) else 0\n"
            "print(total)\n")
    return int(subprocess.run([python, "-c", code, *packages], check=True, capture_output=True,
                              text=True).stdout)


# Distributions each library brings in beyond the project's own dependencies (torch, numpy, transformers).
EXTRA_DISTS = {"xgrammar": ["xgrammar", "triton", "apache-tvm-ffi", "ninja", "pydantic", "pydantic-core",
                            "typing-inspection", "annotated-types"],
               "llguidance": ["llguidance"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["xgrammar", "llguidance"], help="child mode (internal)")
    ap.add_argument("--input", help="child mode: the driver's JSON input file")
    ap.add_argument("--xgrammar-python", default="/tmp/xg-venv/bin/python")
    ap.add_argument("--llguidance-python", default="/tmp/llg-venv/bin/python")
    ap.add_argument("--out", default="docs/results/structured-outputs/grammar_engines.json")
    args = ap.parse_args()
    if args.engine:
        spec = json.loads(Path(args.input).read_text())
        child = _child_xgrammar if args.engine == "xgrammar" else _child_llguidance
        print(json.dumps(child(spec["tokenizer_dir"], spec["vocab"], spec["eos"], spec["grammars"], spec["docs"])))
        return

    from tide.target import load_tokenizer, resolve_target

    target = resolve_target("ref")
    tok = load_tokenizer(target)
    grammars = {**SCHEMAS, "json_object": None}
    docs = {name: tok.encode(json.dumps(doc), add_special_tokens=False) for name, doc in DOCUMENTS.items()}
    spec = {"tokenizer_dir": str(target.path), "vocab": target.config["vocab_size"],
            "eos": tok.eos_token_id, "grammars": grammars, "docs": docs}
    inp = Path(args.out).with_suffix(".input.json")
    inp.parent.mkdir(parents=True, exist_ok=True)
    inp.write_text(json.dumps(spec))
    results = {"machine": {"cpus": os.cpu_count(), "cpu": cpu_name()}, "engines": {}}
    try:
        for name, python in (("xgrammar", args.xgrammar_python), ("llguidance", args.llguidance_python)):
            proc = subprocess.run([python, __file__, "--engine", name, "--input", str(inp)],
                                  capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
            if proc.returncode != 0:
                raise RuntimeError(f"{name} child failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["footprint_mb"] = _footprint(python, EXTRA_DISTS[name]) / 1e6
            results["engines"][name] = r
    finally:
        inp.unlink(missing_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    _print_table(results)


def _print_table(results: dict) -> None:
    engines = results["engines"]
    names = list(next(iter(engines.values()))["grammars"])
    print(f"{'grammar':18}" + "".join(f"| {e} compile ms | first mask ms | mask us mean/p99 " for e in engines))
    for g in names:
        cells = ""
        for e in engines.values():
            r = e["grammars"][g]
            cells += (f"| {r['compile_ms']:10.1f} | {r['first_mask_ms']:8.2f} | "
                      f"{r['mask_us_mean']:7.1f} / {r['mask_us_p99']:7.1f} ")
        print(f"{g:18}{cells}")
    for name, e in engines.items():
        print(f"{name} {e.get('version')}: tokenizer info {e['tokenizer_info_ms']:.0f} ms, "
              f"footprint {e['footprint_mb']:.1f} MB")


if __name__ == "__main__":
    main()
