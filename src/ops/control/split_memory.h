// mkernel — the learned starting split of the SM-partition controller (host code).
//
// Per key — operator, shape, world size, nodes, provider, rank — the split (communication
// CTAs) the controller settled on in the last call; the next call with that key starts there.
// Kept in memory, and, when a file is attached, read from it and written back when a value
// changed (the operators write at destroy).
//
// The file is text, one "key<TAB>count" line per entry under a header line, so a user can
// read it, edit it or ship it with a model. Writers on one host — the ranks of a job — merge:
// each takes an exclusive lock on "<file>.lock", reads the file, overlays its own entries,
// writes a temporary file and renames it over the old one. Readers never see half a file.
//
// The file and its lock are private files (src/common/private_file.h): no symbolic link, a regular
// file of this user that nobody else may write, at most kMaxFileBytes; the lock is taken within
// lock_timeout_ms (another process holding it fails the write with kTimeout, nothing hangs).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "mkernel/common/status.h"

namespace mk {
namespace ops {

// The key of one operator instance: "<op> M=.. N=.. K=.. W=.. nodes=.. provider=.. rank=..".
std::string split_key(const std::string& op, int64_t M, int64_t N, int64_t K, int world, int nodes,
                      const std::string& provider, int rank);

class SplitMemory {
 public:
  SplitMemory() = default;
  // The process-wide memory the operators use, attached to the split_memory_file tunable's
  // file when first used (a bad file is logged and left alone: the operators start from the
  // defaults).
  static SplitMemory& process();

  // Names the file (""  : none) and reads it: entries there join the memory (an entry already
  // in memory keeps its value). A missing file is not an error; a malformed one is (kInvalidArgument
  // naming the line), and leaves the memory as it was.
  Status attach(const std::string& path);
  const std::string& path() const { return path_; }

  // The remembered split of `key`, or false.
  bool lookup(const std::string& key, int* comm) const;
  // Remembers `comm` (>= 1) for `key`. With a file: written now when write_now and the value
  // changed; else at the next flush().
  Status record(const std::string& key, int comm, bool write_now = true);
  // Writes the file when a value changed since it was last written.
  Status flush();
  size_t size() const;
  void clear();

  static constexpr size_t kMaxFileBytes = size_t{4} << 20;  // ~40k entries
  void set_lock_timeout_ms(int64_t ms) { lock_timeout_ms_ = ms; }

  // The file's text for these entries, and its parser (exposed for the tests).
  static std::string format(const std::map<std::string, int>& entries);
  static Status parse(const std::string& text, const std::string& where, std::map<std::string, int>* out);

 private:
  Status write_locked();  // mu_ held

  mutable std::mutex mu_;
  std::map<std::string, int> entries_;
  std::string path_;
  bool dirty_ = false;
  int64_t lock_timeout_ms_ = 10000;
};

}  // namespace ops
}  // namespace mk
