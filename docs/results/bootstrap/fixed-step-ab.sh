#!/bin/bash
# Two from-scratch trainings on boot19's training chunks, side by side, one CPU and one thread each
# (fixed steps: the machine's pace cannot favour one), both then scored on boot19's held-out chunks.
#   docs/results/bootstrap/fixed-step-ab.sh NAME1 "ENV1" "FLAGS1" NAME2 "ENV2" "FLAGS2"
# e.g. fixed-step-ab.sh plain "X=1" "--steps 1200 --aux-norm false" auxscale "AB_AUXSCALE=1" "--steps 1200 --aux-norm false"
# (benchmarks/experiments/abrun.py's docstring lists the variables). Run from the repository root after the boot19 bootstrap.
set -uo pipefail
run() {  # name cpu env flags
  n=$1; c=$2; e=$3; f=$4
  # shellcheck disable=SC2086
  env $e OMP_NUM_THREADS=1 taskset -c "$c" .venv/bin/python benchmarks/experiments/abrun.py --data var/boot19/chunks/train \
    --out "var/ab-$n" --lr 1e-3 --batch-rows 2 --warmup-steps 20 --eval-fraction 0.02 --progress false \
    $f > "var/ab-$n.log" 2>&1
  .venv/bin/tide draft eval --draft "var/ab-$n" --chunks var/boot19/chunks/eval --json "var/ab-$n-eval.json" \
    --no-progress > /dev/null 2>&1
  python3 -c "import json; d = json.load(open('var/ab-$n-eval.json')); print('$n', d['accept_length'], d['top1'])"
}
run "$1" 0 "$2" "$3" &
run "$4" 1 "$5" "$6" &
wait
