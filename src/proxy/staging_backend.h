// Staging as a network backend: a net::Backend wrapped around the transport that also takes
// windows the transport cannot (or, with net_staging=always, should not) register, by copying
// through pinned host buffers it registers with the transport itself.
//
//   register_window  a direct window is registered with the transport; a staged one only
//                    recorded (its ranks agree), and the first one registers the staging
//                    buffers: an inbox (inbox_slots slots per sender), an outbox (outbox_slots
//                    slots) and a 64-byte credit window
//   put              direct: the transport's put. Staged: queued, then per chunk (chunk_bytes)
//                    a free outbox slot and a credit for the peer are taken, a 64-byte
//                    StagedHeader and the payload are copied into the slot, and the slot is put
//                    into the sender's slot of the peer's inbox
//   progress         drives the transport, starts and posts chunks (in order: a chunk is posted
//                    only after its copy finished, and none after a failed one), copies arrived
//                    chunks into their windows, reports a staged put's Arrival after its last
//                    chunk was copied in and its LocalDone after its last chunk left, returns
//                    credits (zero-byte puts, in slot order). Before reporting arrivals of direct
//                    puts while a direct window is GPU memory, it flushes GPUDirect RDMA writes
//                    (cuFlushGPUDirectRDMAWrites), so an Arrival always means "visible to the
//                    window's consumers"
//
// The contract is the backend's (docs/backend-contract.md) with two differences: imm carries
// 31 bits (bit 31 marks staging traffic on the transport), and the transport stays the
// caller's: finalize() releases what this backend registered with it, not the transport.
// After an error (a failed copy, a bad chunk, a transport error) it stays failed: no copy is
// started and nothing is posted any more; progress() still drives the transport and passes
// on the direct puts' completions.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mkernel/net/backend.h"
#include "mkernel/proxy/windows.h"
#include "src/proxy/staging_copier.h"

namespace mk {

// Header at the start of every staged slot (64 bytes, written by the sender).
struct StagedHeader {
  uint32_t magic;        // kStagedMagic
  uint32_t src_rank;
  uint32_t dst_window;
  uint32_t imm;          // the put's imm: its Arrival once all `chunks` were copied in
  uint64_t dst_offset;
  uint64_t bytes;        // payload bytes in this slot
  uint64_t put;          // the sender's staged-put sequence number (groups chunks)
  uint32_t chunks;       // chunks of the put
  uint32_t pad;
  uint64_t reserved[2];
};
static_assert(sizeof(StagedHeader) == 64, "staged slot header");
constexpr uint32_t kStagedMagic = 0x4d4b5354;  // "MKST"

// imm on the transport (32 bits): bit 31 clear: a direct put, bits 0..30 the caller's imm.
// bit 31 set: staging traffic, bits 16..29 = the writing rank; bit 30 clear: data in that
// rank's inbox slot (bits 0..15); bit 30 set: a credit return (a zero-byte put): the writer
// freed bits 0..15 more of this rank's slots in its inbox (freed in slot order).
constexpr uint32_t kImmStaged = 0x80000000u;
constexpr uint32_t kImmCredit = 0x40000000u;
constexpr int kMaxStagedRanks = 1 << 14;

class StagingBackend final : public net::Backend {
 public:
  // Not collective. mode: "auto", "always" or "never" ("" reads the tunable net_staging).
  // `transport` must outlive this backend.
  static Status create(Bootstrap* bs, net::Backend* transport, const std::string& mode,
                       const StagingConfig& sc, std::unique_ptr<StagingBackend>* out);
  ~StagingBackend() override;

  const char* name() const override { return name_.c_str(); }
  // The transport's, except cuda_windows: true unless mode is "never" (GPU memory is staged).
  net::BackendCaps caps() const override;
  Status register_window(void* base, size_t bytes, net::MemKind kind, net::WindowId* id) override;
  Status deregister_window(net::WindowId id) override;
  uint64_t window_size(net::WindowId id, int rank) const override;
  Status put(int peer, net::WindowId src, uint64_t src_off, net::WindowId dst, uint64_t dst_off,
             uint64_t bytes, uint32_t imm, uint64_t cookie, bool* posted) override;
  Status progress(std::vector<net::LocalDone>* done, std::vector<net::Arrival>* arrivals) override;
  Status finalize() override;
  void abandon() override {
    abandoned_.store(true);
    tr_->abandon();
  }
  Status given_up() const {
    return make_status(Code::kInternal, "%s: given up (a thread is stuck inside the transport): nothing was released",
                       name());
  }

  bool staging() const { return staging_ready_; }
  net::WindowId transport_id(net::WindowId id) const;
  int rank() const { return rank_; }
  int world() const { return world_; }

 private:
  struct Window {
    void* base = nullptr;
    uint64_t bytes = 0;
    net::MemKind kind = net::MemKind::kHost;
    bool staged = false;
    bool live = true;
    net::WindowId transport = net::kNoWindow;
    std::vector<uint64_t> sizes;  // every rank's size
  };
  // A staged put, from put() until its last chunk completed locally.
  struct StagedPut {
    uint64_t cookie = 0;
    int peer = 0;
    net::WindowId src = 0, dst = 0;
    uint64_t src_off = 0, dst_off = 0, bytes = 0, seq = 0;
    uint32_t imm = 0, chunks = 1, started = 0, done = 0;
  };
  // One chunk in an outbox slot (indexed by the slot): copied, then posted, then completed.
  struct OutChunk {
    uint32_t put = 0, chunk = 0, inbox_slot = 0;
    int copy = -1;  // copy ticket (-1: done)
  };
  // One chunk landed in the inbox, being copied into its window.
  struct InChunk {
    int sender = 0;
    uint32_t slot = 0;
    StagedHeader h{};
    int copy = -1;
  };

  StagingBackend() = default;
  Status ensure_staging();
  uint64_t slot_bytes() const { return sizeof(StagedHeader) + sc_.chunk_bytes; }
  uint64_t inbox_offset(int sender, uint32_t k) const;
  uint8_t* outbox_slot(uint32_t k) const { return outbox_ + uint64_t(k) * slot_bytes(); }
  void fail(const Status& s);
  Status start_copy(void* dst, const void* src, uint64_t bytes, bool device, int* ticket);
  // The copy behind a ticket: true once done; false while running or failed (then failed).
  bool copy_done(int ticket, const char* what, int peer);
  Status flush_gpu_writes();
  void stage_out();                       // start chunk copies, post copied chunks in order
  void on_local_done(uint64_t cookie, std::vector<net::LocalDone>* done);
  Status on_staged_arrival(uint32_t imm);
  void stage_in(std::vector<net::Arrival>* arrivals);  // finish copies in, return credits

  Bootstrap* bs_ = nullptr;
  net::Backend* tr_ = nullptr;  // the transport
  std::atomic<bool> abandoned_{false};  // abandon(): teardown changes nothing (a thread is stuck in put/progress)
  std::string name_;
  std::string mode_;
  StagingConfig sc_;
  int rank_ = 0, world_ = 1;
  bool gpu_ = false;                 // a GPU exists: staging buffers are pinned
  DefaultStagingCopier own_copier_;
  StagingCopier* copier_ = nullptr;  // sc_.copier or &own_copier_
  std::vector<Window> wins_;
  bool direct_gpu_ = false;          // a direct window is GPU memory: flush before arrivals
  bool staging_ready_ = false;
  bool finalized_ = false;
  Status error_;                     // the first error; sticky
  uint8_t* inbox_ = nullptr;         // world * inbox_slots * slot_bytes
  uint8_t* outbox_ = nullptr;        // outbox_slots * slot_bytes
  uint8_t* credit_ = nullptr;        // 64 bytes: zero-byte credit puts land here
  net::WindowId inbox_id_ = net::kNoWindow, outbox_id_ = net::kNoWindow, credit_id_ = net::kNoWindow;

  // direct puts in flight: the caller's cookies, by transport cookie
  std::vector<uint64_t> direct_cookie_;
  std::vector<uint32_t> free_direct_;
  // staged puts in flight
  std::vector<StagedPut> puts_;
  std::vector<uint32_t> free_puts_;
  std::deque<uint32_t> queued_;      // staged puts with chunks left to start, oldest first
  uint64_t next_seq_ = 0;
  // sender side
  std::vector<OutChunk> out_;        // by outbox slot
  std::vector<uint32_t> free_outbox_;
  std::deque<uint32_t> to_post_;     // outbox slots copied or being copied, in start order
  std::vector<uint64_t> sent_to_, credit_from_;  // per peer: my slots used / freed at peer
  // receiver side
  std::vector<InChunk> in_;
  std::vector<std::vector<uint8_t>> freed_;      // per sender: inbox slots copied out
  std::vector<uint64_t> next_credit_;            // per sender: next slot (in order) to free
  std::vector<uint32_t> credit_owed_;            // per sender: freed slots not yet returned
  std::map<std::pair<int, uint64_t>, uint32_t> chunks_in_;  // (sender, put) -> chunks landed
  // transport scratch, reused
  std::vector<net::LocalDone> tr_done_;
  std::vector<net::Arrival> tr_arrivals_;
};

}  // namespace mk
