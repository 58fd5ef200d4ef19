// mkernel — the MoE kernels' launch interface (host code; kernels in moe_kernels.cu). The rules
// they implement are written on the CPU in moe_plan.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mkernel/common/status.h"
#include "mkernel/ops/moe.h"
#include "src/comm/device_program.h"

namespace mk {
namespace ops {

// The first bad input a call met (host-mapped, written once by the device; state set last).
struct MoeErrorRecord {
  uint32_t state;   // 0 none, 1 complete
  int32_t kind;     // kMoeErr*
  int32_t rank;
  int32_t token;    // bad id: the token; overflow: -1
  int32_t slot;     // bad id: the top-k slot
  int32_t expert;   // bad id: the id; overflow: the local expert whose rows begin past capacity
  int64_t count;    // tokens of the call, or rows needed
  int64_t limit;    // max tokens, or capacity
};
constexpr int32_t kMoeErrBadExpert = 1, kMoeErrTooManyTokens = 2, kMoeErrOverflow = 3;

// Everything the kernels of one operator read (device pointers unless said).
struct MoeLaunch {
  // geometry
  int W = 1, me = 0, E = 0, El = 0, k = 0, align = 1;
  int64_t H = 0, T = 0, row_bytes = 0, rec_bytes = 0, hdr_bytes = 0, slot_bytes = 0, chdr_bytes = 16,
          cslot_bytes = 0, recv_rows = 0;
  int chunk_tokens = 64;  // tokens per route chunk
  int nchunks = 0;
  // Small batches (direct mode, max tokens <= the tunable moe_small_tokens): route and pack in one
  // launch, layout and unpack in one (each CTA computes what it needs instead of reading what an
  // earlier launch left); the route scratch (hist, erank, cpos, recpos) goes unused.
  bool small = false;
  // One rank (the tunable moe_local_dispatch): each token's row is copied straight to its experts'
  // rows, no record is packed and the slots go unused — small batches in one launch
  // (local_dispatch), larger ones (tunable value 2) after route and the scan (local_scatter).
  bool direct_rows = false;
  // The fused layer's slots (moe_layer_launch.h): a slot's header travels alone, then its records
  // in dP pieces of dpb bytes from hdr_bytes on; the pieces' counts are of the records' bytes.
  bool layer_body = false;
  // Kernels that follow another kernel of the same call start early (programmatic dependent
  // launch; the tunable pdl): set up while the kernel before finishes, they wait for it first.
  bool pdl = true;
  // errors
  MoeErrorRecord* err = nullptr;  // host-mapped
  uint32_t* err_claim = nullptr;  // device
  // route scratch: [T * k] local ranks; [nchunks + 1][buckets] histograms then bases
  int32_t* erank = nullptr;
  int32_t* cpos = nullptr;     // entries' rows among the chunk's entries for their rank
  int32_t* cpos_g = nullptr;   // [T * k] entries' rows in their rank's combine slot (kept for combine)
  int32_t* recpos = nullptr;   // records' places in the send slots (first entry of a token per rank)
  int32_t* hist = nullptr;     // [nchunks][buckets], then bases in place
  int32_t* totals = nullptr;   // [buckets]
  int32_t* n_tokens = nullptr; // [1] this call's tokens (clamped)
  int32_t* ids = nullptr;      // [T * k] saved for combine
  float* weights = nullptr;    // [T * k] saved for combine
  // destination side
  int32_t* counts = nullptr;   // [El]
  int32_t* offsets = nullptr;  // [El + 1]
  int32_t* base = nullptr;     // [W][El]
  int32_t* nrec = nullptr;     // [W]
  int32_t* ncomb = nullptr;    // [W] entries each source gets back
  int32_t* back = nullptr;     // [recv_rows][2] (source, combine row); source -1: a gap
  int32_t* self_row = nullptr; // [T * k] the own tokens' entries' rows in the layout (combine reads y there)
  // symmetric slots (this rank's)
  char* send = nullptr;        // [W][slot_bytes]
  char* recv = nullptr;
  char* csend = nullptr;       // [W][cslot_bytes]
  char* crecv = nullptr;
  // per destination and piece, the bytes the program's piece moves (moe_piece_count)
  uint64_t* dpiece = nullptr;  // [W][dP]
  uint64_t* cpiece = nullptr;  // [W][cP]
  int dP = 1, cP = 1;
  int64_t dpb = 0, cpb = 0;    // bytes per piece (moe_piece_bytes)
  // throughput mode across nodes (moe_plan.h, build_moe_hier_program); hier false: direct
  bool hier = false;
  int nodes = 1, local = 1, my_node = 0, my_local = 0;
  const int32_t* node_ranks = nullptr;  // [nodes][local] (device)
  const int32_t* node_of = nullptr;     // [W] (device)
  int64_t nmeta_bytes = 0, nrec_bytes = 0, nhdr_bytes = 0, nslot_bytes = 0;
  char* nsend = nullptr;                // [nodes][nslot_bytes]
  char* nrecv = nullptr;
  uint64_t* npiece = nullptr;           // [nodes][nP]
  int nP = 1;
  int64_t npb = 0;
  int32_t* nrecpos = nullptr;           // [T * k] node records' local ranks (first entry of a token per node)
  char* const* peer_recv = nullptr;     // [local] every rank of the node's receive slots (peer pointers)
  uint32_t rw0 = 0, rwn = 0, lw0 = 0, lwn = 0, rs0 = 0, rsn = 0;  // the pools (dispatch_program.waits / .signals)
  int* repack_done = nullptr;           // CTAs of the repack that finished (the last raises the flags)
  int* scan_done = nullptr;             // CTAs of the route scan that finished (the last writes the headers)
  // the two programs (dispatch, combine); n_ops == 0: nothing to run (W == 1)
  comm::DeviceProgram dispatch_program{}, combine_program{};
  int comm_ctas = 1;
};

// The per-dispatch state a handle owns (MoeHandle): what route leaves for pack, what dispatch
// leaves for its combine. Copied into a MoeLaunch per call (set_route_state).
struct MoeRouteState {
  int32_t *erank = nullptr, *cpos = nullptr, *cpos_g = nullptr, *recpos = nullptr, *nrecpos = nullptr;
  int32_t* ids = nullptr;
  float* weights = nullptr;
  int32_t *hist = nullptr, *totals = nullptr, *n_tokens = nullptr, *counts = nullptr, *offsets = nullptr;
  int32_t *base = nullptr, *nrec = nullptr, *ncomb = nullptr, *back = nullptr, *self_row = nullptr;
};
inline void set_route_state(MoeLaunch& l, const MoeRouteState& r) {
  l.erank = r.erank, l.cpos = r.cpos, l.cpos_g = r.cpos_g, l.recpos = r.recpos, l.nrecpos = r.nrecpos;
  l.ids = r.ids, l.weights = r.weights, l.hist = r.hist, l.totals = r.totals, l.n_tokens = r.n_tokens;
  l.counts = r.counts, l.offsets = r.offsets, l.base = r.base, l.nrec = r.nrec, l.ncomb = r.ncomb;
  l.back = r.back, l.self_row = r.self_row;
}

// The operator's own launch (moe.cc).
const MoeLaunch& moe_launch_of(const MoeEp& ep);
// Slot pieces for a communication role of `comm_ctas` CTAs at world W (moe.cc's choice).
int moe_default_pieces(int comm_ctas, int W);

// Route buckets: experts, entries per rank, records per rank, then (hier) node records per node.
MK_HOST_DEVICE inline int moe_buckets(const MoeLaunch& l) { return l.E + 2 * l.W + (l.hier ? l.nodes : 0); }

// Once per operator, before its first call: kernel attributes its geometry needs (shared memory
// past 48 KiB for many experts).
Status moe_prepare_launch(const MoeLaunch& l);
// dispatch: route, pack, the program, unpack (small batches: route_pack, the program, layout_unpack;
// direct_rows: local_dispatch alone, or route, the scan and local_scatter). x/ids/weights: the caller's (weights null: unit
// weights); d_n: device count or null (tokens); recv_x/counts/offsets: the caller's outputs.
Status moe_dispatch_launch(const MoeLaunch& l, const void* x, const int32_t* ids, const float* weights,
                           const int32_t* d_n, int64_t tokens, void* recv_x, int32_t* counts, int32_t* offsets,
                           cudaStream_t stream);
// combine: pack y back (not at W = 1: every row is read in place), the program, the weighted sums into out (weights: [T, k] of this call, or
// null: the dispatch's).
Status moe_combine_launch(const MoeLaunch& l, const void* y, const float* weights, void* out, cudaStream_t stream);

}  // namespace ops
}  // namespace mk
