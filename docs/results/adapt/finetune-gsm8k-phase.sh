#!/bin/bash
# What one phase of `tide bench adapt --concurrency 2` collects (~13k GSM8K tokens) buys the chat-only
# starting draft, trained as the bench's trainer would (one CPU, one thread), with two cycle settings.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
T=.venv/bin/tide
# the bench's cached starting draft (tide bench adapt --bootstrap-minutes 15 creates it)
C=$(ls -d "${TIDE_CACHE_DIR:-$HOME/.cache/tide}"/drafts/bootstrap-chat-68bc1d4f3672)
D=$C/draft
O=var/ft
mkdir -p $O
# 1. GSM8K data as the workers capture it: 110 test problems to train on, 60 others held out
$T draft eval --draft $D --prompts 'gsm8k_test.jsonl[:110]' --chunks-dir $O/train --json $O/base-train.json --no-progress --max-tokens 128
$T draft eval --draft $D --prompts 'gsm8k_test.jsonl[1200:1260]' --chunks-dir $O/test --json $O/base-test.json --no-progress --max-tokens 128
# 2. A = the bench's cycle (24 steps x 4 rows, lr 3e-4); B = 48 steps x 2 rows, lr 1e-3; one core each
#    (the measured run had A on CPU 0 and B on CPU 1 at the same time: 50.6 s and 49.8 s of training)
taskset -c 0 $T draft finetune --from $D --chunks $O/train --out $O/A --steps 24 --batch-rows 4 --lr 3e-4 --warmup-steps 4 --threads 1 --json $O/A.json --no-progress
taskset -c 0 $T draft finetune --from $D --chunks $O/train --out $O/B --steps 48 --batch-rows 2 --lr 1e-3 --warmup-steps 4 --threads 1 --json $O/B.json --no-progress
# 3. the new domain (held-out GSM8K) and the old one (the bootstrap's held-out chat), same sequences
for d in base:$D A:$O/A B:$O/B; do
  name=${d%%:*}; dir=${d#*:}
  $T draft eval --draft $dir --chunks $O/test --json $O/$name-test.json --no-progress
  $T draft eval --draft $dir --chunks $C/chunks/eval --json $O/$name-chat.json --no-progress
done
