#!/bin/bash
# Domain fine-tune (HumanEval) of the session-6 bootstrap draft; before/after on new and old domains.
# The steps live in ../../session-16-bootstrap-finetune-adapt-rollback/finetune-humaneval/run.sh (taking the bootstrap directory); this
# session ran them on var/boot6 (outputs then in var/he, now in var/boot6-he).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exec docs/results/sessions/session-16-bootstrap-finetune-adapt-rollback/finetune-humaneval/run.sh var/boot6
