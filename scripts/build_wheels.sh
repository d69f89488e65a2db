#!/usr/bin/env bash
# Build the wheels of kvcore, kvio-reference, kvio-cuda and kvio-rocm into dist/.
#
#   scripts/install.sh && scripts/build_wheels.sh
#   pip install dist/*.whl           # then: kvio backends
#
# kvio-cuda's wheel carries its kernel library compiled ahead of time (one per CUDA major
# version, SASS for sm_80 sm_86 sm_89 sm_90a sm_100a sm_120a and PTX of sm_80, see
# plugins/kvio_cuda/README.md), so it runs without nvcc; it is built with the nvcc kvio_cuda
# finds (PATH, $CUDA_HOME, the nvidia-cuda-nvcc package, /usr/local/cuda), or with each of
# KVIO_CUDA_WHEEL_NVCC=/a/bin/nvcc:/b/bin/nvcc. The compile uses kvio_cuda/build.py, hence
# --no-build-isolation in the project's environment (PYTHON, default .venv/bin/python).
# Ends with the architectures inside the kvio-cuda wheel (cuobjdump from PATH, next to nvcc,
# or from the triton wheel) and the wheels' sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf dist
mkdir -p dist
t0=$SECONDS
for pkg in . plugins/kvio_reference plugins/kvio_rocm; do
    "$PY" -m pip wheel -q --no-deps --no-build-isolation -w dist "$pkg"
done
KVIO_CUDA_WHEEL_LIBS=require "$PY" -m pip wheel -q --no-deps --no-build-isolation -w dist \
    plugins/kvio_cuda
echo "built in $((SECONDS - t0)) s:"
ls -l dist/*.whl

# what the kvio-cuda wheel holds
"$PY" - <<'PY'
import json, subprocess, sys, tempfile, zipfile
from pathlib import Path

wheel, = Path("dist").glob("kvio_cuda-*.whl")
if not wheel.name.endswith("-py3-none-linux_x86_64.whl"):
    sys.exit(f"{wheel.name}: expected a py3-none-linux_x86_64 wheel")
sys.path.insert(0, "tests/cuda")
from test_sass import find_cuobjdump  # noqa: E402
from kvio_cuda import build  # noqa: E402

try:
    cuobjdump = find_cuobjdump(build.find_nvcc().path)
except Exception:  # noqa: BLE001
    cuobjdump = None
with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as zf:
    names = [n for n in zf.namelist() if n.startswith("kvio_cuda/prebuilt/")]
    zf.extractall(tmp, names)
    prebuilt = Path(tmp) / "kvio_cuda" / "prebuilt"
    manifest = json.loads((prebuilt / "manifest.json").read_text())
    print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB")
    for lib in manifest["libraries"]:
        path = prebuilt / lib["file"]
        print(f"  {lib['file']} (CUDA {lib['cuda_major']}, nvcc {lib['nvcc']}, "
              f"{path.stat().st_size / 2**20:.1f} MiB, sha256 {lib['sha256']})")
        print(f"    manifest: SASS {' '.join(lib['sass'])}; PTX {' '.join(lib['ptx'])}"
              + (f"; skipped {' '.join(lib['skipped'])}" if lib["skipped"] else ""))
        if cuobjdump is None:
            print("    (no cuobjdump: pip install triton to list the ELF and PTX inside)")
            continue
        for flag in ("--list-elf", "--list-ptx"):
            out = subprocess.run([str(cuobjdump), flag, str(path)], capture_output=True,
                                 text=True, check=True).stdout
            found = sorted({line.split(":", 1)[1].strip() for line in out.splitlines()
                            if ":" in line}, key=lambda n: (len(n), n))
            print(f"    cuobjdump {flag}: {' '.join(found)}")
PY
