#!/usr/bin/env bash
# Everything a multi-GPU machine must show, in one call (run it the day a machine with several
# GPUs is lent; on one GPU it degrades to what one GPU can run, ranks sharing it under MPS,
# and says that its times are not comparable):
#   1. correctness: the configuration matrix (test_gpu_matrix) with one rank per GPU at
#      W = 2, 4, 8 over real NVLink, and 2 emulated nodes x W/2 over tcp_rxm and shm;
#   2. the fused operators against cuBLAS + NCCL (mkernel bench: speedups, overlap efficiency)
#      on the Llama-70B TP8 shapes (AG+GEMM of the gate/up projection, GEMM+RS of the down
#      projection, GEMM+AR of the attention output) at 4096 and 16384 tokens;
#   3. ring attention against NCCL all-gather + attention and a send/recv ring, and its fused backward
#      against the same kernel without communication, S/rank 4096-16384;
#   4. the same benchmarks with 2 emulated nodes (the network path between them);
#   5. MoE dispatch/combine and the MoE layer: test_gpu_moe and test_gpu_moe_layer at every W, mkernel bench
#      moe_layer, and mkernel bench moe_dispatch (the DeepEP
#      presets; the EP8 targets: throughput dispatch >= 150 GB/s per GPU, low-latency
#      dispatch <= 80 us and combine <= 120 us at 128 tokens), one node and 2 emulated nodes
#      (hierarchical over tcp_rxm);
#   6. mkernel.torch: tests/gpu/test_torch_ops.py under torchrun at every W (ring attention's
#      gradients among them), bench/bench_torch.py (against symm_mem's fused ops and NCCL +
#      matmul, one GPU per rank) and examples/decoder_layer.py at 8192 tokens;
#   7. the SM-partition controller: the matrix again with MK_FUSED_SPLIT=auto, and `mkernel bench
#      all --splits` (static splits 1..32 against the controller) at every W and 2 nodes x W/2;
#      uneven shards (`mkernel bench all --m 8191` and `--rows`, against the padded even case);
#      and policy auto: `mkernel bench all --path fused|unfused|auto` at M 512 and 8192, every W;
#   8. the standalone collectives: test_gpu_collective at every W and 2 emulated nodes x W/2
#      (tcp_rxm, staged), and `mkernel bench allgather|reduce_scatter|allreduce` (bf16, 64 KiB ..
#      256 MiB; all-reduce in fp32 too) against NCCL and a device copy, one node and 2 emulated
#      nodes.
# Binaries from MK_BUILD_DIR (default /tmp/mkb: scripts/device/suite.sh setup puts them there).
# JSON results and logs go to $OUT (packed as multigpu_logs.tgz).
set -uo pipefail
B=${MK_BUILD_DIR:-/tmp/mkb}
RESULT=${OUT:-/tmp/mk-out}
L=/tmp/mk-multigpu
rm -rf "$L" && mkdir -p "$L" "$RESULT"
trap 'tar -C "$L" -czf "$RESULT/multigpu_logs.tgz" . 2>/dev/null' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
(( ngpu >= 1 )) || { echo "multigpu: no GPU"; exit 2; }
nvidia-smi topo -m > "$L/topo.txt" 2>&1 || true
shared=0
if (( ngpu == 1 )); then
  shared=1
  echo "multigpu: one GPU: ranks share it under MPS (correctness only; times are not comparable)"
  echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
fi
ws=(); for w in 2 4 8; do (( w <= ngpu || (shared && w <= 4) )) && ws+=($w); done
fails=0
run() {  # name np [env...] -- command...
  local name=$1 np=$2; shift 2
  local env=(); while [[ $1 != -- ]]; do env+=(-x "$1"); shift; done; shift
  (( shared )) && env+=(-x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np)))
  local t0=$(date +%s)
  timeout 300 mpirun --allow-run-as-root --bind-to none --oversubscribe -np "$np" "${env[@]}" "$@" > "$L/$name.log" 2>&1
  local rc=$?
  (( rc == 0 )) || fails=$((fails + 1))
  printf '%-4s %-40s %4ss\n' "$([[ $rc == 0 ]] && echo PASS || echo FAIL)" "$name" "$(( $(date +%s) - t0 ))"
  (( rc == 0 )) || grep -E "Failure|wrong|error|FAILED|WRONG" "$L/$name.log" | head -5 | sed 's/^/      /'
}

# 1. correctness
for w in "${ws[@]}"; do
  run "matrix_w$w" "$w" -- "$B/tests/gpu/test_gpu_matrix"
  if (( w >= 2 )); then
    for p in tcp_rxm shm; do
      run "matrix_2x$((w / 2))_$p" "$w" MK_RANKS_PER_NODE=$((w / 2)) MK_NET_PROVIDER=$p -- "$B/tests/gpu/test_gpu_matrix"
    done
  fi
done

# 7a. the controller's correctness: the matrix with the controller on
for w in "${ws[@]}"; do
  run "matrix_auto_w$w" "$w" MK_FUSED_SPLIT=auto -- "$B/tests/gpu/test_gpu_matrix"
  (( w >= 4 )) && run "matrix_auto_2x$((w / 2))_tcp" "$w" MK_FUSED_SPLIT=auto MK_RANKS_PER_NODE=$((w / 2)) \
    MK_NET_PROVIDER=tcp_rxm -- "$B/tests/gpu/test_gpu_matrix"
done

# 8a. the standalone collectives' correctness (every kind and dtype, bit for bit)
for w in "${ws[@]}"; do
  run "collective_w$w" "$w" -- "$B/tests/gpu/test_gpu_collective"
  (( w >= 4 )) && run "collective_2x$((w / 2))_tcp" "$w" MK_RANKS_PER_NODE=$((w / 2)) MK_NET_PROVIDER=tcp_rxm \
    MK_NET_STAGING=always -- "$B/tests/gpu/test_gpu_collective"
done

# 5a. MoE correctness (every routing, both modes, graph replays, bad inputs)
for w in "${ws[@]}"; do
  run "moe_w$w" "$w" -- "$B/tests/gpu/test_gpu_moe" --gtest_filter=-MoeDeadRank.*
  (( w >= 4 )) && run "moe_2x$((w / 2))_tcp" "$w" MK_RANKS_PER_NODE=$((w / 2)) MK_NET_PROVIDER=tcp_rxm -- \
    "$B/tests/gpu/test_gpu_moe" --gtest_filter=-MoeDeadRank.*
  run "moe_layer_w$w" "$w" -- "$B/tests/gpu/test_gpu_moe_layer"
  (( w >= 4 )) && run "moe_layer_2x$((w / 2))_tcp" "$w" MK_RANKS_PER_NODE=$((w / 2)) MK_NET_PROVIDER=tcp_rxm -- \
    "$B/tests/gpu/test_gpu_moe_layer"
done

# 2-4. benchmarks (Llama-70B: hidden 8192, intermediate 28672, TP = W)
for w in "${ws[@]}"; do
  for tok in 4096 16384; do
    run "bench_ag_w${w}_t$tok" "$w" -- "$B/mkernel" bench ag_gemm --m $tok --n $((2 * 28672 / w)) --k 8192 \
      --json "$RESULT/ag_w${w}_t$tok.json"
    run "bench_rs_w${w}_t$tok" "$w" -- "$B/mkernel" bench gemm_rs --m $tok --n 8192 --k $((28672 / w)) \
      --json "$RESULT/rs_w${w}_t$tok.json"
    run "bench_ar_w${w}_t$tok" "$w" -- "$B/mkernel" bench gemm_ar --m $tok --n 8192 --k $((8192 / w)) \
      --json "$RESULT/ar_w${w}_t$tok.json"
  done
  run "bench_ring_w$w" "$w" -- "$B/mkernel" bench ring_attention --seq 4096 --seq 8192 --seq 16384 \
    --json "$RESULT/ring_w$w.json"
  if (( w > 1 )); then  # uneven shards around 8192 tokens per rank, against the same sequence padded to even
    rows=""
    for ((r = 0; r < w; ++r)); do rows+="${rows:+,}$((8192 + (r * 1237) % 2048 - 1024))"; done
    run "bench_ring_uneven_w$w" "$w" -- "$B/mkernel" bench ring_attention --rows "$rows" \
      --json "$RESULT/ring_uneven_w$w.json"
    run "bench_ring_balanced_w$w" "$w" -- "$B/mkernel" bench ring_attention --seq 8192 --doc-len 3000 --balanced \
      --json "$RESULT/ring_balanced_w$w.json"
  fi
  if (( w >= 4 )); then
    run "bench_all_2nodes_w$w" "$w" MK_RANKS_PER_NODE=$((w / 2)) MK_NET_PROVIDER=tcp_rxm -- "$B/mkernel" bench all \
      --json "$RESULT/all_2nodes_w$w.json"
    run "bench_ring_2nodes_w$w" "$w" MK_RANKS_PER_NODE=$((w / 2)) MK_NET_PROVIDER=tcp_rxm -- "$B/mkernel" bench \
      ring_attention --seq 8192 --json "$RESULT/ring_2nodes_w$w.json"
  fi
done
# 7b. static splits against the controller
for w in "${ws[@]}"; do
  run "bench_splits_w$w" "$w" -- "$B/mkernel" bench all --splits --json "$RESULT/splits_w$w.json"
  (( w >= 4 )) && run "bench_splits_2nodes_w$w" "$w" MK_RANKS_PER_NODE=$((w / 2)) MK_NET_PROVIDER=tcp_rxm -- \
    "$B/mkernel" bench all --splits --json "$RESULT/splits_2nodes_w$w.json"
done
# 7b. uneven shards: M one short of a multiple of W (shards differ by a row) and one large shard,
#     each beside the same operator padded to even shards (JSON padded_even: target >= 0.98)
for w in "${ws[@]}"; do
  (( w > 1 )) || continue
  run "bench_uneven_w$w" "$w" -- "$B/mkernel" bench all --m 8191 --n 8192 --k $((8192 / w)) \
    --json "$RESULT/uneven_m_np$w.json"
  rows=$(python3 -c "import sys; W=int(sys.argv[1]); print(','.join(str(3072 if s == 0 else (8192 - 3072) // (W - 1)) for s in range(W)))" "$w")
  run "bench_uneven_rows_w$w" "$w" -- "$B/mkernel" bench all --rows "$rows" --n 8192 --k $((8192 / w)) \
    --json "$RESULT/uneven_rows_np$w.json"
done
# 7c. policy auto: each fused operator on each path (fused, unfused, auto) at a small and a large
#     M (auto must come within 0.98 of the faster path: scripts/device/collective_check.sh's summary
#     reads the same file names)
for w in "${ws[@]}"; do
  for m in 512 8192; do
    for path in fused unfused auto; do
      run "bench_path_w${w}_m${m}_$path" "$w" -- "$B/mkernel" bench all --m $m --n 8192 --k $((8192 / w)) \
        --path $path --json "$RESULT/paths_np${w}_${m}x8192x$((8192 / w))_$path.json"
    done
  done
done
# 5b. MoE benchmarks: every preset (DeepEP's throughput and low-latency shapes, Qwen3, Mixtral)
for w in "${ws[@]}"; do
  run "bench_moe_w$w" "$w" -- "$B/mkernel" bench moe_dispatch --json "$RESULT/moe_w$w.json"
  (( w >= 4 )) && run "bench_moe_2nodes_w$w" "$w" MK_RANKS_PER_NODE=$((w / 2)) MK_NET_PROVIDER=tcp_rxm -- \
    "$B/mkernel" bench moe_dispatch --json "$RESULT/moe_2nodes_w$w.json"
  # The MoE layer (issue #16's target: >= 1.3x NCCL + cuBLAS at 4096 tokens per rank, EP8).
  run "bench_moe_layer_w$w" "$w" -- "$B/mkernel" bench moe_layer --json "$RESULT/moe_layer_w$w.json"
done
# 8b. the standalone collectives against NCCL and a device copy (nccl-tests' algbw / busbw)
for w in "${ws[@]}"; do
  for op in allgather reduce_scatter allreduce; do
    run "bench_${op}_w$w" "$w" -- "$B/mkernel" bench $op --json "$RESULT/${op}_w$w.json"
    # Over tcp the 256 MiB calls take a while: fewer of them.
    (( w >= 4 )) && run "bench_${op}_2nodes_w$w" "$w" MK_RANKS_PER_NODE=$((w / 2)) MK_NET_PROVIDER=tcp_rxm -- \
      "$B/mkernel" bench $op --reps 5 --warmup 1 --json "$RESULT/${op}_2nodes_w$w.json"
  done
  run "bench_allreduce_fp32_w$w" "$w" -- "$B/mkernel" bench allreduce --dtype fp32 \
    --json "$RESULT/allreduce_fp32_w$w.json"
done
# 6. mkernel.torch (python/ from the tree, the carried C ABI library)
trun() {  # name np [env...] -- script args...
  local name=$1 np=$2; shift 2
  local env=(); while [[ $1 != -- ]]; do env+=("$1"); shift; done; shift
  (( shared )) && env+=(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np)))
  local t0=$(date +%s)
  env MK_CAPI="$B/libmkernel_capi.so" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 "${env[@]}" \
    timeout 600 python3 -m torch.distributed.run --standalone --nproc-per-node "$np" "$@" > "$L/$name.log" 2>&1
  local rc=$?
  (( rc == 0 )) || fails=$((fails + 1))
  printf '%-4s %-40s %4ss\n' "$([[ $rc == 0 ]] && echo PASS || echo FAIL)" "$name" "$(( $(date +%s) - t0 ))"
  (( rc == 0 )) || grep -E "FAIL|Error" "$L/$name.log" | head -5 | sed 's/^/      /'
}
for w in "${ws[@]}"; do
  trun "torch_w$w" "$w" -- tests/gpu/test_torch_ops.py
  (( w >= 4 )) && trun "torch_2x$((w / 2))_tcp" "$w" MK_RANKS_PER_NODE=$((w / 2)) MK_NET_PROVIDER=tcp_rxm \
    MK_NET_STAGING=always -- tests/gpu/test_torch_ops.py
  trun "bench_torch_w$w" "$w" -- bench/bench_torch.py --out "$RESULT/torch_w$w.json"
  # The decoder block trained sequence parallel (ring attention forward and backward, TP MLP),
  # checked against plain torch on one GPU; its tokens/s (in the log).
  trun "decoder_w$w" "$w" -- examples/decoder_layer.py --tokens 8192 --reps 10
done
(( shared )) && echo quit | nvidia-cuda-mps-control
grep -hE "^(ag_gemm|gemm_rs|gemm_ar|ring|deepep_ht|deepep_ll|qwen3|mixtral|allgather|reduce_scatter|allreduce)" \
  "$L"/bench_*.log | sort | uniq > "$RESULT/bench_summary.txt"
echo "multigpu: $fails failure(s); GPUs: $ngpu$([[ $shared == 1 ]] && echo ' (shared: times not comparable)')"
(( fails == 0 ))
