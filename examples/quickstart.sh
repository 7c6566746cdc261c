#!/usr/bin/env bash
# The main job: Jacobi Forcing end to end on this CPU (see README "Quickstart").
#   bash examples/quickstart.sh            # model A: GSM-Symbolic word problems, one JF round on 9,000 of its own
#                                          # trajectories; about 44 min on 2 idle cores of an Intel Xeon with AMX
#                                          # (docs/quickstart_default, docs/results.md)
#   bash examples/quickstart.sh --smoke    # tiny sizes, ~8 min on one core (CI checks its figures: tests/fixtures/README.md)
#   bash examples/quickstart.sh --real     # model B: SmolLM2-135M-Instruct, ~2 h on 2 idle cores (measured 1 h 57 min)
#                                          # (Jacobi Forcing on 352 samples; learning curve in the report)
#   bash examples/quickstart.sh --code     # the code domain (the default until 2026-12), two JF rounds, about 1 h
#   (--math names the default, as before it was the default)
# Resumable: re-run the same command after an interruption. --fresh starts over.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "${PYTHON:-.venv/bin/python}" -m recipes.quickstart "$@"
