#!/usr/bin/env bash
# The Python side (scripts/test.sh runs it after scripts/setup.sh): installs torch when it is
# missing (the PyPI wheel; it also runs without a GPU, which is what the CPU tests need), then
# the package itself with `pip install .` (pyproject.toml: scikit-build-core builds the C ABI
# library into the package), then checks that the installed package loads its own library.
#   MK_TORCH_SPEC=spec   what pip installs when torch is missing (default torch==2.11.0)
# The package build reuses scripts/setup.sh's compiler cache: the same CUTLASS path
# (MK_CUTLASS_DIR) and the same ccache settings (keys relative to the tree).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
if [[ -x /usr/local/cuda/bin/nvcc ]] && ! command -v nvcc >/dev/null 2>&1; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
pip_install() { python3 -m pip install "$@" || python3 -m pip install --break-system-packages "$@"; }

if ! python3 -c 'import torch' 2>/dev/null; then
  echo "python_setup: installing ${MK_TORCH_SPEC:-torch==2.11.0}"
  pip_install -q "${MK_TORCH_SPEC:-torch==2.11.0}"
fi
if [[ -z ${MK_CUTLASS_DIR:-} ]]; then
  MK_CUTLASS_DIR=$(python3 -c "import os, cutlass_library as c; print(os.path.join(os.path.dirname(c.__file__), 'source', 'include'))" 2>/dev/null || true)
  [[ -n $MK_CUTLASS_DIR ]] && export MK_CUTLASS_DIR
fi
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
echo "python_setup: pip install . (build folder build-pip/)"
t0=$(date +%s)
pip_install -q .
echo "python_setup: installed in $(( $(date +%s) - t0 )) s"
# From outside the tree: the installed package, with the library it carries.
(cd /tmp && env -u MK_CAPI python3 -c '
import os, mkernel, mkernel._capi as c
lib = mkernel.library_path()
assert os.path.dirname(lib) == os.path.dirname(mkernel.__file__), (lib, mkernel.__file__)
c.lib()
import mkernel.torch
print(f"python_setup: mkernel {mkernel.__version__} from {os.path.dirname(mkernel.__file__)} loads {os.path.basename(lib)}")
')
