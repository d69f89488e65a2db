#!/usr/bin/env bash
# Install kvcore, its three plugins, the SGLang integration (without SGLang) and the test/dev
# extras into ./.venv (created if absent).
#
#   scripts/install.sh            # .venv with torch==2.13.0 (CPU wheel) from constraints.txt
#   KVCORE_PYTHON_ENV=system scripts/install.sh
#                                 # use the current python's own torch (e.g. a CUDA image);
#                                 # installs only the kvcore packages, without dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(-e . -e plugins/kvio_reference -e plugins/kvio_cuda -e plugins/kvio_rocm
      -e integrations/kvcore_sglang)

if [ "${KVCORE_PYTHON_ENV:-venv}" = system ]; then
    python3 -m pip install -q --no-deps --no-build-isolation "${PKGS[@]}"
    exit 0
fi

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt torch
.venv/bin/python -m pip install -q -c constraints.txt -e ".[dev]" "${PKGS[@]:2}"
echo "installed into $(pwd)/.venv: $(.venv/bin/python -c 'import torch, kvcore; print("kvcore", kvcore.__version__, "torch", torch.__version__)')"
