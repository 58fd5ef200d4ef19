// mkernel — the windows commands name, registered collectively for every proxy of a rank.
//
// A window is either *direct* (registered with the transport: puts go NIC-to-memory) or
// *staged* through pinned host buffers: GPU memory on a provider without FI_HMEM
// (net_staging=auto), or any window with net_staging=always (how CI exercises the protocol
// on the CPU). Staged puts use the same commands and flags; they are copied on each side:
//
//   sender:   window --copy--> outbox slot [header | payload]  --put-->  receiver's inbox slot
//   receiver: inbox slot --copy--> window; the put's arrival after the copy; credit back to the sender
//
// Staging is a network backend wrapped around the transport (src/proxy/staging_backend.h):
// the proxy posts every put through it and sees no difference between the two kinds. Every
// rank owns `inbox_slots` slots in every other rank's inbox (credits bound them: a sender waits
// for the receiver to return one), and `outbox_slots` slots locally: staging is bounded, reused
// and back-pressured. A put longer than a chunk goes as several chunks and arrives once, after
// its last chunk was copied in.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "mkernel/common/status.h"
#include "mkernel/net/backend.h"

namespace mk {

class Bootstrap;

// How staging copies between a window and its staging slots. The default uses memcpy for host
// memory and, for GPU memory, an asynchronous CUDA copy on a stream of the window's device with
// an event per copy. Called from the thread that drives the backend (the proxy thread) only.
class StagingCopier {
 public:
  virtual ~StagingCopier() = default;
  // Starts a copy; `device`: GPU memory is involved. *ticket >= 0: asynchronous, poll it;
  // -1: already done.
  virtual Status start(void* dst, const void* src, uint64_t bytes, bool device, int* ticket) = 0;
  // *done = true once the copy finished (the ticket is then free); an error means it failed
  // (staging then fails: the chunk is never sent and its put never arrives).
  virtual Status poll(int ticket, bool* done) = 0;
};

struct StagingConfig {
  uint32_t chunk_bytes = 1u << 20;   // payload per slot
  uint32_t inbox_slots = 8;          // per sender, in every receiver's inbox
  uint32_t outbox_slots = 16;        // per rank
  // Copies through this copier instead of the default (tests inject failures); the caller
  // keeps it alive while the windows live.
  StagingCopier* copier = nullptr;
};

class ProxyWindows {
 public:
  // staging: "auto", "always" or "never" ("" reads the tunable net_staging). `transport` is the
  // caller's and must outlive the windows; destroy() releases what they registered with it, and
  // the caller finalizes it afterwards.
  static Status create(Bootstrap* bs, net::Backend* transport, const std::string& staging,
                       const StagingConfig& sc, std::unique_ptr<ProxyWindows>* out);
  virtual ~ProxyWindows() = default;
  ProxyWindows(const ProxyWindows&) = delete;
  ProxyWindows& operator=(const ProxyWindows&) = delete;

  // Collective. Ids count from 0 in registration order, the same on every rank; commands name
  // windows by these ids. Every rank returns the same status.
  virtual Status add(void* base, uint64_t bytes, net::MemKind kind, uint32_t* id) = 0;
  // Collective, idempotent: deregisters everything (windows and staging buffers).
  virtual Status destroy() = 0;

  // Whether some window is staged (the staging buffers exist).
  virtual bool staging() const = 0;
  // The transport's id of a direct window (benchmarks drive the transport without the proxy);
  // net::kNoWindow for a staged or unknown one.
  virtual net::WindowId transport_id(uint32_t id) const = 0;
  // The backend the proxy posts through: the transport wrapped in staging, window ids as add()
  // returned them. While a proxy runs, only its thread may call it. Staging state (queues,
  // credits, a failure) lives here, not in the proxy: one proxy drives the windows at a time.
  virtual net::Backend* backend() const = 0;
  virtual int rank() const = 0;
  virtual int world() const = 0;

 protected:
  ProxyWindows() = default;
};

}  // namespace mk
