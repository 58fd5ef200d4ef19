// Bootstrap base: default broadcast/barrier on top of allgather, and the shared helpers.
#include "mkernel/runtime/bootstrap.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "mkernel/common/check.h"
#include "mkernel/common/tunables.h"
#include "src/runtime/bootstrap/bootstrap_util.h"

namespace mk {

int64_t Bootstrap::resolve_timeout(int64_t timeout_ms) const {
  if (timeout_ms >= 0) return timeout_ms;
  return tunables::bootstrap_timeout_ms();
}

Status Bootstrap::broadcast(void* buf, size_t bytes, int root, int64_t timeout_ms) {
  MK_REQUIRE(root >= 0 && root < size(), Code::kInvalidArgument,
             "broadcast root %d outside world of %d", root, size());
  std::vector<uint8_t> all(bytes * size());
  MK_CHECK(allgather(buf, all.data(), bytes, timeout_ms));
  if (rank() != root) memcpy(buf, all.data() + bytes * root, bytes);
  return OkStatus();
}

Status Bootstrap::barrier(int64_t timeout_ms) {
  uint8_t one = 1;
  std::vector<uint8_t> all(size());
  return allgather(&one, all.data(), 1, timeout_ms);
}

Status agree(Bootstrap& bs, const Status& mine, const std::string& what, int64_t timeout_ms) {
  struct Outcome {
    int32_t code;
    char msg[252];
  };
  static_assert(sizeof(Outcome) == 256, "agree() payload");
  Outcome o;
  memset(&o, 0, sizeof(o));
  o.code = static_cast<int32_t>(mine.code());
  snprintf(o.msg, sizeof(o.msg), "%s", mine.message().c_str());
  std::vector<Outcome> all(bs.size());
  MK_CHECK(bs.allgather(&o, all.data(), sizeof(o), timeout_ms));
  std::vector<int> failed;
  for (int r = 0; r < bs.size(); ++r)
    if (all[r].code != 0) failed.push_back(r);
  if (failed.empty()) return OkStatus();
  const Outcome& first = all[failed[0]];
  return make_status(static_cast<Code>(first.code), "%s failed on rank(s) %s: %s", what.c_str(),
                     detail::rank_list(failed).c_str(), first.msg);
}

bool launched_by_mpi() {
  const char* vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"};
  for (const char* v : vars)
    if (getenv(v)) return true;
  return false;
}

namespace detail {

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) s += ",";
    if (i == 16) {
      s += "... (" + std::to_string(ranks.size()) + " in all)";
      break;
    }
    s += std::to_string(ranks[i]);
  }
  return s;
}

Status missing_ranks_status(const char* kind, const char* op, uint64_t seq,
                            const std::vector<int>& missing, int64_t timeout_ms) {
  return make_status(Code::kTimeout,
                     "%s bootstrap %s #%llu: rank(s) %s did not arrive within %lld ms", kind, op,
                     static_cast<unsigned long long>(seq), rank_list(missing).c_str(),
                     static_cast<long long>(timeout_ms));
}

}  // namespace detail
}  // namespace mk
