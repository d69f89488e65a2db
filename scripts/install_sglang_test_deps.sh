#!/usr/bin/env bash
# Install what tests/sglang needs into ./.venv (made by scripts/install.sh): sglang==0.5.23 and
# exactly the packages its plugin loader, memory-pool modules and L2TransferEngine import, all
# pinned and without their own dependencies (sglang's full dependency set pulls a CUDA torch,
# flashinfer, deep-gemm... none of which the CPU pool tests use).
#
#   scripts/install.sh && scripts/install_sglang_test_deps.sh && .venv/bin/python -m pytest -q
#
# Found by importing sglang.srt.plugins, sglang.srt.mem_cache.l2_transfer,
# sglang.srt.mem_cache.pool_host.{mha,mla} and sglang.srt.mem_cache.memory_pool in a fresh
# .venv and adding what the next ImportError named, until none was left. Versions: sglang's
# own pins where it has them (apache-tvm-ffi, compressed-tensors, sentencepiece, tokenizers,
# transformers), else the release current when this was written.
#
# One stub, because that package has no CPU build: torchvision. SGLang imports
# torchvision.transforms at import time of its model configs (which memory_pool imports);
# PyPI's torchvision wheels link libc10_cuda.so of a CUDA torch and do not load next to the
# CPU torch in constraints.txt. tests/sglang/stubs/torchvision stands in (every name raises
# when used; no pool code touches it) and is put on the path by a .pth file.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "run scripts/install.sh first (no .venv)" >&2; exit 1; }

PINS=(
    sglang==0.5.23
    aiohappyeyeballs==2.7.1
    aiohttp==3.14.5
    aiosignal==1.4.0
    annotated-types==0.8.0
    anyio==4.16.0
    apache-tvm-ffi==0.1.11
    certifi==2026.10.19.post1
    compressed-tensors==0.18.0
    dill==0.4.1
    frozenlist==1.8.0
    gguf==0.19.0
    h11==0.16.0
    httpcore2==2.16.2
    httpx2==2.16.2
    huggingface_hub==2.4.0
    idna==3.20
    ipython==9.18.1
    loguru==0.7.3
    msgspec==0.23.0
    multidict==7.2.1
    orjson==3.13.0
    propcache==0.5.4
    psutil==7.2.2
    pybase64==1.5.1
    pydantic==2.14.4
    pydantic_core==2.50.5
    PyYAML==6.0.4
    pyzmq==27.3.0
    regex==2026.11.19
    requests==2.34.2
    safetensors==0.8.0
    sentencepiece==0.2.1
    starlette==1.10.0
    tokenizers==0.23.2
    tqdm==4.70.1
    traitlets==5.16.1
    transformers==5.19.0
    triton==3.9.0
    truststore==0.10.5
    typing-inspection==0.4.5
    urllib3==2.8.0
    yarl==1.25.1
)
.venv/bin/python -m pip install -q --no-deps "${PINS[@]}"
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e integrations/kvcore_sglang

site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$(pwd)/tests/sglang/stubs" > "$site/kvcore_sglang_test_stubs.pth"

.venv/bin/python - <<'EOF'
import importlib.metadata as m

import sglang.srt.mem_cache.l2_transfer  # noqa: F401
import sglang.srt.mem_cache.memory_pool  # noqa: F401
import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
import sglang.srt.mem_cache.pool_host.mla  # noqa: F401
import sglang.srt.plugins  # noqa: F401

print("sglang", m.version("sglang"), "and kvcore-sglang", m.version("kvcore-sglang"),
      "import; tests/sglang will run")
EOF
