#!/usr/bin/env bash
# Install kvcore, its three plugins, the SGLang integration (without SGLang) and the test/dev
# extras into ./.venv (created if absent).
#
#   scripts/install.sh            # .venv with torch==2.13.0 (CPU wheel) from constraints.txt
#   KVCORE_PYTHON_ENV=system scripts/install.sh
#                                 # use the current python's own torch (e.g. a CUDA image);
#                                 # installs only the kvcore packages, without dependencies
#
# Each step prints a line first, and pip a line per package it collects, downloads and
# installs (its whole output is kept in .venv/pip-install.log). Afterwards `kvio` is .venv/bin/kvio: run it so, or `source .venv/bin/activate`.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(-e . -e plugins/kvio_reference -e plugins/kvio_cuda -e plugins/kvio_rocm
      -e integrations/kvcore_sglang)
START=$SECONDS
step() { echo "==> [$1] $2 ($((SECONDS - START)) s)"; }

# pip install, showing a line per package (collected or obtained, downloaded, built,
# installed); pip's whole output goes to .venv/pip-install.log, whose tail is printed if pip
# fails.
pip_install() {
    local log=.venv/pip-install.log
    if ! .venv/bin/python -m pip install "$@" 2>&1 | tee -a "$log" \
            | awk '/^(Obtaining|Collecting|Downloading|Installing collected|Successfully)/ ||
                   /^  Building editable for .*started/ { sub(/^ +/, ""); print "    " $0; fflush() }'
    then
        echo "pip install failed; the last lines of $log:" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
}

if [ "${KVCORE_PYTHON_ENV:-venv}" = system ]; then
    step 1/1 "kvcore and its plugins into $(python3 -c 'import sys; print(sys.prefix)') (no dependencies)"
    python3 -m pip install --no-deps --no-build-isolation "${PKGS[@]}"
    # without dependencies: say now which of kvcore's own this python lacks (kvio would stop
    # at the first with an import error); importlib-metadata has the stdlib's as fallback
    missing=$(python3 - <<'PY'
import importlib.util
print(" ".join(pkg for pkg, mod in (("torch", "torch"), ("pluggy", "pluggy"),
                                    ("attrs", "attrs"), ("numpy", "numpy"))
               if importlib.util.find_spec(mod) is None))
PY
)
    if [ -n "$missing" ]; then
        echo "==> this python lacks kvcore's dependencies: $missing" >&2
        echo "    install them (python3 -m pip install $missing), or run without" \
             "KVCORE_PYTHON_ENV=system for a .venv with everything" >&2
        exit 1
    fi
    echo "==> done in $((SECONDS - START)) s; kvio is $(command -v kvio || echo 'python3 -m kvcore.cli')"
    exit 0
fi

PYTHON=${PYTHON:-python3}
if [ -x .venv/bin/python ]; then
    step 1/4 "reusing $(pwd)/.venv"
else
    step 1/4 "creating $(pwd)/.venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv .venv
fi
step 2/4 "upgrading pip"
.venv/bin/python -m pip install -q --upgrade pip
step 3/4 "torch (pinned in constraints.txt; the largest download)"
pip_install -c constraints.txt torch
step 4/4 "kvcore, kvio_reference, kvio_cuda, kvio_rocm (editable) and the test/dev extras"
pip_install -c constraints.txt -e ".[dev]" "${PKGS[@]:2}"
echo "==> installed into $(pwd)/.venv in $((SECONDS - START)) s: $(.venv/bin/python -c 'import torch, kvcore; print("kvcore", kvcore.__version__, "torch", torch.__version__)')"
echo "    run .venv/bin/kvio, or put it on PATH: source .venv/bin/activate"
