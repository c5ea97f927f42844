#!/bin/bash
# Feature noise at a fixed number of steps: two from-scratch trainings on boot18's training chunks,
# 1,500 steps each (the bootstrap's lr, batch and warm-up), identical but for --feature-noise, run at
# the same time on one CPU each with one thread (fixed steps: the machine's pace cannot favour one),
# then both scored on boot18's held-out chunks (the bootstrap's 32 held-out prompts).
# Run from the repository root after the boot18 bootstrap (README.md).
set -uo pipefail
run() {  # name cpu extra-flags...
  n=$1; c=$2; shift 2
  OMP_NUM_THREADS=1 taskset -c "$c" .venv/bin/python -m services.trainer.training --data var/boot18/chunks/train \
    --out var/ab-$n --steps 1500 --lr 1e-3 --batch-rows 2 --warmup-steps 20 --eval-fraction 0.02 --progress false \
    "$@" > var/ab-$n.log 2>&1
  .venv/bin/tide draft eval --draft var/ab-$n --chunks var/boot18/chunks/eval --json var/ab-$n-eval.json --no-progress
}
run plain 0 &
run noise 1 --feature-noise 0.1 &
wait
# second pair (README): weight decay
run wd01 0 --weight-decay 0.1 &
run wd05 1 --weight-decay 0.5 &
wait
