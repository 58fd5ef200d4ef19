#!/usr/bin/env python3
"""A mutation run of the project's own tests: each mutation below is a small, plausible bug
(a dropped wait, a copy one row short, two slots swapped, a skipped weight, a controller that
never moves) applied alone to a scratch copy of the tree; the tests that should catch it are
built and run there. A mutation the tests pass is a SURVIVOR: a hole in the tests. The report
lists every mutation, whether it was caught and by which test; the exit status is 1 when any
survived (or could not be built, or its test was skipped), 0 when every one was caught but
those marked as known holes (each mark names the issue that closes it).

The scratch copy (tracked and untracked, not ignored, files of this tree) gets its own build
folder; with ccache (scripts/setup.sh's settings: keys relative to the tree) only the mutated
files compile anew. Before any mutation the listed tests must pass on the unmutated copy.

  scripts/mutation_check.py                 the CPU mutations, in a scratch copy
  scripts/mutation_check.py --in-place --base-passed
                                            CI's run (.ci/run): the mutations applied to this tree
                                            one at a time and built in its own build (restored
                                            after each, also on SIGTERM); no unmutated run, as
                                            scripts/test.sh has just passed these tests there
  scripts/mutation_check.py --gpu           the GPU ones too (on a GPU machine; the ranks of a
                                            multi-rank test share the GPU under MPS there)
  scripts/mutation_check.py --list          the mutations, without running anything
  scripts/mutation_check.py --only NAME...  just these
  scripts/mutation_check.py --gpu --build-only DIR
                                            builds the GPU mutations' test binaries here (no GPU
                                            needed) into DIR/mutants/<name>/ with mutations.json;
                                            scripts/device/pack_binaries.sh carries them
  scripts/mutation_check.py --prebuilt DIR  on the GPU machine: runs the listed tests of a
                                            prebuilt build (MK_BUILD_DIR, e.g. /tmp/mkb) with each
                                            mutation's binaries swapped in, unmutated first (ranks
                                            of a multi-rank test under MPS at 100/np % each)
Environment: MK_BUILD_DIR (the main build, for its CMake settings; default build),
MK_MUTATION_DIR (the scratch folder, and the logs; default /tmp/mk-mutation), MK_MUTATION_JSON
(also write the report there). MK_TEST_STRIDE is dropped from the tests' environment.
"""
import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Mutation:
    name: str
    file: str       # relative to the tree
    find: str       # must occur exactly once
    replace: str
    tests: list     # ctest names (exact) that should catch it; any failing one catches it.
                    # "name:FILTER": only those GoogleTest cases of CPU test `name`
    why: str        # the bug it stands for
    gpu: bool = False
    targets: list = field(default_factory=list)  # ninja targets to build (default: the tests' binaries)
    # A hole known and not yet closed: reported as SURVIVED (known: why) and not counted in the
    # exit status; once caught, the report says to drop the mark.
    known: str = ""
    # The file is a header the catching CPU test includes itself: the mutant is compiled into that
    # test alone (the library and the other targets keep their objects, so a header the CUDA
    # kernels include costs one test object, not the kernels' rebuild). Only for tests that check
    # the header's own functions; the build checks that the test's object includes the file.
    test_only: bool = False


RING = "src/ops/ring_attention/ring_attention_program.cc"
MOE = "src/ops/moe/moe_program.cc"
FUSED = "src/ops/fused_gemm/fused_gemm_plan.cc"
SPLIT = "src/comm/split_control.h"
TORCH = "python/mkernel/torch.py"
COLL = "src/ops/collective/collective_plan.cc"

MUTATIONS = [
    Mutation("ring-arrival-wait", RING,
             "      if (t > 0 || next_remote) op.waits.push_back(wait_on(RingRegion::kArrived, me, a, 2, t > 0 ? prev : me));\n",
             "",
             ["test_ring_attention_program"],
             "ring attention forwards a block piece before it arrived (drop a wait)"),
    Mutation("ring-copy-one-row-short", RING,
             "    const uint64_t bytes = piece_rows(blk, pc) * g.row_bytes;\n    const uint64_t off = uint64_t(blk) * slot_bytes",
             "    const uint64_t bytes = (piece_rows(blk, pc) - 1) * g.row_bytes;\n    const uint64_t off = uint64_t(blk) * slot_bytes",
             ["test_ring_attention_program"],
             "a forwarded piece one row short (off by one in a copy length)"),
    Mutation("ring-kv-slots-swapped", RING,
             "        op.dsts = {BufRef{slots(kv), next, off}};",
             "        op.dsts = {BufRef{slots(1 - kv), next, off}};",
             ["test_ring_attention_program"],
             "K lands in the next rank's V slots and V in its K slots (swap two slots)"),
    Mutation("ring-bwd-sum-skips-step-1", RING,
             "    for (int s = 1; s <= t; ++s) {\n      const int h = holder(blk, s);",
             "    for (int s = 2; s <= t; ++s) {\n      const int h = holder(blk, s);",
             ["test_ring_attention_program"],
             "the backward's sums ignore the tiles of the first rank after the owner (a sum begins a step late)"),
    Mutation("ring-bwd-roles-comm-first", "src/attention/ring_roles.h",
             "  return RingRole{before * grid < (cta + 1) * comm, cta - before};",
             "  return RingRole{cta < comm, cta - comm + 0 * before};",
             ["test_ring_attention_plan:RingRoles.*"],
             "the ring backward's communication CTAs first by index again: a rank that MPS leaves without its "
             "last CTAs can have no compute CTA (its sums then wait for ever)", test_only=True),
    Mutation("ring-bwd-sum-parts-counted-once", RING,
             "    return from_remote ? 1 : dkv_parts(dpiece_bytes(blk, dp));",
             "    return from_remote ? 1 : 1;",
             ["test_ring_attention_program"],
             "a rank takes a sum sent on the node in parts once its first part arrived (the wait counts one arrival)"),
    Mutation("ring-uneven-user-rows-as-slot", RING,
             "        op.srcs = {BufRef{kv ? RingBuf::kUserV : RingBuf::kUserK, me, in_user(blk, b, pc)}};",
             "        op.srcs = {BufRef{kv ? RingBuf::kUserV : RingBuf::kUserK, me, in_slot(b, pc)}};",
             ["test_ring_attention_program"],
             "uneven shards: the own block sent over the network read from the caller's K/V at the slots' row stride"),
    Mutation("ring-uneven-pieces-of-largest", "src/ops/ring_attention/ring_attention_program.h",
             "  int pieces_of(int r) const { return int((rows_of(r) + chunk_tokens - 1) / chunk_tokens); }",
             "  int pieces_of(int) const { return pieces; }",
             ["test_ring_attention_program"],
             "uneven shards: every block sent in the largest block's pieces (rows past a shorter one go too)"),
    Mutation("ring-uneven-empty-pieces-summed", "src/ops/ring_attention/ring_attention_program.h",
             "    return std::max(0, std::min(kb_per_piece, kbs_of(blk, dpiece_chunk(dp)) - first));",
             "    return std::max(0, std::min(kb_per_piece, kb_per_chunk - first));",
             ["test_ring_attention_program"],
             "uneven shards: a shorter chunk's dK/dV pieces counted as the longest chunk's (items that never run awaited)"),
    Mutation("ring-balanced-bound-exclusive", "src/ops/ring_attention/ring_attention_plan.cc",
             "(r == world - 1 || sum + w[size_t(p)] <= lo))) sum += w[size_t(p++)], ++n;",
             "(r == world - 1 || sum + w[size_t(p)] < lo))) sum += w[size_t(p++)], ++n;",
             ["test_ring_attention_plan:RingBalance.*"],
             "balanced shard rows: a rank stops one token short of the least largest share (the last rank takes the rest)"),
    Mutation("doc-window-next-document", "src/attention/doc_window.h",
             "  w.hi = next > pos ? next : S;",
             "  w.hi = next > pos && found + 2 <= n_docs ? doc_clamp(cu[found + 2], S) : S;",
             ["test_ring_attention_plan:RingDocuments.*"],
             "a token's document window runs on into the next document", test_only=True),
    Mutation("doc-keys-span-from-last-row", "src/attention/doc_window.h",
             "  *lo = first.lo;\n  *hi = causal ? q_last + 1 : last.hi;",
             "  *lo = last.lo;\n  *hi = causal ? q_last + 1 : last.hi;",
             ["test_ring_attention_plan:RingDocuments.*"],
             "a forward tile's key span starts at its last row's document, skipping keys its first rows see",
             test_only=True),
    Mutation("moe-entry-wait", MOE,
             "      if (m.entry) op.waits = {wait_on(MoeRegion::kEntry, m.me, uint32_t(m.to), 1, m.to)};",
             "      if (m.entry) op.waits = {};",
             ["test_moe_plan"],
             "a slot copied into a peer that has not entered the call (drop a wait)"),
    Mutation("moe-layer-combine-before-packed", MOE,
             "      mv.waits = {wait_on(MoeLayerRegion::kPacked, me, 0, uint64_t(El), me)};",
             "      mv.waits = {};",
             ["test_moe_layer_program"],
             "the fused layer sends its combine slots before its experts' second GEMM packed their rows (drop a wait)"),
    Mutation("moe-layer-records-relay-before-header", MOE,
             "      if (p.net_staged) op.waits.push_back(wait_on(MoeLayerRegion::kHdrNet, me, uint32_t(s), 1, s));",
             "      if (p.net_staged) {}",
             ["test_moe_layer_program"],
             "staged, the fused layer relays a source's records before its header landed (the byte count is the "
             "last call's)"),
    Mutation("moe-layer-base-ignores-earlier-sources", "src/ops/moe/moe_plan.cc",
             "      base[size_t(s) * g.El + le] = int32_t(row);",
             "      base[size_t(s) * g.El + le] = offsets[le];",
             ["test_moe_plan", "test_moe_layer_program"],
             "every source's rows of an expert start at the expert's first row (sources overwrite each other)"),
    Mutation("moe-layer-tile-waits-first-source-only", "src/ops/moe/moe_plan.h",
             "  return b1 > b0 && b0 < r1 && r0 < b1;",
             "  return b1 > b0 && b0 <= r0 && r0 < b1;",
             ["test_moe_layer_program"],
             "a GEMM tile row of the fused layer waits only for the source of its first row", test_only=True),
    Mutation("moe-layer-queue-drops-partial-tile-rows", "src/ops/moe/moe_plan.h",
             "  return int((count + tile_rows - 1) / tile_rows);",
             "  return int(count / tile_rows);",
             ["test_moe_layer_program"],
             "the fused layer's queue has no item for an expert's last, partial tile row", test_only=True),
    Mutation("moe-layer-queue-item-of-next-expert", "src/ops/moe/moe_plan.h",
             "        if (int64_t(tile_prefix[mid]) * tn <= i) lo = mid;",
             "        if (int64_t(tile_prefix[mid]) * tn < i) lo = mid;",
             ["test_moe_layer_program"],
             "the fused layer's queue gives an expert's first tile to the expert before it", test_only=True),
    Mutation("replay-shared-slot-spins", "src/comm/replay.cc",
             "          else if (op_ready) units.push_back({UnitKind::kSharedOp, r, int(i)});",
             "          else if (op_ready && false) units.push_back({UnitKind::kSharedOp, r, int(i)});",
             ["test_moe_layer_program:*MoeLayerReplay.*"],
             "the replayer's shared slots: a slot whose unit waits never runs a ready op (so the replays "
             "no longer model CTAs that never block; the fused layer's one-CTA ranks then deadlock)"),
    Mutation("moe-piece-short", MOE,
             "    const uint64_t bytes = uint64_t(std::min<int64_t>(pb_bytes, m.slot_bytes - int64_t(off)));",
             "    const uint64_t bytes = uint64_t(std::min<int64_t>(pb_bytes, m.slot_bytes - int64_t(off))) - 16;",
             ["test_moe_plan"],
             "each piece of a dispatch slot 16 bytes short (off by one in a copy length)"),
    Mutation("fused-row-ready-wait", FUSED,
             "      rp.waits.push_back(wait_on(Region::kRowReady, me, tm, uint64_t(others), owner));",
             "",
             ["test_fused_gemm_plan"],
             "a tile row read before the peers' rows are ready (drop a wait)"),
    Mutation("fused-uneven-shard-offset", FUSED,
             "      return (uint64_t(src_node) * b->Ms + uint64_t(m - b->row0(s))) * row4;",
             "      return (uint64_t(src_node) * b->Ms + uint64_t(m - s * b->Ms)) * row4;",
             ["test_fused_gemm_plan:Sweep/*uneven*"],
             "uneven shards: a node partial lands where an even shard would start (shard offset as s * Ms)"),
    Mutation("controller-never-moves", SPLIT,
             "  if (tail) return s->comm;",
             "  return s->comm;",
             ["test_split_control:SplitSim.*"],
             "the SM-partition controller never moves the split (the model alone must see it)", test_only=True),
    Mutation("controller-jumps-to-ceiling", SPLIT,
             "  int32_t up = s->comm + step;",
             "  int32_t up = lim.hi;",
             ["test_split_control:SplitSim.*"],
             "the controller grows straight to its ceiling (the model alone must see it)", test_only=True,
             known="issue 40 item 1: the rule grows only where its prediction says the call ends sooner, so "
                   "taking the ceiling as the step changes little wherever the models can see: in the "
                   "plan-driven model calibrated on the H200's traces (test_split_calibration), on one node and "
                   "now on 2 nodes (all-gather, where the split matters, never grows there), the jump costs "
                   "at most 2.1 % (gemm_ar W 2 on one node: 0.979 of the best); what could tell is the GPU's "
                   "sweep of static splits (scripts/device/calibration_check.sh), not run yet"),
    Mutation("coll-end-of-call-early", COLL,
             "    if (reads_of[me]) end.waits.push_back(wait_on(CRegion::kReadsDone, me, 0, reads_of[me], -1));",
             "",
             ["test_collective_plan"],
             "a collective's call ends before the node's ranks finished reading its input workspace"),
    Mutation("coll-nodes-summed-out-of-order", COLL,
             "      for (int nn = 0; nn < nodes; ++nn) {\n        if (nn == n) {",
             "      for (int nn = nodes; nn-- > 0;) {\n        if (nn == n) {",
             ["test_collective_plan"],
             "the node partials summed in reverse node order (the documented order, and bit equality, lost)"),
    Mutation("coll-chain-last-op-unordered", COLL,
             "        op.waits.push_back(wait_on(CRegion::kChain, me, uint32_t(c * p.chain_links + p.chain_links - 1), 1, me));",
             "",
             ["test_collective_plan"],
             "a final sum's last op (over 16 buffers: a chain) does not wait for the link before it"),
    Mutation("path-policy-rank-local", "src/ops/control/path_policy.cc",
             "  for (double v : fused_ms) missing |= !(v > 0), f = std::max(f, v);",
             "  for (double v : fused_ms) missing |= !(v > 0), f = v;",
             ["test_control_host:PathPolicy.*"],
             "policy auto decides on one rank's fused time instead of the slowest rank's"),
    Mutation("torch-ag-backward-local", TORCH,
             "        grad_a = torch.ops.mkernel.matmul_reduce_scatter(grad_out, b.t(), ctx.group_name, ctx.world_size,\n"
             "                                                         ctx.shard_rows)",
             "        grad_a = (grad_out @ b.t())[: grad_out.shape[0] // ctx.world_size]",
             ["test_torch_cpu"],
             "all_gather_matmul's backward skips the reduce-scatter (a local product of the right shape)"),
    Mutation("torch-rs-backward-local", TORCH,
             "    full, grad_a = torch.ops.mkernel.all_gather_matmul(grad_out.to(torch.bfloat16).contiguous(), b.t(),\n"
             "                                                       ctx.group_name, ctx.world_size, need_b, ctx.shard_rows)",
             "    full = grad_out.to(torch.bfloat16).repeat(ctx.world_size, 1)\n    grad_a = full @ b.t()",
             ["test_torch_cpu"],
             "matmul_reduce_scatter's backward skips the all-gather (the local gradient repeated)"),
    Mutation("torch-ring-backward-layout-dropped", TORCH,
             "    dq, dk, dv = torch.ops.mkernel.ring_attention_backward(q, k, v, o, lse, grad_o, ctx.causal, ctx.layout, ctx.scale,",
             "    dq, dk, dv = torch.ops.mkernel.ring_attention_backward(q, k, v, o, lse, grad_o, ctx.causal, \"contiguous\", ctx.scale,",
             ["test_torch_cpu"],
             "ring_attention's backward treats a zigzag shard as contiguous (the chunks' positions lost)"),
    Mutation("attention-bwd-outputs-may-alias", "src/attention/sm90_fmha_bwd.cu",
             "      if (i != o)\n",
             "      if (false)\n",
             ["test_attention_args:AttentionBackwardArgs.*"],
             "the attention backward accepts dQ / dK / dV overlapping its inputs or each other",
             targets=["test_attention_args"]),
    Mutation("attention-varlen-any-batch", "src/attention/sm90_fmha_bf16.cu",
             "MK_REQUIRE(B == 1, Code::kInvalidArgument",
             "MK_REQUIRE(B >= 1, Code::kInvalidArgument",
             ["test_attention_args:AttentionVarlenArgs.*"],
             "packed variable-length calls accept B > 1 (the kernels index only batch 0's documents)",
             targets=["test_attention_args"]),
    Mutation("net-sequential-keys", "src/net/libfabric/libfabric_setup.cc",
             "  do {\n    MK_CHECK(random_bytes(key, sizeof(*key)));",
             "  static uint64_t next = 0;\n  *key = ++next;\n  if (false) do {\n    MK_CHECK(random_bytes(key, sizeof(*key)));",
             ["test_net_backend_tcp_np2"],
             "memory keys numbered 1, 2, 3 ... in registration order (guessable by any sender)",
             targets=["test_net_backend"]),
    Mutation("net-no-sender-check", "src/net/libfabric/libfabric_backend.cc",
             "        if (source_ && rank_of(src[i]) < 0)",
             "        if (false && source_ && rank_of(src[i]) < 0)",
             ["test_net_backend_tcp_np2"],
             "a stranger's message with remote CQ data delivered as an arrival (no sender check)",
             targets=["test_net_backend"]),
    Mutation("capi-store-size-trusted", "src/capi/capi.cc",
             "      if (len > max_bytes)",
             "      if (false && len > max_bytes)",
             ["capi_c"],
             "the C ABI allocates whatever size a store callback reports",
             targets=["test_capi_c"]),
    Mutation("private-file-follows-links", "src/common/private_file.cc",
             "flags | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK",
             "flags | O_CLOEXEC | O_NONBLOCK",
             ["test_control_host:SplitMemory.*"],
             "a file named in a setting opened through a symbolic link another user planted"),
    # ---- on the GPU machine
    Mutation("moe-combine-weight", "src/ops/moe/moe_kernels.cu",
             "          const float wk = wt[k0 + j];",
             "          const float wk = 1.f;",
             ["test_gpu_moe_np1", "test_gpu_moe_np2", "test_gpu_moe_layer_np1"],
             "combine sums the experts' rows without the routing weights (skip the combine weight)",
             gpu=True, targets=["test_gpu_moe", "test_gpu_moe_layer"]),
    Mutation("moe-combine-ignores-call-weights", "src/ops/moe/moe_kernels.cu",
             "      wt[kk] = (w ? w : l.weights)[int64_t(t) * k + kk];",
             "      wt[kk] = l.weights[int64_t(t) * k + kk];",
             ["test_gpu_moe_np1"],
             "combine uses the weights the dispatch kept, not the call's own (MoeCombineArgs::topk_weights; "
             "the torch ops' gradients rely on it)",
             gpu=True, targets=["test_gpu_moe"]),
    Mutation("moe-small-cpos-skips-own-slots", "src/ops/moe/moe_plan.h",
             "    cr += rk[k2] == rk[kk];",
             "",
             ["test_moe_plan:MoeRouting.SmallRoute*"],
             "small-batch route (route_pack): an entry's combine row leaves out the token's earlier slots for "
             "the same rank (two experts of one rank in a token: both rows to one place)"),
    Mutation("moe-small-base-of-source-zero", "src/ops/moe/moe_kernels.cu",
             "  for (int s2 = 0; s2 < s; ++s2) b += reinterpret_cast<const int32_t*>(recv_slot(l, s2) + 16)[le];",
             "",
             ["test_gpu_moe_np2"],
             "small-batch layout_unpack: every source's rows start at their expert's offset (sources overwrite "
             "each other)",
             gpu=True, targets=["test_gpu_moe"]),
    Mutation("moe-local-dispatch-rows-collide", "src/ops/moe/moe_kernels.cu",
             "      const int64_t row = int64_t(off[ex[kk]]) + er[kk];",
             "      const int64_t row = int64_t(off[ex[kk]]);",
             ["test_gpu_moe_np1"],
             "one-launch W = 1 dispatch (local_dispatch): every entry of an expert lands on its first row "
             "(the entry's rank among the expert's earlier entries left out)",
             gpu=True, targets=["test_gpu_moe"]),
    Mutation("moe-local-scatter-chunk-base", "src/ops/moe/moe_kernels.cu",
             "      const int64_t row = int64_t(off[e]) + base[e] + l.erank[i0 + kk];",
             "      const int64_t row = int64_t(off[e]) + l.erank[i0 + kk];",
             ["test_gpu_moe_np1"],
             "W = 1 scatter past the small-batch bound (local_scatter): an entry's row leaves out the earlier "
             "route chunks' entries of its expert (chunks overwrite each other)",
             gpu=True, targets=["test_gpu_moe"]),
    Mutation("attention-bwd-diagonal-masked", "src/attention/kernel/bwd.cuh",
             "bool masked = key >= len || (causal && kv_pos0 + key > q_pos_m + q);",
             "bool masked = key >= len || (causal && kv_pos0 + key >= q_pos_m + q);",
             ["test_attention_bwd_py"],
             "the causal backward masks each query's own key (the diagonal) as well",
             gpu=True, targets=["mkernel_capi"]),
    Mutation("attention-varlen-next-document-key", "src/attention/kernel/scheduler.cuh",
             "return ItemInfo{&p.single, 0, h, qt, t.row0, t.len, t.row0, t.len};",
             "return ItemInfo{&p.single, 0, h, qt, t.row0, t.len, t.row0, t.len + 1};",
             ["test_attention_varlen_py"],
             "a packed document's queries also see the next document's first key (forward)",
             gpu=True, targets=["mkernel_capi"]),
    Mutation("attention-varlen-bwd-shared-query-blocks", "src/attention/kernel/bwd.cuh",
             "return BwdBlock{t.local, t.row0, t.len, t.row0 / kBlockM + t.doc, (t.len + kBlockM - 1) / kBlockM};",
             "return BwdBlock{t.local, t.row0, t.len, t.row0 / kBlockM, (t.len + kBlockM - 1) / kBlockM};",
             ["test_attention_varlen_py"],
             "the backward's workspace rows of packed documents by real block, so neighbours share a dQ tile",
             gpu=True, targets=["mkernel_capi"]),
    Mutation("attention-bwd-split-same-heads", "src/attention/kernel/bwd.cuh",
             "const int h0 = hk * (p.H / p.Hkv) + (blockIdx.y % p.head_split) * group;",
             "const int h0 = hk * (p.H / p.Hkv);",
             ["test_attention_bwd_py"],
             "the split schedule's CTAs of one key block all take the group's first query heads",
             gpu=True, targets=["mkernel_capi"]),
    Mutation("attention-bwd-dsum-ignored", "src/attention/kernel/bwd.cuh",
             "dP_rc(r, c) = S_rc(r, c) * (dP_rc(r, c) - ds);",
             "dP_rc(r, c) = S_rc(r, c) * dP_rc(r, c);",
             ["test_attention_bwd_py"],
             "dS = P * dP without the row term rowsum(dO * O)",
             gpu=True, targets=["mkernel_capi"]),
    Mutation("attention-bwd-gqa-first-head-only", "src/attention/kernel/bwd.cuh",
             "  const int steps = m_count * group;",
             "  const int steps = m_count;",
             ["test_attention_bwd_py"],
             "a key block's CTA walks only the first query head of its GQA group",
             gpu=True, targets=["mkernel_capi"]),
    Mutation("ring-bwd-second-query-chunk-dropped", "src/attention/kernel/bwd.cuh",
             "  w.m_begin[1] = 0;\n  for (int i = 0; i < w.nseg; ++i) {",
             "  w.m_begin[1] = 0;\n  for (int i = 0; i < 1; ++i) {",
             ["test_gpu_ring_attention_np2"],
             "the ring backward's items see only the first of the query chunks paired with their key chunk (zigzag)",
             gpu=True, targets=["test_gpu_ring_attention"]),
    Mutation("ring-bwd-finish-drops-ring-sum", "src/attention/kernel/bwd.cuh",
             "auto at = [&](int j) { return u ? t[j] + u[j] : t[j]; };",
             "auto at = [&](int j) { return t[j]; };",
             ["test_gpu_ring_attention_np2"],
             "the ring backward's finishing kernel rounds the owner's own tiles only, without the other ranks' sum",
             gpu=True, targets=["test_gpu_ring_attention"]),
    Mutation("ring-uneven-finish-chunk1-full-length", "src/attention/kernel/bwd.cuh",
             "  const int len = chunk == 0 ? chunk_len : rows - chunk_len;",
             "  const int len = chunk_len;",
             ["test_gpu_ring_attention_np2"],
             "uneven shards: the finishing kernel writes a zigzag shard's second chunk as long as its first (a row "
             "past an odd shard's dK/dV)",
             gpu=True, targets=["test_gpu_ring_attention"]),
    Mutation("ring-uneven-slots-at-own-rows", "src/ops/ring_attention/ring_attention.cc",
             "  l.slots.rows = int(st->slot_rows);",
             "  l.slots.rows = int(st->S_l);",
             ["test_gpu_ring_attention_np2"],
             "uneven shards: the forward reads the K/V slots at this rank's row stride, not the largest shard's",
             gpu=True, targets=["test_gpu_ring_attention"]),
    Mutation("ring-docs-forward-keeps-other-documents", "src/attention/kernel/softmax.cuh",
             "masked = masked || (doc && (col < docs.lo[r] || col >= docs.hi[r]));",
             "masked = masked || (doc && col >= docs.hi[r]);",
             ["test_gpu_ring_attention_np2"],
             "the ring forward over packed documents lets a query see the keys of the documents before its own",
             gpu=True, targets=["test_gpu_ring_attention"]),
    Mutation("ring-docs-backward-skips-last-query-block", "src/attention/kernel/bwd.cuh",
             "const int me = min<int64_t>(g.m_blocks, q_hi <= 0 ? 0 : (q_hi + kBlockM - 1) / kBlockM);",
             "const int me = min<int64_t>(g.m_blocks, q_hi <= 0 ? 0 : q_hi / kBlockM);",
             ["test_gpu_ring_attention_np2"],
             "the ring backward over packed documents skips the query block that holds the end of its keys' "
             "last document",
             gpu=True, targets=["test_gpu_ring_attention"]),
    Mutation("bulk-reduce-repeats-first-source", "src/comm/executor.cuh",
             "const float4 v = reinterpret_cast<const float4*>(st + k * cb)[w];",
             "const float4 v = reinterpret_cast<const float4*>(st)[w];",
             ["test_gpu_ring_attention_np4"],
             "a dedicated CTA's bulk-staged fp32 reduce adds its first source again instead of the others (the ring backward's sums at W >= 3)",
             gpu=True, targets=["test_gpu_ring_attention"]),
    Mutation("fused-final-sum-drops-a-term", "src/gemm/kernel/epilogue.cuh",
             "for (int t = 0; t <= h.fin_nsrc; ++t) {",
             "for (int t = 0; t < h.fin_nsrc; ++t) {",
             ["test_gpu_fused_gemm_np2", "test_gpu_fused_gemm_np4"],
             "the owner's final sum of a reduce-scatter tile leaves out one rank's share (off by one)",
             gpu=True, targets=["test_gpu_fused_gemm"]),
    Mutation("reduce-ignores-bf16-sources", "src/comm/executor.cuh",
             "const bool bf16_src = (op.flags & kDevOpSrcBf16) != 0;",
             "const bool bf16_src = false;",
             ["test_gpu_collective_np2", "test_gpu_collective_np4"],
             "the executor reads a collective's bf16 inputs as fp32 (the source type flag ignored)",
             gpu=True, targets=["test_gpu_collective"]),
    Mutation("reduce-wide-swaps-halves", "src/comm/executor.cuh",
             "        lo = l, hi = h;",
             "        lo = h, hi = l;",
             ["test_gpu_collective_np2", "test_gpu_collective_np4"],
             "the runner's 8-element reduce of bf16 sources puts each word's two halves in each other's place",
             gpu=True, targets=["test_gpu_collective"]),
    Mutation("controller-ignores-forced-switches", "src/comm/split_control.cuh",
             "const bool force = c->n_force > 0 && split_force_due(c, sched);",
             "const bool force = false;",
             ["test_gpu_fused_gemm_np2"],
             "the device controller never applies a forced split (the tests' hook to move CTAs mid-call)",
             gpu=True, targets=["test_gpu_fused_gemm"]),
]


def run(cmd, cwd, log, timeout=None, env=None):
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.time() - t0


def tail(path, n=15):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def scratch_copy(dst):
    """Brings the scratch tree up to this tree: files whose content differs are written anew
    (a new modification time, so the scratch build rebuilds them: a file restored after an
    earlier run's mutation is newer than its object, but not necessarily than this tree's copy);
    files this tree no longer has are removed."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    keep = set()
    for rel in files:
        src = os.path.join(ROOT, rel)
        if not rel or not os.path.isfile(src):
            continue
        keep.add(rel)
        out = os.path.join(dst, rel)
        with open(src, "rb") as f:
            data = f.read()
        if os.path.isfile(out):
            with open(out, "rb") as f:
                if f.read() == data:
                    continue
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "wb") as f:
            f.write(data)
        shutil.copymode(src, out)
    for d, _, names in os.walk(dst):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), dst)
            if rel not in keep:
                os.remove(os.path.join(d, n))


def cmake_args(main_build):
    """The main build's cache settings that matter for a like-for-like scratch build."""
    args = []
    cache = os.path.join(main_build, "CMakeCache.txt")
    keep = ("CMAKE_CUDA_COMPILER:", "MK_CUTLASS_DIR:", "CMAKE_BUILD_TYPE:", "CMAKE_CUDA_ARCHITECTURES:")
    if os.path.exists(cache):
        for line in open(cache):
            if line.startswith(keep) and "=" in line:
                k, v = line.rstrip("\n").split("=", 1)
                if v:
                    args.append(f"-D{k}={v}")
    return args


def test_sources(tree, m):
    """The catching CPU tests' own sources (a test_only mutation's header is compiled into these)."""
    return [os.path.join(tree, "tests", "cpu", t.split(":")[0] + ".cc") for t in m.tests]


def test_object(t):
    """The object file, in the build folder, of CPU test t's own source."""
    name = t.split(":")[0]
    return f"tests/cpu/CMakeFiles/{name}.dir/{name}.cc.o"


@contextlib.contextmanager
def mutated(tree, m):
    """m applied to its file of the tree for the duration of the block, then undone. A test_only
    mutation's header keeps its modification time (nothing that includes it looks out of date)
    and the catching tests' sources get a new one, so only they compile with the mutant, and
    again (a compiler-cache hit) once it is undone."""
    path = os.path.join(tree, m.file)
    original = open(path).read()
    st = os.stat(path)

    def put(text):
        with open(path, "w") as f:
            f.write(text)
        if m.test_only:
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            for src in test_sources(tree, m):
                os.utime(src)

    put(original.replace(m.find, m.replace, 1))
    try:
        yield
    finally:
        put(original)


def verdict_of(m, status, failed, blog):
    """(verdict, by, counts as bad) of one mutation's build and test outcome."""
    if status == "build failed":
        return "NOT BUILT", (tail(blog, 8).strip().splitlines() or [""])[-1], True
    if status != "ok":
        return "SKIPPED", status, True
    if failed:
        return "caught", failed[0] + (" (marked known: drop the mark)" if m.known else ""), bool(m.known)
    if m.known:
        return "SURVIVED", "known: " + m.known, False
    return "SURVIVED", "every listed test passed", True


def summarize(report, bad, logs):
    if os.environ.get("MK_MUTATION_JSON"):
        with open(os.environ["MK_MUTATION_JSON"], "w") as f:
            json.dump(report, f, indent=1)
    caught = sum(r["verdict"] == "caught" for r in report)
    known = sum(r["verdict"] == "SURVIVED" and r["by"].startswith("known: ") for r in report)
    print(f"mutation_check: {caught} of {len(report)} caught, {known} known survivors, {bad} to act on "
          f"(survived, not built, skipped, or a known mark to drop); logs in {logs}")
    return 1 if bad else 0


def ctest_env(env, test):
    """A multi-rank GPU test's ranks share the GPU under MPS at 100/np % each (as suite.sh runs them)."""
    np_ = test.rsplit("_np", 1)[1] if "_np" in test and test.rsplit("_np", 1)[1].isdigit() else "1"
    return dict(env, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(100 // int(np_)))


def run_prebuilt(src, chosen_names):
    """--prebuilt: each mutation's binaries (built by --build-only) swapped into a prebuilt build."""
    build = os.environ.get("MK_BUILD_DIR", "/tmp/mkb")
    listing = os.path.join(src, "mutants", "mutations.json")
    if not os.path.exists(listing):
        sys.exit(f"mutation_check: no {listing} (mutation_check.py --gpu --build-only first)")
    entries = json.load(open(listing))
    if chosen_names is not None:
        entries = [e for e in entries if e["name"] in chosen_names]
    logs = os.environ.get("MK_MUTATION_DIR", "/tmp/mk-mutation") + "/logs"
    os.makedirs(logs, exist_ok=True)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")

    def run_tests(tests, tag):
        failed, tt = None, 0.0
        for t in tests:
            tlog = os.path.join(logs, f"{tag}.{t}.log")
            rc, dt = run(["ctest", "--test-dir", build, "-R", f"^{t}$", "--output-on-failure", "--no-tests=error"],
                         build, tlog, timeout=600, env=ctest_env(env, t))
            tt += dt
            if rc:
                return "ok", (t, tlog), tt
            if "Skipped" in open(tlog, errors="replace").read():
                return "test skipped: " + t, None, tt
        return "ok", failed, tt

    print(f"mutation_check: {len(entries)} prebuilt mutations against {build}; first the unmutated binaries")
    status, failed, tt = run_tests(sorted({t for e in entries for t in e["tests"]}), "unmutated")
    if status != "ok" or failed:
        print(tail(failed[1], 30) if failed else status)
        sys.exit(f"mutation_check: the unmutated binaries fail ({status}, {failed[0] if failed else ''}): fix that first")
    print(f"  unmutated: every test passes (tests {tt:.0f} s)")
    report, bad = [], 0
    for e in entries:
        m = Mutation(e["name"], e["file"], "", "", e["tests"], e["why"], gpu=True, known=e.get("known", ""))
        swapped = []
        try:
            for rel in e["files"]:
                dst = os.path.join(build, rel)
                shutil.copy2(dst, dst + ".unmutated")
                swapped.append(dst)
                shutil.copy2(os.path.join(src, "mutants", e["name"], rel), dst)
            status, failed, tt = run_tests(e["tests"], e["name"])
        finally:
            for dst in swapped:
                os.replace(dst + ".unmutated", dst)
        verdict, by, is_bad = verdict_of(m, status, failed, None)
        bad += is_bad
        print(f"  {m.name:30s} {verdict:9s} {by}  (tests {tt:.0f} s)")
        report.append({"name": m.name, "file": m.file, "why": m.why, "verdict": verdict, "by": by,
                       "tests": m.tests, "test_s": round(tt, 1)})
    return summarize(report, bad, logs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="also the mutations whose tests need a GPU")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--build-only", metavar="DIR", help="build the GPU mutations' binaries into DIR/mutants")
    ap.add_argument("--prebuilt", metavar="DIR", help="run DIR/mutants' binaries in a prebuilt build (GPU machine)")
    ap.add_argument("--in-place", action="store_true",
                    help="mutate this tree and rebuild in its build (MK_BUILD_DIR), not a scratch copy (CI: a "
                         "throw-away clone whose build scripts/test.sh just made); each file is restored after")
    ap.add_argument("--base-passed", action="store_true",
                    help="leave out the unmutated run: the listed tests just passed on this build (CI: "
                         "scripts/test.sh ran them; with --in-place only)")
    o = ap.parse_args()
    if o.prebuilt:
        return run_prebuilt(o.prebuilt, set(o.only) if o.only else None)
    if o.build_only:
        o.gpu = True
    if o.in_place and (o.build_only or o.gpu):
        sys.exit("mutation_check: --in-place is for the CPU mutations (not --gpu or --build-only)")
    if o.base_passed and not o.in_place:
        sys.exit("mutation_check: --base-passed needs --in-place (a scratch copy's build is new)")
    chosen = [m for m in MUTATIONS if (o.gpu or not m.gpu) and (o.only is None or m.name in o.only)
              and (not o.build_only or m.gpu)]
    if o.only:
        unknown = set(o.only) - {m.name for m in MUTATIONS}
        if unknown:
            sys.exit(f"mutation_check: no mutation named {', '.join(sorted(unknown))} (--list)")
    if o.list:
        for m in MUTATIONS:
            print(f"{m.name:30s} {'gpu' if m.gpu else 'cpu'}  {m.file}: {m.why}  [{', '.join(m.tests)}]")
        return 0
    for m in chosen:  # each applies exactly once to the tree as it is
        n = open(os.path.join(ROOT, m.file)).read().count(m.find)
        if n != 1:
            sys.exit(f"mutation_check: {m.name}: its text occurs {n} times in {m.file} (must be once): update the list")

    scratch = os.environ.get("MK_MUTATION_DIR", "/tmp/mk-mutation")
    logs = os.path.join(scratch, "logs")
    main_build = os.path.join(ROOT, os.environ.get("MK_BUILD_DIR", "build"))
    os.makedirs(logs, exist_ok=True)
    # A kill (CI's time limit) still undoes the mutation in hand (mutated()'s finally).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, _: sys.exit(128 + s))
    if o.in_place:
        tree, build = ROOT, main_build
        if not os.path.exists(os.path.join(build, "build.ninja")):
            sys.exit(f"mutation_check: --in-place: no build in {build} (scripts/setup.sh first)")
    else:
        tree, build = os.path.join(scratch, "tree"), os.path.join(scratch, "build")
        scratch_copy(tree)
    # MK_TEST_STRIDE would thin the tests that must catch the mutants: never here.
    env = dict(os.environ, CCACHE_BASEDIR=tree, CCACHE_NOHASHDIR="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for k in ("MK_TEST_INSTALLED", "MK_TEST_STRIDE"):
        env.pop(k, None)
    if not o.in_place:
        rc, _ = run(["cmake", "-S", tree, "-B", build, "-G", "Ninja"] + cmake_args(main_build),
                    tree, os.path.join(logs, "configure.log"), env=env)
        if rc:
            print(tail(os.path.join(logs, "configure.log")))
            sys.exit("mutation_check: the scratch copy did not configure")

    def targets_of(m):
        return m.targets or [t.split(":")[0] for t in m.tests if not t.startswith("test_torch")]

    def build_and_test(m, tag):
        tg = sorted(set(targets_of(m)) | ({"mkernel_capi"} if any(t.startswith("test_torch") for t in m.tests) else set()))
        log = os.path.join(logs, f"{tag}.build.log")
        rc, bt = run(["ninja", "-C", build] + tg, tree, log, env=env)
        if rc:
            return "build failed", None, bt, 0.0, log
        if m.test_only:  # the mutant reached the test only if its object includes the file
            for t in m.tests:
                deps = subprocess.run(["ninja", "-C", build, "-t", "deps", test_object(t)], capture_output=True,
                                      text=True).stdout
                if not any(line.strip().endswith(m.file) for line in deps.splitlines()):
                    with open(log, "a") as f:
                        f.write(f"mutation_check: {test_object(t)} does not include {m.file} (test_only)\n")
                    return "build failed", None, bt, 0.0, log
        failed, tt = None, 0.0
        for t in m.tests:
            tlog = os.path.join(logs, f"{tag}.{t.split(':')[0]}.log")
            if ":" in t:
                name, filt = t.split(":", 1)
                cmd = [os.path.join(build, "tests", "cpu", name), f"--gtest_filter={filt}"]
            else:
                cmd = ["ctest", "--test-dir", build, "-R", f"^{t}$", "--output-on-failure", "--no-tests=error"]
            # One failure is a catch: the rest of the binary's tests need not run (not for the
            # ranks of an MPI test, which would leave the others waiting for them).
            tenv = env if "_np" in t else dict(env, GTEST_FAIL_FAST="1")
            rc, dt = run(cmd, tree, tlog, timeout=1800, env=tenv)
            tt += dt
            if rc:
                failed = (t, tlog)
                break
            if "Skipped" in open(tlog, errors="replace").read():  # a skip proves nothing
                return "test skipped: " + t, None, bt, tt, tlog
        return "ok", failed, bt, tt, None

    if o.build_only:
        return build_mutants(o.build_only, chosen, tree, build, logs, env, targets_of)

    # The unmutated copy first: the tests must pass, or a "caught" below means nothing.
    if o.base_passed:
        print(f"mutation_check: {len(chosen)} mutations in {tree} (in place, build {build}); the unmutated "
              f"run left out: --base-passed (the tests just passed on this build)")
    else:
        print(f"mutation_check: {len(chosen)} mutations in {tree}; first the unmutated tree")
        base = Mutation("unmutated", "", "", "", sorted({t for m in chosen for t in m.tests}), "",
                        targets=sorted({t for m in chosen for t in targets_of(m)}))
        status, failed, bt, tt, blog = build_and_test(base, "unmutated")
        if status != "ok" or failed:
            print(tail(blog or failed[1], 30))
            sys.exit(f"mutation_check: the unmutated tree fails ({status}, {failed[0] if failed else ''}): fix that first")
        print(f"  unmutated: every test passes (build {bt:.0f} s, tests {tt:.0f} s)")

    report, bad = [], 0
    for m in chosen:
        with mutated(tree, m):
            status, failed, bt, tt, blog = build_and_test(m, m.name)
        verdict, by, is_bad = verdict_of(m, status, failed, blog)
        bad += is_bad
        print(f"  {m.name:30s} {verdict:9s} {by}  (build {bt:.0f} s, tests {tt:.0f} s)")
        report.append({"name": m.name, "file": m.file, "why": m.why, "verdict": verdict, "by": by,
                       "tests": m.tests, "build_s": round(bt, 1), "test_s": round(tt, 1)})
    return summarize(report, bad, logs)


# Targets whose file is not tests/gpu/<target> (paths in the build folder).
BUILD_FILES = {"mkernel_capi": "libmkernel_capi.so", "mkernel": "mkernel"}


def build_mutants(out, chosen, tree, build, logs, env, targets_of):
    """--build-only: each GPU mutation's test binaries, built in the scratch copy, into
    out/mutants/<name>/<path in the build>, and out/mutants/mutations.json listing them."""
    root = os.path.join(out, "mutants")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    entries = []
    for m in chosen:
        with mutated(tree, m):
            log = os.path.join(logs, f"{m.name}.build.log")
            rc, bt = run(["ninja", "-C", build] + sorted(set(targets_of(m))), tree, log, env=env)
            files = []
            if rc == 0:
                for t in sorted(set(targets_of(m))):
                    # a GPU test binary, or the C ABI library the Python GPU tests load (MK_CAPI)
                    rel = BUILD_FILES.get(t, os.path.join("tests", "gpu", t))
                    if not os.path.isfile(os.path.join(build, rel)):
                        sys.exit(f"mutation_check: {m.name}: no {rel} in the scratch build")
                    os.makedirs(os.path.dirname(os.path.join(root, m.name, rel)), exist_ok=True)
                    shutil.copy2(os.path.join(build, rel), os.path.join(root, m.name, rel))
                    files.append(rel)
        if rc:
            print(tail(log, 20))
            sys.exit(f"mutation_check: {m.name} did not build")
        print(f"  {m.name:30s} built {', '.join(files)} ({bt:.0f} s)")
        entries.append({"name": m.name, "file": m.file, "why": m.why, "tests": m.tests, "known": m.known,
                        "files": files})
    with open(os.path.join(root, "mutations.json"), "w") as f:
        json.dump(entries, f, indent=1)
    print(f"mutation_check: {len(entries)} GPU mutations built into {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
