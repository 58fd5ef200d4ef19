// One rank of a fault-injection job through the public API (tests/gpu/fault_check.py starts W of
// them and plants the fault with MK_FAULT). The ranks bootstrap through a file store
// (make_store_bootstrap: no launcher tears the job down for them), create a communicator and
// one operator — the fused GEMM+RS, ring attention, MoE dispatch+combine, or the standalone
// all-reduce — and run calls
// until one fails. Then they do what an application does: ask for the job's failure
// (Communicator::failure, which names the culprit), destroy the operator and the communicator,
// and exit. Each writes one JSON line to <dir>/result_<rank>.json:
//   {"rank": r, "op": "...", "outcome": "ok"|"failed"|"setup", "calls": n, "report": "...",
//    "t_failed": s, "t_report": s, "t_destroyed": s, "destroy": "..."}
// (times: CLOCK_MONOTONIC seconds, comparable across the processes of one host). Exit status:
// 0 every call succeeded, 1 the job failed and this rank tore down, 3 setup failed.
//
//   MK_FAULT_DIR=dir MK_FAULT_RANK=r MK_FAULT_WORLD=W fault_rank fused|ring|moe|coll [calls]
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/mkernel.h"
#include "mkernel/ops/collective.h"
#include "mkernel/ops/fused.h"
#include "mkernel/ops/moe.h"
#include "mkernel/ops/ring_attention.h"
#include "tests/common/test_util.h"

namespace {

using mk::Status;

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    if (static_cast<unsigned char>(c) < 0x20) continue;
    o += c;
  }
  return o;
}

// Device memory filled with small random bf16 values (their meaning does not matter here).
void* random_bf16(size_t elems, uint32_t seed) {
  std::vector<uint16_t> h(elems);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& v : h) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    v = static_cast<uint16_t>(0x3c00 + (x & 0xff));  // about 0.0078 .. 0.0155
  }
  void* d = nullptr;
  if (cudaMalloc(&d, elems * 2) != cudaSuccess) return nullptr;
  cudaMemcpy(d, h.data(), elems * 2, cudaMemcpyHostToDevice);
  cudaDeviceSynchronize();  // a pageable copy may return before its DMA lands
  return d;
}

// One operator's calls, as a closure over its state.
struct Job {
  std::unique_ptr<mk::ops::FusedGemm> fused;
  std::unique_ptr<mk::ops::RingAttention> ring;
  std::unique_ptr<mk::ops::MoeEp> moe;
  std::unique_ptr<mk::ops::Collective> coll;
  void* coll_x = nullptr;  // the all-reduce's data, in place
  std::vector<void*> mem;
  mk::ops::FusedArgs fa;
  mk::ops::RingAttentionArgs ra;
  mk::ops::MoeDispatchArgs da;
  mk::ops::MoeDispatchOut dout;
  void* moe_out = nullptr;

  void* keep(void* p) {
    mem.push_back(p);
    return p;
  }
  Status create(mk::Communicator* comm, const std::string& op) {
    const int W = comm->world(), me = comm->rank();
    if (op == "fused") {
      const int64_t M = int64_t(W) * 512, N = 1024, K = 512;
      MK_CHECK(mk::ops::FusedGemm::create(comm, mk::ops::FusedKind::kGemmRs, {M, N, K}, {}, &fused));
      fa.A = keep(random_bf16(size_t(M * K), 1 + me));
      fa.B = keep(random_bf16(size_t(N * K), 101 + me));
      fa.C = keep(random_bf16(size_t(M / W * N), 7));
      return OkOr(fa.A && fa.B && fa.C);
    }
    if (op == "ring") {
      mk::ops::RingAttentionShape s;
      s.B = 1, s.H = 4, s.Hkv = 4, s.D = 128, s.S = int64_t(W) * 1024, s.causal = true;
      MK_CHECK(mk::ops::RingAttention::create(comm, s, {}, &ring));
      const size_t n = size_t(s.S / W) * s.H * s.D;
      ra.q = keep(random_bf16(n, 1 + me));
      ra.k = keep(random_bf16(n, 11 + me));
      ra.v = keep(random_bf16(n, 21 + me));
      ra.o = keep(random_bf16(n, 31));
      return OkOr(ra.q && ra.k && ra.v && ra.o);
    }
    if (op == "moe") {
      mk::ops::MoeConfig c;
      c.hidden = 1024, c.num_experts = 4 * W, c.topk = 2, c.max_tokens_per_rank = 512;
      MK_CHECK(mk::ops::MoeEp::create(comm, c, {}, &moe));
      const int64_t T = c.max_tokens_per_rank;
      std::vector<int32_t> ids(size_t(T * c.topk));
      std::vector<float> w(ids.size(), 0.5f);
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 7 + me * 3 + i / c.topk) % c.num_experts);
      for (int64_t t = 0; t < T; ++t)  // two different experts per token
        if (ids[t * 2] == ids[t * 2 + 1]) ids[t * 2 + 1] = (ids[t * 2 + 1] + 1) % c.num_experts;
      void *d_ids = nullptr, *d_w = nullptr, *counts = nullptr, *offsets = nullptr;
      cudaMalloc(&d_ids, ids.size() * 4);
      cudaMalloc(&d_w, w.size() * 4);
      cudaMalloc(&counts, 64 * 4);
      cudaMalloc(&offsets, 65 * 4);
      cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(d_w, w.data(), w.size() * 4, cudaMemcpyHostToDevice);
      cudaDeviceSynchronize();  // a pageable copy may return before its DMA lands
      da.x = keep(random_bf16(size_t(T * c.hidden), 1 + me));
      da.topk_ids = static_cast<int32_t*>(keep(d_ids));
      da.topk_weights = static_cast<float*>(keep(d_w));
      da.tokens = T;
      dout.recv_x = keep(random_bf16(size_t(moe->recv_rows() * c.hidden), 3));
      dout.counts = static_cast<int32_t*>(keep(counts));
      dout.offsets = static_cast<int32_t*>(keep(offsets));
      moe_out = keep(random_bf16(size_t(T * c.hidden), 5));
      return OkOr(da.x && d_ids && d_w && counts && offsets && dout.recv_x && moe_out);
    }
    if (op == "coll") {
      const int64_t n = int64_t(1) << 20;
      MK_CHECK(mk::ops::Collective::create(comm, mk::ops::CollectiveKind::kAllReduce, n, mk::ops::CollDType::kBF16, {},
                                           &coll));
      coll_x = keep(random_bf16(size_t(n), 41 + me));
      return OkOr(coll_x != nullptr);
    }
    return mk::make_status(mk::Code::kInvalidArgument, "unknown operator '%s' (fused, ring, moe, coll)", op.c_str());
  }
  static Status OkOr(bool ok) {
    return ok ? mk::OkStatus() : mk::make_status(mk::Code::kOutOfMemory, "fault_rank: input allocation failed");
  }
  Status call(mk::Communicator* comm) {
    cudaStream_t st = comm->stream();
    if (fused) MK_CHECK(fused->run(fa, st));
    if (ring) MK_CHECK(ring->run(ra, st));
    if (coll) MK_CHECK(coll->run({coll_x, coll_x}, st));
    if (moe) {
      MK_CHECK(moe->dispatch(da, dout, st));
      // The experts' output is their input here (y = recv_x): combine moves it back.
      MK_CHECK(moe->combine({dout.recv_x}, moe_out, st));
    }
    MK_CHECK(comm->sync(st));
    return comm->check();
  }
  Status destroy() {
    Status first;
    auto keep_first = [&](Status s) {
      if (first.ok() && !s.ok()) first = s;
    };
    if (fused) keep_first(fused->destroy());
    if (ring) keep_first(ring->destroy());
    if (moe) keep_first(moe->destroy());
    if (coll) keep_first(coll->destroy());
    for (void* p : mem) cudaFree(p);
    mem.clear();
    return first;
  }
};

}  // namespace

int main(int argc, char** argv) {
  const char* dir = getenv("MK_FAULT_DIR");
  const char* rs = getenv("MK_FAULT_RANK");
  const char* ws = getenv("MK_FAULT_WORLD");
  if (argc < 2 || !dir || !rs || !ws) {
    fprintf(stderr, "usage: MK_FAULT_DIR=dir MK_FAULT_RANK=r MK_FAULT_WORLD=W %s fused|ring|moe|coll [calls]\n", argv[0]);
    return 2;
  }
  const std::string op = argv[1];
  const int calls = argc > 2 ? atoi(argv[2]) : 50;
  const int rank = atoi(rs), W = atoi(ws);
  const std::string out = std::string(dir) + "/result_" + std::to_string(rank) + ".json";
  auto write = [&](const char* outcome, int n, const std::string& report, double t_failed, double t_report,
                   double t_destroyed, const std::string& destroy) {
    FILE* f = fopen((out + ".tmp").c_str(), "w");
    if (!f) return;
    fprintf(f,
            "{\"rank\": %d, \"op\": \"%s\", \"outcome\": \"%s\", \"calls\": %d, \"report\": \"%s\", \"t_failed\": %.3f, "
            "\"t_report\": %.3f, \"t_destroyed\": %.3f, \"destroy\": \"%s\"}\n",
            rank, op.c_str(), outcome, n, json_escape(report).c_str(), t_failed, t_report, t_destroyed,
            json_escape(destroy).c_str());
    fclose(f);
    rename((out + ".tmp").c_str(), out.c_str());
  };
  std::unique_ptr<mk::Bootstrap> bs;
  std::unique_ptr<mk::Communicator> comm;
  Job job;
  Status s = mk::make_store_bootstrap(rank, W, "fault", mk::test::file_store(dir), &bs);
  if (s.ok()) {
    mk::CommConfig cfg;
    cfg.require_gpu = true;
    s = mk::Communicator::create(std::move(bs), cfg, &comm);
  }
  if (s.ok()) s = job.create(comm.get(), op);
  if (s.ok()) s = mk::agree(comm->bootstrap(), mk::OkStatus(), "fault_rank setup");
  if (!s.ok()) {
    // A setup that fails (a window registration refused, say) is still a failure every rank
    // must leave: the same teardown.
    const double t = now_s();
    Status rep = comm ? comm->failure(s) : s;
    const double t_rep = now_s();
    Status d = job.destroy();
    if (comm) {
      Status dc = comm->destroy();
      if (d.ok()) d = dc;
    }
    write("setup", 0, rep.to_string(), t, t_rep, now_s(), d.to_string());
    fprintf(stderr, "fault_rank %d: setup failed: %s\n", rank, rep.to_string().c_str());
    return 3;
  }
  int n = 0;
  for (; n < calls && s.ok(); ++n) s = job.call(comm.get());
  if (s.ok()) {
    Status d = job.destroy();
    Status dc = comm->destroy();
    write("ok", n, "", 0, 0, now_s(), (d.ok() ? dc : d).to_string());
    return 0;
  }
  const double t_failed = now_s();
  // This rank's cause fails the job (its peers may be waiting for it in their calls); the
  // report names the culprit (waiting at most failure_grace_ms for the peers' notices).
  Status rep = comm->failure(s);
  const double t_report = now_s();
  fprintf(stderr, "fault_rank %d: call %d failed: %s\n", rank, n, rep.to_string().c_str());
  Status d = job.destroy();
  Status dc = comm->destroy();
  comm.reset();
  write("failed", n, rep.to_string(), t_failed, t_report, now_s(), (d.ok() ? dc : d).to_string());
  return 1;
}
