// mkernel — the windows commands name, registered collectively for every proxy of a rank.
//
// A window is either *direct* (registered with the backend: puts go NIC-to-memory) or
// *staged* through pinned host buffers: GPU memory on a provider without FI_HMEM
// (net_staging=auto), or any window with net_staging=always (how CI exercises the protocol
// on the CPU). Staged puts use the same commands and flags; the proxies copy on each side:
//
//   sender:   window --copy--> outbox slot [header | payload]  --put-->  receiver's inbox slot
//   receiver: inbox slot --copy--> window; the put's flag after the copy; credit back to the sender
//
// Every rank owns `inbox_slots` slots in every other rank's inbox (credits bound them: a
// sender waits for the receiver to return one), and `outbox_slots` slots locally: staging is
// bounded, reused and back-pressured. A put longer than a chunk goes as several chunks and
// raises its flag once, after its last chunk was copied in.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mkernel/common/status.h"
#include "mkernel/net/backend.h"

namespace mk {

class Bootstrap;

struct StagingConfig {
  uint32_t chunk_bytes = 1u << 20;   // payload per slot
  uint32_t inbox_slots = 8;          // per sender, in every receiver's inbox
  uint32_t outbox_slots = 16;        // per rank
};

// Header at the start of every staged slot (64 bytes, written by the sending proxy).
struct StagedHeader {
  uint32_t magic;        // kStagedMagic
  uint32_t src_rank;
  uint32_t dst_window;
  uint32_t remote_flag;  // raised once all `chunks` of the command were copied in
  uint64_t dst_offset;
  uint64_t bytes;        // payload bytes in this slot
  uint64_t command;      // the sender's command sequence number (groups chunks)
  uint32_t chunks;       // chunks of the command
  uint32_t pad;
  uint64_t reserved[2];
};
static_assert(sizeof(StagedHeader) == 64, "staged slot header");
constexpr uint32_t kStagedMagic = 0x4d4b5354;  // "MKST"

// imm encoding (32 bits): bit 31 clear: a direct put, bits 0..30 = the flag (0x7fffffff: none).
// bit 31 set: staging traffic, bits 16..29 = the writing rank; bit 30 clear: data in that
// rank's inbox slot (bits 0..15); bit 30 set: a credit return (a zero-byte put): the writer
// freed bits 0..15 more of this rank's slots in its inbox (freed in slot order).
constexpr uint32_t kImmStaged = 0x80000000u;
constexpr uint32_t kImmCredit = 0x40000000u;
constexpr int kMaxStagedRanks = 1 << 14;

class ProxyWindows {
 public:
  struct Window {
    void* base = nullptr;
    uint64_t bytes = 0;
    net::MemKind kind = net::MemKind::kHost;
    bool staged = false;
    net::WindowId backend_id = net::kNoWindow;
    std::vector<uint64_t> sizes;  // every rank's size
  };

  // staging: "auto", "always" or "never" ("" reads the tunable net_staging).
  static Status create(Bootstrap* bs, net::Backend* be, const std::string& staging,
                       const StagingConfig& sc, std::unique_ptr<ProxyWindows>* out);
  ~ProxyWindows();

  // Collective. Ids count from 0 in registration order, the same on every rank.
  Status add(void* base, uint64_t bytes, net::MemKind kind, uint32_t* id);
  // Collective, idempotent: deregisters everything (windows and staging buffers).
  Status destroy();

  const Window* get(uint32_t id) const { return id < wins_.size() ? &wins_[id] : nullptr; }
  uint64_t size(uint32_t id, int rank) const;
  int rank() const { return rank_; }
  int world() const { return world_; }
  net::Backend* backend() const { return be_; }

  // Whether a window of GPU memory is registered directly (GPUDirect RDMA): arrivals then
  // need a flush before their flags rise.
  bool direct_gpu() const { return direct_gpu_; }

  // Staging (valid once a staged window exists).
  bool staging() const { return staging_ready_; }
  const StagingConfig& staging_config() const { return sc_; }
  uint64_t slot_bytes() const { return sizeof(StagedHeader) + sc_.chunk_bytes; }
  uint8_t* inbox_slot(int sender, uint32_t k) const;
  uint64_t inbox_offset(int sender, uint32_t k) const;
  uint8_t* outbox_slot(uint32_t k) const;
  net::WindowId inbox_id() const { return inbox_id_; }
  net::WindowId outbox_id() const { return outbox_id_; }
  net::WindowId credit_id() const { return credit_id_; }  // target of zero-byte credit puts

 private:
  ProxyWindows() = default;
  Status ensure_staging();
  Bootstrap* bs_ = nullptr;
  net::Backend* be_ = nullptr;
  int rank_ = 0, world_ = 1;
  std::string mode_;
  StagingConfig sc_;
  bool gpu_ = false;
  std::vector<Window> wins_;
  bool staging_ready_ = false;
  bool direct_gpu_ = false;
  uint8_t* inbox_ = nullptr;       // world * inbox_slots * slot_bytes (pinned when a GPU exists)
  uint8_t* outbox_ = nullptr;      // outbox_slots * slot_bytes
  uint8_t* credit_ = nullptr;      // 64 bytes: zero-byte credit puts land here
  net::WindowId inbox_id_ = net::kNoWindow, outbox_id_ = net::kNoWindow,
                credit_id_ = net::kNoWindow;
  bool destroyed_ = false;
  friend class Proxy;
};

}  // namespace mk
