#include "mkernel/device/trace.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>

#include "mkernel/common/cuda_check.h"
#include "mkernel/device/diag.h"

namespace mk {

Status TraceRecorder::create(uint32_t capacity, TraceRecorder* out) {
  MK_REQUIRE(capacity > 0, Code::kInvalidArgument, "trace: capacity must be > 0");
  MK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&out->buf_.events), size_t(capacity) * sizeof(TraceEvent)));
  MK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&out->buf_.count), sizeof(unsigned int)));
  out->buf_.capacity = capacity;
  return out->reset();
}

TraceRecorder::~TraceRecorder() {
  if (buf_.events) cudaFree(buf_.events);
  if (buf_.count) cudaFree(buf_.count);
}

Status TraceRecorder::reset() {
  const unsigned int zero = 0;
  MK_CUDA_CHECK(cudaMemcpy(buf_.count, &zero, sizeof(zero), cudaMemcpyHostToDevice));
  return OkStatus();
}

Status TraceRecorder::fetch(std::vector<TraceEvent>* out, uint64_t* dropped) {
  unsigned int n = 0;
  MK_CUDA_CHECK(cudaMemcpy(&n, buf_.count, sizeof(n), cudaMemcpyDeviceToHost));
  const uint32_t kept = std::min<uint32_t>(n, buf_.capacity);
  out->resize(kept);
  if (kept)
    MK_CUDA_CHECK(cudaMemcpy(out->data(), buf_.events, kept * sizeof(TraceEvent), cudaMemcpyDeviceToHost));
  if (dropped) *dropped = n - kept;
  return OkStatus();
}

Status write_chrome_trace(const std::vector<TraceEvent>& events, const std::string& path) {
  FILE* f = fopen(path.c_str(), "w");
  MK_REQUIRE(f, Code::kSystemError, "trace: cannot write %s", path.c_str());
  uint64_t t_min = ~uint64_t(0);
  for (const TraceEvent& e : events) t_min = std::min(t_min, e.t0_ns);
  fprintf(f, "{\"displayTimeUnit\": \"ns\", \"traceEvents\": [\n");
  bool first = true;
  for (const TraceEvent& e : events) {
    // Role::kSpin carries the awaited peer + 1 in the role's bits 8 and up.
    const uint32_t r = e.role & 0xffu;
    const char* role = role_name(static_cast<Role>(r));
    fprintf(f,
            "%s{\"name\": \"%s %d\", \"cat\": \"%s\", \"ph\": \"X\", \"ts\": %.3f, \"dur\": %.3f, "
            "\"pid\": %u, \"tid\": %u, \"args\": {\"cta\": %u, \"item\": %d, \"peer\": %d}}",
            first ? "" : ",\n", role, e.item, role, (e.t0_ns - t_min) / 1e3,
            (e.t1_ns - e.t0_ns) / 1e3, r, e.sm, e.cta, e.item, int(e.role >> 8) - 1);
    first = false;
  }
  fprintf(f, "\n]}\n");
  const bool ok = fclose(f) == 0;
  MK_REQUIRE(ok, Code::kSystemError, "trace: writing %s failed", path.c_str());
  return OkStatus();
}

Status write_trace_table(const std::vector<TraceEvent>& events, const std::string& header, const std::string& path) {
  FILE* f = fopen(path.c_str(), "w");
  MK_REQUIRE(f, Code::kSystemError, "trace: cannot write %s", path.c_str());
  fprintf(f, "# %s\n# role\tpeer\tsm\tcta\titem\tt0_ns\tt1_ns\n", header.c_str());
  for (const TraceEvent& e : events)
    fprintf(f, "%s\t%d\t%u\t%u\t%d\t%llu\t%llu\n", role_name(static_cast<Role>(e.role & 0xffu)), int(e.role >> 8) - 1,
            e.sm, e.cta, e.item, static_cast<unsigned long long>(e.t0_ns), static_cast<unsigned long long>(e.t1_ns));
  const bool ok = fclose(f) == 0;
  MK_REQUIRE(ok, Code::kSystemError, "trace: writing %s failed", path.c_str());
  return OkStatus();
}

}  // namespace mk
