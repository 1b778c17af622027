#!/usr/bin/env bash
# Build and install causal-conv1d (source-only on PyPI) for exactly the GPU architectures in TORCH_CUDA_ARCH_LIST,
# into the Python environment that `${PYTHON:-python3}` belongs to. torch (a CUDA build), nvcc and the build tools
# (setuptools, wheel, packaging, ninja) must already be installed there; no GPU is needed.
#
#   TORCH_CUDA_ARCH_LIST="9.0" [MAX_JOBS=8] docker/build_causal_conv1d.sh [VERSION | path/to/causal_conv1d-X.tar.gz]
#
# Why a patch: causal-conv1d's setup.py appends a fixed list of `-gencode arch=...` flags (sm_75 ... sm_121 with
# CUDA 13, nine architectures, 10-25 minutes of nvcc), and because those flags contain "arch", torch's
# BuildExtension then ignores TORCH_CUDA_ARCH_LIST altogether. We drop that list from the copy of setup.py we build,
# so torch turns TORCH_CUDA_ARCH_LIST ("9.0", "9.0;10.0", "9.0a", "12.0+PTX", ...) into the -gencode flags itself.
set -euo pipefail

spec=${1:-1.7.0}
py=${PYTHON:-python3}
arch_list=${TORCH_CUDA_ARCH_LIST:-}
if [[ -z $arch_list || $arch_list == native ]]; then
  echo "build_causal_conv1d.sh: set TORCH_CUDA_ARCH_LIST to the architectures to build (e.g. 9.0 for H100/H200);" \
       "there may be no GPU to detect them from at build time" >&2
  exit 2
fi
export TORCH_CUDA_ARCH_LIST=$arch_list

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ -f $spec ]]; then
  sdist=$(readlink -f "$spec")
else
  # SKIP_CUDA_BUILD only for pip's metadata step here: downloading must not compile anything
  CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE "$py" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation \
    "causal-conv1d==$spec" -d "$work/dl"
  sdist=$(ls "$work"/dl/causal_conv1d-*.tar.gz)
fi
tar xzf "$sdist" -C "$work"
src=$(ls -d "$work"/causal_conv1d-*/)

"$py" - "$src/setup.py" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
# the arch flags are appended to cc_flag just above this block in every release since 1.2
for anchor in ("    # HACK: The compiler flag -D_GLIBCXX_USE_CXX11_ABI", "    if FORCE_CXX11_ABI:"):
    if anchor in text:
        break
else:
    sys.exit(f"{path}: no known anchor to patch after the -gencode list; the setup.py layout changed, patch by hand")
drop = ("    # build only TORCH_CUDA_ARCH_LIST: torch's BuildExtension emits -gencode flags when none are given\n"
        "    cc_flag = [f for f in cc_flag if f != '-gencode' and not f.startswith('arch=')]\n")
text = text.replace(anchor, drop + anchor, 1)
compile(text, path, "exec")
open(path, "w").write(text)
print(f"patched {path}: hard-coded -gencode list removed")
PY

echo "building causal-conv1d from $(basename "$sdist") for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST" \
     "with MAX_JOBS=${MAX_JOBS:-$(nproc)}"
t0=$(date +%s)
(cd "$src" && CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-$(nproc)} \
   "$py" -m pip install --no-deps --no-build-isolation --no-cache-dir .)
echo "causal-conv1d built in $(( $(date +%s) - t0 )) s"

# what went into the binary: one ELF per requested architecture (informational; cuobjdump comes with nvcc)
so=$("$py" -c "import importlib.util as u; print(u.find_spec('causal_conv1d_cuda').origin)")
if command -v cuobjdump >/dev/null 2>&1; then
  echo "architectures in $(basename "$so"):"
  cuobjdump --list-elf "$so" | sed -n 's/.*\(sm_[0-9]*[a-z]*\).*/  \1/p' | sort -u
fi
"$py" -c "import causal_conv1d; print('causal_conv1d', causal_conv1d.__version__, 'installed')"
