// mkernel — the communication role as a kernel policy (device side). The persistent GEMM and
// attention kernels take one of two policies as a template parameter, as they take a tile
// scheduler:
//   NoComm    plain launches: no communication program; every hook compiles to nothing.
//   CommRole  a fused operator's launch: CTAs of the grid run the operator's communication
//             program (the ops of executor.cuh) beside the compute tiles, and the tiles honour
//             the program's per tile-row hooks.
//
// What a kernel asks of its policy:
//   - Which CTAs communicate. Two forms, both run-time counts of the lowest block indices:
//       dedicated_cta()  the first Params::dedicated_ctas CTAs run ops only, for the whole
//                        launch (attention: the ring's forwarding CTAs);
//       take_op()        per work item, by the CTA's scheduling thread: the first
//                        role_counts[0] CTAs (device memory, re-read per item, so
//                        set_comm_ctas() or a controller may change it while the kernel runs)
//                        take the program's ops in order; they compute a tile meanwhile when
//                        the next op is not ready (Params::peek_ops) and for good once no op is
//                        left; help_op() hands a CTA without tiles the remaining ops (GEMM).
//     A kernel uses the form its schedule supports; the launch fills only that count.
//   - Running an op: run_op() on the consumer threads; run_dedicated() is a dedicated CTA's
//     whole loop (bulk-copy stages in the kernel's shared memory).
//   - The per-tile hooks: load_waits() before loading a tile row (then a proxy fence, so TMA
//     reads see the peers' stores), store_waits() before storing a tile, store_signals() after
//     storing it; wait_arrival() before loading data that an op delivers elsewhere than by
//     tile row (attention's ring blocks).
//   - The call's epoch (call_epoch(), read at the start) and the end of the call (finish(): the
//     last CTA advances the epoch).
//
// Needs no CUTLASS headers (barriers: device/barrier.cuh).
#pragma once

#include <cstdint>

#include "mkernel/device/barrier.cuh"
#include "mkernel/device/epoch.cuh"
#include "mkernel/device/signal.cuh"
#include "mkernel/device/trace.cuh"
#include "src/comm/device_program.h"
#include "src/comm/executor.cuh"
#include "src/comm/split_control.cuh"

namespace mk {
namespace comm {

// Work items that a kernel's scheduling thread hands to its consumer threads: a tile id
// (>= 0), op i of the program (kItemOp0 - i), or the end of the work.
constexpr int kItemDone = -1;
constexpr int kItemOp0 = -2;
__host__ __device__ constexpr int op_item(int op) { return kItemOp0 - op; }
__host__ __device__ constexpr bool is_op_item(int item) { return item <= kItemOp0; }
__host__ __device__ constexpr int op_of_item(int item) { return kItemOp0 - item; }

// ---- plain launches ----

struct NoComm {
  static constexpr bool kEnabled = false;
  struct Params {};
  struct SharedStorage {};
  struct RoleState {};
  struct TileHooks {};

  __device__ __forceinline__ static uint64_t call_epoch(const Params&) { return 0; }
  __device__ __forceinline__ static void finish(const Params&) {}
  __device__ __forceinline__ static void init_shared(SharedStorage&) {}

  __device__ __forceinline__ static bool dedicated_cta(const Params&) { return false; }
  __device__ __forceinline__ static int dedicated_ctas(const Params&) { return 0; }
  template <bool kTrace_, int kThreads_, uint32_t kBarrier_, size_t kSmemBytes_>
  __device__ __forceinline__ static void run_dedicated(const Params&, char*, int, uint64_t, const TraceBuffer&) {}

  // By the scheduling thread, before each work item: true with `item` = an op item when this
  // CTA takes an op next; false when it takes a tile (sched.tiles_left() peeks at the tiles).
  // At least one CTA always computes, whatever the count says: progress is guaranteed.
  template <class Sched_>
  __device__ __forceinline__ static bool take_op(const Params&, RoleState&, const Sched_&, uint64_t, int&) {
    return false;
  }
  __device__ __forceinline__ static void finish_handed_ops(const RoleState&, const SharedStorage&) {}
  __device__ __forceinline__ static void tile_handed(RoleState&) {}
  __device__ __forceinline__ static void finish_handed_tiles(const RoleState&, const SharedStorage&) {}
  __device__ __forceinline__ static void tile_done(SharedStorage&) {}
  __device__ __forceinline__ static int help_op(const Params&, RoleState&) { return kItemDone; }
  template <int kThreads_, uint32_t kBarrier_>
  __device__ __forceinline__ static void run_op(const Params&, int, int, uint64_t) {}
  __device__ __forceinline__ static void op_done(const Params&, SharedStorage&) {}
  __device__ __forceinline__ static Role trace_role(const Params&, int) { return Role::kComm; }

  __device__ __forceinline__ static void load_waits(const Params&, int, uint64_t) {}
  __device__ __forceinline__ static TileHooks tile_hooks(const Params&, int) { return {}; }
  template <int kThreads_, uint32_t kBarrier_>
  __device__ __forceinline__ static void store_waits(const Params&, const TileHooks&, int, uint64_t) {}
  template <int kThreads_, uint32_t kBarrier_>
  __device__ __forceinline__ static void store_signals(const Params&, const TileHooks&, int, uint64_t) {}
  __device__ __forceinline__ static void wait_arrival(const WaitCtx&, const uint64_t*, uint64_t, int, int) {}
};

// ---- a fused operator's communication program ----

struct CommRole {
  static constexpr bool kEnabled = true;
  struct Params {
    DeviceProgram program{};           // the program and its tile-row hooks (device_program.h)
    const int* role_counts = nullptr;  // take_op(): [0] = CTAs in the role (device memory)
    // take_op(): the CTAs may compute a tile while the next op is not ready. Only when no tile
    // waits for an op (RS/AR): else (AG) every such CTA could block on rows that op would send.
    int peek_ops = 0;
    int dedicated_ctas = 0;            // dedicated_cta(): CTAs that run ops only
    SplitCtl* split = nullptr;         // non-null: the controller moves role_counts[0] (take_op)
    TraceBuffer trace{};               // events non-null: the controller records its switches
  };
  // Ops this CTA's consumers finished (take_op's CTAs hand ops to their consumers).
  struct SharedStorage {
    int ops_done;
    int tiles_done;  // tiles this CTA's consumers finished (finish_handed_tiles)
  };
  // The scheduling thread's own account (take_op, help_op).
  struct RoleState {
    bool ops_left_empty = false;  // the program's op counter ran past its last op
    int ops_issued = 0;           // ops handed to this CTA's consumers
    int tiles_issued = 0;         // tiles handed to them
  };
  using TileHooks = DevRowHooks;

  // The call's epoch: read by every thread before any CTA can finish.
  __device__ __forceinline__ static uint64_t call_epoch(const Params& p) {
    return p.program.epoch ? device::epoch_of_call(p.program.epoch) : 0;
  }
  // By every CTA at its end: the last one advances the epoch for the next call.
  __device__ __forceinline__ static void finish(const Params& p) {
    if (p.program.epoch) device::epoch_finish(p.program.epoch, gridDim.x);
  }
  // By thread 0 before the CTA's first barrier.
  __device__ __forceinline__ static void init_shared(SharedStorage& s) {
    s.ops_done = 0;
    s.tiles_done = 0;
  }

  // ---- dedicated communication CTAs ----

  __device__ __forceinline__ static bool dedicated_cta(const Params& p) {
    return int(blockIdx.x) < p.dedicated_ctas;
  }
  __device__ __forceinline__ static int dedicated_ctas(const Params& p) { return p.dedicated_ctas; }

  // A dedicated CTA's work: kThreads_ threads (tid 0 .. kThreads_ - 1, meeting on named barrier
  // kBarrier_) take ops in program order until none is left. The kernel's shared memory
  // (kSmemBytes_ bytes at smem) serves as bulk-copy stages: 16 KiB each, then their mbarriers.
  // The caller sets the register budget first (setmaxnreg): the ops are called out of line,
  // and warps with different budgets could not share them.
  template <bool kTrace_, int kThreads_, uint32_t kBarrier_, size_t kSmemBytes_>
  __device__ __forceinline__ static void run_dedicated(const Params& p, char* smem, int tid, uint64_t epoch,
                                                       const TraceBuffer& trace) {
    constexpr uint32_t kStageBytes = 16384;
    constexpr size_t kFit = (kSmemBytes_ - 1024) / kStageBytes;
    constexpr int kCopyStages = int(kFit < 8 ? kFit : 8);
    static_assert(kCopyStages >= 2, "bulk-copy stages must fit the kernel's shared memory");
    BulkStages stages{smem, reinterpret_cast<uint64_t*>(smem + kCopyStages * kStageBytes), kCopyStages,
                           kStageBytes, 0};
    if (tid == 0) bulk_stages_init(stages);
    for_each_op_in_order<kThreads_, kBarrier_>(p.program, tid, [&](int op) {
      [[maybe_unused]] uint64_t t0 = 0;
      if constexpr (kTrace_) t0 = device::trace_now_ns();
      run_comm_op_staged<kThreads_, kBarrier_>(p.program, op, tid, epoch, stages);
      if constexpr (kTrace_)
        if (tid == 0 && trace.events) device::trace_record(trace, trace_role(p, op), op, t0);
    });
  }

  // ---- communication CTAs that move between roles, per work item ----

  template <class Sched_>
  __device__ __forceinline__ static bool take_op(const Params& p, RoleState& s, const Sched_& sched, uint64_t epoch,
                                                 int& item) {
    if (p.split) split_control(p.split, p.program, p.role_counts, p.trace, sched, epoch);
    const int comm = p.role_counts
                         ? min(*reinterpret_cast<const volatile int*>(p.role_counts), static_cast<int>(gridDim.x) - 1)
                         : 0;
    if (static_cast<int>(blockIdx.x) >= comm || p.program.n_ops <= 0 || s.ops_left_empty) return false;
    if (!p.peek_ops) {
      // Ops strictly in program order (tiles may wait on ops: AG).
      const int op = atomicAdd(p.program.op_counter, 1);
      if (op < p.program.n_ops) {
        item = op_item(op);
        ++s.ops_issued;
        return true;
      }
      s.ops_left_empty = true;
      return false;
    }
    // The next op is taken when its waits are already met, or when no tile is left; otherwise
    // this CTA computes a tile meanwhile (communication CTAs never idle in a wait while tiles
    // remain). Once no op is left it computes for good.
    const int idx = *reinterpret_cast<volatile int*>(p.program.op_counter);
    if (idx >= p.program.n_ops) {
      s.ops_left_empty = true;
      return false;
    }
    if (!sched.tiles_left() || op_ready(p.program, idx, epoch)) {
      if (atomicCAS(p.program.op_counter, idx, idx + 1) == idx) {
        item = op_item(idx);
        ++s.ops_issued;
        return true;
      }
    }
    return false;
  }
  // Before a CTA that handed ops to its consumers takes a tile: they finish those ops first. A
  // tile queued behind an op that waits for that very tile's result (a reduction waiting on the
  // tile counts) would never run. The ops' own waits are bounded, so this one ends too.
  __device__ __forceinline__ static void finish_handed_ops(const RoleState& s, const SharedStorage& sh) {
    while (s.ops_issued && *reinterpret_cast<const volatile int*>(&sh.ops_done) < s.ops_issued) __nanosleep(64);
  }
  // The scheduling thread counts the tiles it hands to its consumers; they count the ones they
  // finished (tile_done, one consumer thread after each tile).
  __device__ __forceinline__ static void tile_handed(RoleState& s) { ++s.tiles_issued; }
  __device__ __forceinline__ static void tile_done(SharedStorage& sh) { atomicAdd_block(&sh.tiles_done, 1); }
  // Before help_op: the consumers finished their tiles. An op queued behind a tile that waits
  // (an owner's own tile waits for the peers' shares) would not run until that wait ends, and
  // the wait may need the op: the entry op, which tells the peers they may send. A CTA takes
  // ops only once idle; the tiles' own waits are bounded, so this wait ends too.
  __device__ __forceinline__ static void finish_handed_tiles(const RoleState& s, const SharedStorage& sh) {
    while (*reinterpret_cast<const volatile int*>(&sh.tiles_done) < s.tiles_issued) __nanosleep(64);
  }
  // No tile left: the CTA helps with the program's remaining ops (the final reductions and
  // copies), so they run on every SM, not only on the communication CTAs. kItemDone when none.
  __device__ __forceinline__ static int help_op(const Params& p, RoleState& s) {
    if (p.program.n_ops > 0 && !s.ops_left_empty) {
      const int op = atomicAdd(p.program.op_counter, 1);
      if (op < p.program.n_ops) {
        ++s.ops_issued;
        return op_item(op);
      }
      s.ops_left_empty = true;
    }
    return kItemDone;
  }
  // Op `op`, by the kThreads_ consumer threads (tid 0 .. kThreads_ - 1) on named barrier kBarrier_.
  template <int kThreads_, uint32_t kBarrier_>
  __device__ __forceinline__ static void run_op(const Params& p, int op, int tid, uint64_t epoch) {
    run_comm_op<kThreads_, kBarrier_>(p.program, op, tid, epoch);
  }
  // By one consumer thread after run_op (read by finish_handed_ops; the controller's op count).
  __device__ __forceinline__ static void op_done(const Params& p, SharedStorage& sh) {
    atomicAdd_block(&sh.ops_done, 1);
    if (p.split) atomicAdd(&p.split->ops_done, 1);
  }
  __device__ __forceinline__ static Role trace_role(const Params& p, int op) {
    return p.program.ops[op].kind == kDevNetPut ? Role::kNetSend : Role::kComm;
  }

  // ---- per-tile hooks ----

  // Before the TMA loads of tile row `row` (the scheduling thread, in the producer warp): its
  // inputs have arrived (AG's A rows); then the peers' stores, acquired by the waits, are
  // ordered before the async proxy's reads.
  __device__ __forceinline__ static void load_waits(const Params& p, int row, uint64_t epoch) {
    if (!p.program.rows) return;
    const DevRowHooks h = p.program.rows[row];
    if (h.load_waits) {
      const bool stall = p.split && !waits_met(p.program, h.load_wait0, h.load_waits, epoch);
      if (stall) {
        atomicAdd(&p.split->stalls, 1);
        atomicAdd(&p.split->stalled, 1);
      }
      hook_waits<true>(p.program, h.load_wait0, h.load_waits, epoch);
      if (stall) atomicSub(&p.split->stalled, 1);
      asm volatile("fence.proxy.async.global;" ::: "memory");
    }
  }
  // The store hooks of tile row `row` (read once per tile by the consumers).
  __device__ __forceinline__ static TileHooks tile_hooks(const Params& p, int row) {
    TileHooks h{};
    if (p.program.rows) h = p.program.rows[row];
    return h;
  }
  // Before a tile is stored: its destinations' owners have started this call (their buffers
  // are free). One thread waits; the kThreads_ storing threads meet on kBarrier_.
  template <int kThreads_, uint32_t kBarrier_>
  __device__ __forceinline__ static void store_waits(const Params& p, const TileHooks& h, int tid, uint64_t epoch) {
    if (h.store_waits) {
      if (tid == 0) hook_waits(p.program, h.store_wait0, h.store_waits, epoch);
      device::named_barrier_sync(kThreads_, kBarrier_);
    }
  }
  // After a tile's stores were issued by plain (generic-proxy) writes of the kThreads_ threads:
  // each makes its writes visible at system scope, they meet, then one raises the signals
  // (e.g. a reducer's row counter). Not for TMA stores (their completion is the issuing thread's
  // bulk wait).
  template <int kThreads_, uint32_t kBarrier_>
  __device__ __forceinline__ static void store_signals(const Params& p, const TileHooks& h, int tid, uint64_t epoch) {
    if (h.store_sigs) {
      __threadfence_system();
      device::named_barrier_sync(kThreads_, kBarrier_);
      if (tid == 0) hook_signals(p.program, h.store_sig0, h.store_sigs, epoch);
    }
  }
  // Before loading data that an op of this or a peer's program delivers (one producer thread):
  // waits, bounded, until *flag >= target. `ctx` is the program's wait context (program.wait; a
  // kernel may pass its own copy of it). The caller fences the async proxy before its TMA reads
  // once its waits are done.
  __device__ __forceinline__ static void wait_arrival(const WaitCtx& ctx, const uint64_t* flag, uint64_t target,
                                                      int peer, int index) {
    device::wait_ge<true>(ctx, flag, target, peer, index);
  }
};

}  // namespace comm
}  // namespace mk
