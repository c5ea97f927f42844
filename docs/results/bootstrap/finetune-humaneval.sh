#!/bin/bash
# Domain fine-tune (HumanEval) of a chat+GSM8K bootstrap draft; before/after on the new and old domains,
# and the engine-vs-evaluator check at γ = 3 on held-out HumanEval.
#   docs/results/bootstrap/finetune-humaneval.sh var/boot23   (from the repository root)
# (docs/results/bootstrap: run on var/boot23, and on var/boot6 with its outputs then in var/he)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
BOOT=${1:?usage: finetune-humaneval.sh BOOTSTRAP_OUT_DIR}
T=.venv/bin/tide
D=$BOOT/draft
O=$BOOT-he
mkdir -p "$O"
# 1. HumanEval training data (first 124 problems), captured as the workers would
$T draft eval --draft $D --prompts 'humaneval.jsonl.gz[:124]' --chunks-dir $O/train --json $O/base-on-he-train.json --no-progress
# 2. held-out HumanEval (last 40 problems): chunks kept, base draft scored; engine check at γ=3
$T draft eval --draft $D --prompts 'humaneval.jsonl.gz[124:]' --chunks-dir $O/test --engine-gamma 3 --json $O/base-on-he-test.json --no-progress
# 3. fine-tune on the HumanEval chunks
$T draft finetune --from $D --chunks $O/train --out $O/draft-he --steps 200 --lr 3e-4 --batch-rows 2 --warmup-steps 10 --eval-fraction 0.1 --json $O/finetune.json --no-progress
# 4. before/after on both domains, on the same captured sequences
for d in base:$D he:$O/draft-he; do
  name=${d%%:*}; dir=${d#*:}
  $T draft eval --draft $dir --chunks $O/test --json $O/$name-he.json
  $T draft eval --draft $dir --chunks $BOOT/chunks/eval --json $O/$name-old.json
done
