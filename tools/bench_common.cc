// The helpers every operator's `mkernel bench` entry shares (bench_common.h).
#include "tools/bench_common.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "mkernel/runtime/bootstrap.h"

namespace mk {
namespace bench {

Status decoded(Communicator* comm, const Status& s) {
  const Status c = comm->check();
  if (c.ok()) return s;
  if (s.ok()) return c;
  if (s.message().find(c.message()) != std::string::npos) return s;  // s already carries the record
  return Status(c.code(), c.message() + " (then: " + s.to_string() + ")");
}

Status cuda_step(Communicator* comm, cudaError_t e, const char* expr) {
  if (e == cudaSuccess) return OkStatus();
  cudaGetLastError();  // clear a non-sticky error so later calls report their own
  return decoded(comm, Status(e == cudaErrorMemoryAllocation ? Code::kOutOfMemory : Code::kCudaError,
                              std::string(expr) + ": " + cudaGetErrorString(e) + " (" + cudaGetErrorName(e) + ")"));
}

Status synced(Communicator* comm, cudaStream_t st) { return decoded(comm, comm->sync(st)); }

namespace {
Status g_first_failure;  // the first failure the ranks agreed on (first_failure())
}

Status agreed(Communicator* comm, const Status& mine, const std::string& what) {
  if (!mine.ok() && (comm->rank() != 0 || mine.message().size() > 200)) {
    fprintf(stderr, "rank %d: %s: %s\n", comm->rank(), what.c_str(), mine.to_string().c_str());
    fflush(stderr);
  }
  Status s = agree(comm->bootstrap(), mine, what);
  if (!s.ok() && g_first_failure.ok()) g_first_failure = Status(s.code(), what + ": " + s.message());
  return s;
}

const Status& first_failure() { return g_first_failure; }

void note_failure(const Status& s) {
  if (!s.ok() && g_first_failure.ok()) g_first_failure = s;
}

// ---- table and JSON cells ----

std::string cell(double v, int prec) {
  if (!(v > 0) || !std::isfinite(v)) return "-";
  char b[32];
  snprintf(b, sizeof b, "%.*f", prec, v);
  return b;
}
std::string jnum(double v, int prec) {
  if (!(v > 0) || !std::isfinite(v)) return "null";
  char b[32];
  snprintf(b, sizeof b, "%.*f", prec, v);
  return b;
}
double overlap_eff(int W, double compute, double coll, double fused) {
  if (W <= 1 || !(compute > 0) || !(coll > 0) || !(fused > 0)) return NAN;
  return (compute + coll - fused) / std::min(compute, coll);
}
std::string eff_cell(double e) {
  if (!std::isfinite(e)) return "-";
  char b[32];
  snprintf(b, sizeof b, "%.2f", e);
  return b;
}
std::string eff_json(double e) {
  if (!std::isfinite(e)) return "null";
  char b[32];
  snprintf(b, sizeof b, "%.3f", e);
  return b;
}
double ratio(double base, double fused) { return base > 0 && fused > 0 ? base / fused : 0.0; }

// ---- checks, JSON file, verdict ----

std::string check_line(const CheckLine& c, const char* how) {
  if (!c.error.empty() && !c.done) return "check: " + c.label + ": FAILED (" + c.error + ")";
  if (!c.ok) return "check: " + c.label + ": WRONG (" + std::to_string(c.bad) + " mismatches " + how + ")";
  std::string s = "check: " + c.label + ": ok (" + how + ")";
  if (!c.error.empty()) s += "; timing FAILED (" + c.error + ")";
  return s;
}

bool write_json(const std::string& path, int W, int nodes, bool comparable, const std::vector<std::string>& rows) {
  FILE* f = fopen(path.c_str(), "w");
  if (!f) {
    fprintf(stderr, "bench: cannot write %s: %s\n", path.c_str(), strerror(errno));
    return false;
  }
  fprintf(f, "{\"world\": %d, \"nodes\": %d, \"comparable\": %s, \"results\": [\n", W, nodes,
          comparable ? "true" : "false");
  for (size_t i = 0; i < rows.size(); ++i) fprintf(f, "  %s%s\n", rows[i].c_str(), i + 1 < rows.size() ? "," : "");
  fprintf(f, "]}\n");
  return fclose(f) == 0;
}

bool communicator_failed(Communicator* comm) {
  const Status h = agree(comm->bootstrap(), comm->check(), "communicator health");
  if (h.ok()) return false;
  if (comm->rank() == 0)
    fprintf(stderr, "bench: the communicator failed (%s): the remaining runs are skipped\n", h.to_string().c_str());
  return true;
}

int summarize(Communicator* comm, const std::vector<CheckLine>& checks, const char* how, bool other_failure) {
  int ok = 0;
  for (const CheckLine& c : checks) ok += c.done && c.ok && c.error.empty();
  const bool pass = !other_failure && ok == int(checks.size()) && !checks.empty();
  if (comm->rank() == 0) {
    for (const CheckLine& c : checks) printf("%s\n", check_line(c, how).c_str());
    printf("bench: %s: %d of %zu checked run(s) ok\n", pass ? "passed" : "FAILED", ok, checks.size());
    fflush(stdout);
  }
  return pass ? 0 : 1;
}

}  // namespace bench
}  // namespace mk
