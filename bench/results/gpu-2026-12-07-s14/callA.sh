#!/usr/bin/env bash
# Call A (2026-12-07, fourteenth session): the tree at fa981b6, built on the GPU machine
# (.devcarry from scripts/device/prepare.sh), then every GPU test and the CLI lines. The first
# GPU run of the ring backward's interleaved roles (472fe2a) and of the comm changes since
# (ProgramBuilder::proxy_done_op in the ring attention program).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MK_SUITE_STEPS="setup unit smoke" timeout 585 bash scripts/device/suite.sh 2>&1 | grep -vE "^unit PASS" | tail -60
