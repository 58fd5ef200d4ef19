// mkernel — per-CTA timelines (host and device). A kernel built with tracing records, for
// each CTA and work item, its role and start/end global-timer stamps; the host exports them
// as Chrome/Perfetto trace JSON (one row per SM). Kernels compile a traced and an untraced
// variant: the untraced one carries no tracing code at all.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mkernel/common/status.h"

namespace mk {

struct TraceEvent {
  uint64_t t0_ns;   // %globaltimer at the start of the work item
  uint64_t t1_ns;   // ... and at its end
  uint32_t sm;      // %smid
  uint32_t cta;     // blockIdx.x
  uint32_t role;    // mk::Role
  int32_t item;     // e.g. the tile id
};
static_assert(sizeof(TraceEvent) == 32, "TraceEvent is written by the device");

// Device-side view: events[capacity], count (events attempted; > capacity means dropped).
struct TraceBuffer {
  TraceEvent* events;
  unsigned int* count;
  uint32_t capacity;
  uint32_t pad;
};

// Owns a device trace buffer.
class TraceRecorder {
 public:
  static Status create(uint32_t capacity, TraceRecorder* out);
  ~TraceRecorder();
  TraceRecorder() = default;
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;
  TraceBuffer* device() { return &buf_; }
  Status reset();                                  // count = 0 (synchronous)
  Status fetch(std::vector<TraceEvent>* out, uint64_t* dropped);  // after the traced work

 private:
  TraceBuffer buf_{};
};

// Chrome/Perfetto trace JSON: one "process" per CTA role, one row ("thread") per SM, times
// in microseconds from the first event.
Status write_chrome_trace(const std::vector<TraceEvent>& events, const std::string& path);

// The events as a tab-separated table with absolute device-clock times, one line per event
// (role, peer, sm, cta, item, t0_ns, t1_ns; the peer is Role::kSpin's, else -1), after `header`
// as a comment line: the input of tools/trace_report.py.
Status write_trace_table(const std::vector<TraceEvent>& events, const std::string& header, const std::string& path);

}  // namespace mk
