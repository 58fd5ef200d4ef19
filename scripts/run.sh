#!/usr/bin/env bash
# The main job: set up, build, then `mkernel doctor` and `mkernel selfcheck` — as threads of
# one process, and (when mpirun is there) as processes, which maps memory between processes.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
"$root/scripts/setup.sh"
build=${MK_BUILD_DIR:-build}
"$build/mkernel" doctor
echo
echo "== selfcheck: ranks as threads"
"$build/mkernel" selfcheck
if command -v mpirun >/dev/null 2>&1; then
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  np=$(( ngpu > 2 ? ngpu : 2 ))
  echo
  echo "== selfcheck: $np ranks as processes (mpirun)"
  mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$np" "$build/mkernel" selfcheck
fi
