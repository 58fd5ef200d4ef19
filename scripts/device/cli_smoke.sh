#!/usr/bin/env bash
# The CLI smoke list of issue 13: every `mkernel bench` command a user tried on one H200 (ranks
# sharing the GPU under CUDA MPS, emulated nodes through MK_RANKS_PER_NODE), run through the
# built CLI and checked — a run must exit 0 with one "check: ...: ok" line per operator
# (bit-exact or within tolerance of a reference) and "bench: passed"; a bad command must exit
# non-zero, quickly, with its one clear error line; W = 1 runs must show no overlap figure.
#
#   MK_BUILD_DIR=/tmp/mkb bash scripts/device/cli_smoke.sh      # the CLI is $MK_BUILD_DIR/mkernel
#   MK_SMOKE_ONLY="ag2x1_* k0" ...                              # a subset (names or globs)
#   MK_SMOKE_LOGS=/tmp/mk-smoke                                 # one log per command
#   MK_SMOKE_MPS=0                                              # do not start MPS (already managed)
#   MK_SMOKE_REPS="--reps 3 --warmup 1"                         # timing calls per run
# One line per command (PASS/FAIL, seconds), then the count; exits 1 if any failed.
set -uo pipefail

B=${MK_BUILD_DIR:-/tmp/mkb}
BIN=$B/mkernel
LOGS=${MK_SMOKE_LOGS:-/tmp/mk-smoke}
ONLY=${MK_SMOKE_ONLY:-}
read -r -a REPS <<< "${MK_SMOKE_REPS:-"--reps 3 --warmup 1"}"
LIMIT=120
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

if [[ ! -x $BIN ]]; then
  echo "cli_smoke: no CLI at $BIN (set MK_BUILD_DIR to the build folder)" >&2
  exit 2
fi
mkdir -p "$LOGS"

# MPS: ranks sharing the GPU run side by side only under it. Started here only if not running,
# and then stopped at exit.
started_mps=0
if [[ ${MK_SMOKE_MPS:-1} != 0 ]] && command -v nvidia-cuda-mps-control >/dev/null; then
  if ! echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then
    nvidia-cuda-mps-control -d && started_mps=1
  fi
fi
cleanup() { [[ $started_mps == 1 ]] && echo quit | nvidia-cuda-mps-control; }
trap cleanup EXIT

npass=0
nfail=0
nrun=0
failed=()

selected() {
  [[ -z $ONLY ]] && return 0
  local p
  for p in ${ONLY//,/ }; do
    # shellcheck disable=SC2053  # a glob on purpose
    [[ $1 == $p ]] && return 0
  done
  return 1
}

# run NAME NP "ENV=V ..." EXPECT -- ARGS...
#   NP 0: the CLI alone (no mpirun, one rank); else mpirun -np NP with every ENV passed by -x.
#   EXPECT "ok:N"      exit 0, N "check: ...: ok" lines, "bench: passed", no WRONG
#          "ok1:N"     the same, and W = 1: no overlap figure (table "-", JSON null)
#          "err:REGEX" exit non-zero (not a timeout, not a crash) with REGEX in the output
run() {
  local name=$1 np=$2 envs=$3 expect=$4
  shift 5
  selected "$name" || return 0
  local log=$LOGS/$name.log json=$LOGS/$name.json
  rm -f "$log" "$json"
  local pct=100
  ((np > 1)) && pct=$((100 / np))
  local cmd=()
  if ((np == 0)); then
    cmd=(env "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct")
    local e
    for e in $envs; do cmd+=("$e"); done
    cmd+=("$BIN")
  else
    cmd=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$np"
         -x "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct")
    local e
    for e in $envs; do cmd+=(-x "$e"); done
    cmd+=("$BIN")
  fi
  local args=("$@")
  [[ $expect == ok* ]] && args+=(--json "$json")
  echo "\$ ${cmd[*]} ${args[*]}" > "$log"
  local t0=$SECONDS
  timeout -k 10 $LIMIT "${cmd[@]}" "${args[@]}" >> "$log" 2>&1
  local rc=$?
  local dt=$((SECONDS - t0))
  nrun=$((nrun + 1))
  local why=""
  if ((rc == 124 || rc == 137)); then
    why="timed out after ${LIMIT} s"
  elif grep -qE "terminate called|Segmentation fault|Aborted|core dumped|signal [0-9]+ at PC" "$log"; then
    why="crashed (rc $rc)"
  elif [[ $expect == ok* ]]; then
    local want=${expect#*:}
    local got
    got=$(grep -cE "^check: .*: ok \(" "$log")
    if ((rc != 0)); then
      why="exit code $rc"
    elif ((got != want)); then
      why="$got of $want 'check: ... ok' lines"
    elif ! grep -qE "^bench: passed" "$log"; then
      why="no 'bench: passed' line"
    elif grep -qE "WRONG|FAILED" "$log"; then
      why="WRONG/FAILED in the output"
    elif [[ $expect == ok1:* ]]; then
      # W = 1: nothing is communicated, so no overlap efficiency anywhere.
      if ! grep -q '"overlap_efficiency": null' "$json" 2>/dev/null; then
        why="no JSON (or an overlap figure in it)"
      elif grep -qE '"overlap_efficiency": -?[0-9]' "$json"; then
        why="an overlap figure in the JSON at W = 1"
      elif awk '$1 ~ /^(ag_gemm|gemm_rs|gemm_ar)$/ && $5 == "ok" && $13 != "-" { bad = 1 } END { exit !bad }' "$log"; then
        why="an overlap figure in the table at W = 1"
      fi
    fi
  else
    local re=${expect#err:}
    if ((rc == 0)); then
      why="exit code 0, expected an error"
    elif ! grep -qE -- "$re" "$log"; then
      why="exit code $rc without the expected error /$re/"
    fi
  fi
  if [[ -z $why ]]; then
    npass=$((npass + 1))
    printf "PASS %-22s %4d s\n" "$name" "$dt"
  else
    nfail=$((nfail + 1))
    failed+=("$name")
    printf "FAIL %-22s %4d s  %s (log: %s)\n" "$name" "$dt" "$why" "$log"
    # The lines that say why: errors, check lines and the verdict.
    grep -E "error|Error|failed|FAILED|timed out|WRONG|^check:|^bench:|^rank [0-9]+:|^mkernel" "$log" | head -8 | sed 's/^/     | /'
  fi
}

# The commands of issue 13 (verbatim but for the reps), each must now succeed.
run ag2x1_tcp           2 "MK_RANKS_PER_NODE=1 MK_NET_PROVIDER=tcp_rxm"                          ok:1 -- bench ag_gemm --m 2048 --n 1024 --k 256 "${REPS[@]}"
run ag2x1_tcp_staged    2 "MK_RANKS_PER_NODE=1 MK_NET_PROVIDER=tcp_rxm MK_NET_STAGING=always"    ok:1 -- bench ag_gemm --m 2048 --n 1024 --k 256 "${REPS[@]}"
run all3x1              3 "MK_RANKS_PER_NODE=1"                                                  ok:3 -- bench all --m 3000 --n 1032 --k 264 "${REPS[@]}"
run all2x2_tcp_staged   4 "MK_RANKS_PER_NODE=2 MK_NET_PROVIDER=tcp_rxm MK_NET_STAGING=always"    ok:3 -- bench all --m 2048 --n 1024 --k 512 "${REPS[@]}"
run ring4x1_tcp         4 "MK_RANKS_PER_NODE=1 MK_NET_PROVIDER=tcp_rxm"                          ok:1 -- bench ring_attention --seq 2048 "${REPS[@]}"
run ring4x1_tcp_staged  4 "MK_RANKS_PER_NODE=1 MK_NET_PROVIDER=tcp_rxm MK_NET_STAGING=always"    ok:1 -- bench ring_attention --seq 2048 "${REPS[@]}"
# Ring attention over packed documents (cu_seqlens, issue 35): forward and backward, over the network.
run ring2x2_tcp_docs    4 "MK_RANKS_PER_NODE=2 MK_NET_PROVIDER=tcp_rxm"                          ok:1 -- bench ring_attention --seq 2048 --doc-len 700 "${REPS[@]}"
# Uneven shards (RingAttentionShape::rows): the uneven run, then the same sequence padded to even shards.
run ring2x2_tcp_uneven  4 "MK_RANKS_PER_NODE=2 MK_NET_PROVIDER=tcp_rxm"                          ok:2 -- bench ring_attention --rows 1500,2600,2049,1800 "${REPS[@]}"
# Packed documents on the contiguous shards that balance their work (ring_balanced_rows), then even zigzag.
run ring4x1_balanced    4 ""                                                                     ok:2 -- bench ring_attention --seq 2048 --doc-len 1500 --balanced "${REPS[@]}"
run all3x2_auto         6 "MK_RANKS_PER_NODE=2"                                                  ok:3 -- bench all --m 1536 --n 520 --k 136 "${REPS[@]}"
# MoE dispatch/combine (issue 15): every preset at W = 1 and 4 on one node, emulated nodes over
# tcp and shm (staged; 512 tokens: hierarchical), 3 ranks (experts rounded up to a multiple of W),
# a bad preset.
run moe1                0 ""                                                                     ok:4 -- bench moe_dispatch --tokens 256 "${REPS[@]}"
run moe4                4 ""                                                                     ok:4 -- bench moe_dispatch "${REPS[@]}"
run moe2x2_tcp_staged   4 "MK_RANKS_PER_NODE=2 MK_NET_PROVIDER=tcp_rxm MK_NET_STAGING=always"    ok:1 -- bench moe_dispatch --preset qwen3 --tokens 256 "${REPS[@]}"
run moe3x2_tcp_hier     6 "MK_RANKS_PER_NODE=2 MK_NET_PROVIDER=tcp_rxm MK_NET_STAGING=always"    ok:2 -- bench moe_dispatch --preset qwen3 --preset mixtral --tokens 512 "${REPS[@]}"
run moe3x1_shm          3 "MK_RANKS_PER_NODE=1 MK_NET_PROVIDER=shm"                              ok:1 -- bench moe_dispatch --preset mixtral --tokens 128 "${REPS[@]}"
run bad_preset          0 "" "err:--preset 'gpt': unknown"                                       -- bench moe_dispatch --preset gpt
# The standalone collectives: each kind once, small counts — all-gather at W = 4, reduce-scatter
# in fp32 at W = 3 with a chunk that is rounded up, all-reduce over 2 emulated nodes x 2 (tcp,
# staged) with a CTA count; a count that is not a multiple of 8.
run coll_ag4            4 ""                                                                     ok:2 -- bench allgather --count 4096 --count 65536 "${REPS[@]}"
run coll_rs3_fp32       3 ""                                                                     ok:1 -- bench reduce_scatter --dtype fp32 --count 8200 --chunk 1001 "${REPS[@]}"
run coll_ar2x2_tcp      4 "MK_RANKS_PER_NODE=2 MK_NET_PROVIDER=tcp_rxm MK_NET_STAGING=always"    ok:1 -- bench allreduce --count 262144 --ctas 4 "${REPS[@]}"
run bad_coll_count      2 "" "err:count = 100 is not a multiple of 8"                            -- bench allreduce --count 100
# Uneven shards (issue 35): the issue's command (M not a multiple of W: split as evenly as it
# allows), explicit rows with a one-row shard, two emulated nodes over tcp; rows that do not sum
# to M, one entry per rank.
run uneven_rs2          2 ""                                                                     ok:1 -- bench gemm_rs --m 5005 --n 1032 --k 264 "${REPS[@]}"
run uneven_rows3        3 ""                                                                     ok:3 -- bench all --rows 700,1,1300 --n 1032 --k 264 "${REPS[@]}"
run uneven_2x2_tcp      4 "MK_RANKS_PER_NODE=2 MK_NET_PROVIDER=tcp_rxm MK_NET_STAGING=always"    ok:3 -- bench all --m 2047 --n 1024 --k 256 "${REPS[@]}"
run bad_rows_sum        2 "" "err:--rows: ag_gemm: the shards' rows sum to 900, not M = 1000"   -- bench ag_gemm --m 1000 --rows 400,500
run bad_rows_count      3 "" "err:--rows: gemm_rs: PlanShape::rows has 2 entries for 3 ranks"   -- bench gemm_rs --rows 400,500
# W = 1: runs, and shows no overlap figure.
run w1_all              0 ""                                                                     ok1:3 -- bench all --m 2048 --n 1024 --k 256 "${REPS[@]}"
# Must fail with a clear error, before any GPU work.
# The reduction path's options (issue 20): deterministic and traced, the per-element route, a
# bad route, --sweep with a shape.
run rs4_det_trace       4 ""                                                                     ok:1 -- bench gemm_rs --m 2048 --n 1024 --k 512 --deterministic --trace /tmp/mk-smoke-trace "${REPS[@]}"
run ar2_red             2 "MK_FUSED_ROUTE=red"                                                   ok:1 -- bench gemm_ar --m 2048 --n 1024 --k 512 "${REPS[@]}"
run bad_route           2 "MK_FUSED_ROUTE=atomic" "err:MK_FUSED_ROUTE='atomic': expects one of bulk,red" -- bench gemm_rs --m 2048 --n 1024 --k 256 "${REPS[@]}"
run bad_sweep_m         0 "" "err:--sweep runs its own shapes"                                   -- bench all --sweep --m 2048
run k0                  0 "" "err:--k '0': must be at least 1"                                   -- bench gemm_ar --m 2048 --n 1024 --k 0
run k0_np2              2 "" "err:--k '0': must be at least 1"                                   -- bench gemm_ar --m 2048 --n 1024 --k 0
run bad_negative        0 "" "err:--m '-2048': must not be negative"                             -- bench ag_gemm --m -2048 --n 1024 --k 256
run bad_text            0 "" "err:--n 'abc': not an integer"                                     -- bench gemm_rs --m 2048 --n abc --k 256
run bad_trailing        2 "" "err:--k '12x': not an integer"                                     -- bench gemm_rs --m 2048 --n 1024 --k 12x
run bad_missing         0 "" "err:--k: missing value"                                            -- bench ag_gemm --m 2048 --n 1024 --k
run bad_overflow        0 "" "err:--reps '99999999999999999999': out of range"                   -- bench ag_gemm --reps 99999999999999999999
run bad_seq             2 "" "err:--seq '0': must be at least 1"                                 -- bench ring_attention --seq 0
run bad_doc_len         0 "" "err:--doc-len applies to ring_attention only"                       -- bench gemm_rs --doc-len 512
run bad_ring_rows       2 "" "err:--rows: ring_attention: 3 shard row counts for 2 ranks"            -- bench ring_attention --rows 100,200,300
run bad_option          0 "" "err:unknown option '--mm'"                                         -- bench ag_gemm --mm 2048
# The operator's own checks at create (collective: the same error on every rank).
run bad_n1030           2 "" "err:N and K must be multiples of 8"                                -- bench ag_gemm --m 2048 --n 1030 --k 256 "${REPS[@]}"
# M not a multiple of W: the bench splits it as evenly as it allows (uneven shards, not an error).
run rs_m3001            2 ""                                                                      ok:1 -- bench gemm_rs --m 3001 --n 1024 --k 256 "${REPS[@]}"

echo "cli_smoke: $npass passed, $nfail failed of $nrun (logs: $LOGS)${failed[*]:+; failed: ${failed[*]}}"
((nfail == 0 && nrun > 0))
