#!/usr/bin/env bash
# The main job: set up .venv if needed, then run lmctl inside a real vLLM engine
# (SmolLM2-135M on the CPU, two LoRA adapters, a shared document): time-to-first-token
# cold, warm from the store and after an engine restart. A few minutes on 2 cores.
# `.venv/bin/python demo/store_tour.py` is a seconds-long tour of the store library alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python demo/vllm_demo.py "$@"
