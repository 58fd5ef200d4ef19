#!/usr/bin/env bash
# call 11: the two new GPU mutations (ring-bwd-finish-drops-ring-sum, bulk-reduce-repeats-first-source).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MK_SUITE_STEPS="setup mutants" timeout 300 bash scripts/device/suite.sh 2>&1 | grep -vE "^      " | tail -12
