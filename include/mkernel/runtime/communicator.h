// mkernel — the communicator: bootstrap + topology + symmetric heap + streams + the
// diagnostic record of device waits. One per rank; created and destroyed collectively.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mkernel/common/status.h"
#include "mkernel/device/diag.h"
#include "mkernel/device/views.h"
#include "mkernel/runtime/bootstrap.h"
#include "mkernel/runtime/symmetric_heap.h"
#include "mkernel/runtime/topology.h"

namespace mk {

// Why this process cannot use a GPU, in the words `mkernel doctor` uses ("no NVIDIA driver on this
// machine", "no device visible", the CUDA error), or "" when at least one GPU is usable.
std::string no_gpu_reason();

struct CommConfig {
  int device = -2;            // -2: tunable `device`; -1: host-local rank % visible GPUs; >= 0
  int ranks_per_node = -1;    // -1: tunable `ranks_per_node`
  std::string symmem_mode;    // "": tunable `symmem_mode` (auto, vmm, ipc)
  bool require_gpu = false;   // fail instead of running CPU-only when no GPU is visible
};

struct HeapContext;
class IpcServer;

// An operator that lives on a communicator (FusedGemm, RingAttention, ...). It attaches at
// creation and detaches when destroyed; a communicator destroyed first destroys the operators
// still attached (newest first, collectively like its own destroy), after which their calls
// return an error instead of touching freed state.
class CommAttachment {
 public:
  virtual ~CommAttachment() = default;
  // Called once, from Communicator::destroy, while the communicator is still whole.
  virtual void on_communicator_destroy() = 0;
};

class Communicator {
 public:
  // Collective over `bs`. Without a GPU (and !cfg.require_gpu) the communicator still has
  // bootstrap and topology; allocation then fails with kNotSupported.
  static Status create(std::unique_ptr<Bootstrap> bs, const CommConfig& cfg,
                       std::unique_ptr<Communicator>* out);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Collective, idempotent: destroys the operators still attached (newest first), frees
  // symmetric memory (newest first), stops the IPC server, destroys streams. The destructor
  // calls it. Safe after a failure (a device wait that gave up, an abort): nothing waits longer
  // than its bound.
  Status destroy();
  bool destroyed() const { return destroyed_; }

  void attach(CommAttachment* a);
  void detach(CommAttachment* a);

  int rank() const { return topo_.rank; }
  int world() const { return topo_.world; }
  int device() const { return device_; }  // -1 without GPU
  bool has_gpu() const { return device_ >= 0; }
  const Topology& topology() const { return topo_; }
  Bootstrap& bootstrap() { return *bs_; }
  SymmetricHeap& heap() { return *heap_; }
  cudaStream_t stream() const { return stream_; }       // compute work
  cudaStream_t comm_stream() const { return comm_stream_; }
  // The library's own stream for zeroing and uploads at creation (synced with bounds).
  cudaStream_t setup_stream() const { return setup_stream_; }

  // A pad of `count` zeroed 64-bit flags in symmetric memory (collective).
  Status alloc_signals(uint32_t count, SymmetricBuffer** out);
  // A zeroed EpochState in device memory, owned by the communicator.
  Status alloc_epoch(EpochState** out);

  // The context kernels pass to bounded waits: rank, op, role, and the timeout
  // (tunable signal_timeout_ms unless timeout_ms >= 0).
  // op_tag: an OpTag or a tag from op_tag_register (device/diag.h).
  WaitCtx wait_ctx(uint32_t op_tag, Role role, int64_t timeout_ms = -1) const;
  WaitCtx wait_ctx(OpTag op, Role role, int64_t timeout_ms = -1) const {
    return wait_ctx(static_cast<uint32_t>(op), role, timeout_ms);
  }
  // Turns the outcome of a launch or synchronization into a Status. When a device wait gave
  // up, the Status names rank, op, role, peer, flag, expected and seen (kTimeout when its bound
  // expired; the abort's code and cause when the communicator was aborted).
  Status check_device(cudaError_t err) const;
  // cudaStreamSynchronize(s) + check_device.
  Status sync(cudaStream_t s) const;
  // Host-only health check, no CUDA call (safe while calls are in flight, cheap enough per
  // call): OK, or what failed this communicator — a device wait that gave up (its decoded
  // record) or abort()'s cause. Once it fails it stays failed: operators refuse new calls;
  // destroy the communicator and create a new one. Use it after synchronizing a stream that
  // ran the library's kernels: a wait that gave up does not fail the launch itself.
  // A failure also fails the job (Bootstrap::fail): collectives stop waiting and every peer
  // hears of it, so every rank's teardown runs through within the bounds.
  Status check() const;
  bool failed() const { return !check().ok(); }
  // The job's failure as this rank reports it (Bootstrap::failure_report: waits once, up to
  // the tunable failure_grace_ms, for the peers' notices, then names the culprit: the rank
  // with a cause of its own, or the ranks that said nothing). OK while the job has not failed.
  // `mine`, when not OK, is this rank's cause (a call it refused: its peers may be waiting for
  // it in theirs) and fails the job first. After it, destroy() waits for nobody. Owning thread.
  //   Status s = op->run(args, stream);
  //   if (s.ok()) s = comm->sync(stream);
  //   if (!s.ok()) { fprintf(stderr, "%s\n", comm->failure(s).to_string().c_str()); /* destroy, exit */ }
  Status failure(const Status& mine = OkStatus());
  // True once a device wait has written the diagnostic record.
  bool wait_timed_out() const;
  // Marks the communicator failed (first cause wins): every bounded device wait of its
  // kernels gives up at its next check and reports; check_device then names `why`. Called by
  // whoever watches the network (the proxy's owner). Thread-safe.
  void abort(const Status& why);
  Status abort_status() const;

 private:
  Communicator();
  Status health() const;  // check() without failing the job
  Status init(std::unique_ptr<Bootstrap> bs, const CommConfig& cfg);
  // init's steps (collective; each agreed, so every rank fails alike).
  Status select_gpu(const CommConfig& cfg, const std::vector<RankInfo>& infos, RankInfo* me);
  Status start_ipc();
  Status make_heap(const CommConfig& cfg, const std::vector<RankInfo>& infos);
  Status make_streams();

  std::unique_ptr<Bootstrap> bs_;
  Topology topo_;
  int device_ = -1;
  std::unique_ptr<IpcServer> ipc_;
  std::unique_ptr<HeapContext> heap_ctx_;
  std::unique_ptr<SymmetricHeap> heap_;
  cudaStream_t stream_ = nullptr, comm_stream_ = nullptr;
  cudaStream_t setup_stream_ = nullptr;  // the library's own zeroing and uploads
  DiagRecord* diag_ = nullptr;      // pinned, mapped
  uint32_t* diag_claim_ = nullptr;  // device
  uint64_t* abort_word_ = nullptr;  // pinned, mapped: non-zero once abort() was called
  mutable std::mutex abort_mu_;
  Status abort_status_;
  std::vector<void*> device_allocs_;
  std::mutex attach_mu_;
  std::vector<CommAttachment*> attached_;
  bool destroyed_ = false;
};

// "rank 1 (op signal-test, role test, block 0 thread 0) waited 200 ms on flag 3 from rank 0:
//  expected >= 5, seen 4". Exposed for tests.
std::string describe_diag(const DiagRecord& d);

}  // namespace mk
