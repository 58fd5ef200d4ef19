// mkernel — status codes. Library code never exits or aborts: every failure travels up
// as a Status carrying a code and a human-readable context message.
#pragma once

#include <string>
#include <utility>

namespace mk {

enum class Code : int {
  kOk = 0,
  kInvalidArgument = 1,  // bad input from the caller (shape, size, alignment, config)
  kMismatch = 2,         // ranks disagree (sizes, shapes, versions)
  kTimeout = 3,          // a bounded wait expired; the message names who was missing
  kCudaError = 4,        // a CUDA runtime/driver call failed
  kSystemError = 5,      // an OS call failed (errno in the message)
  kOutOfMemory = 6,
  kNotSupported = 7,     // feature absent on this machine/build
  kRemoteError = 8,      // another rank reported a failure
  kPermissionDenied = 9, // a peer failed authentication
  kInternal = 10,        // a broken invariant inside mkernel (the last: src/common/wire.h reads up to it)
};

const char* code_name(Code c);

// A value type: cheap when ok (empty message), carries context otherwise.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), msg_(std::move(message)) {}
  static Status ok_status() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return msg_; }
  // "kTimeout: bootstrap allgather: rank(s) 3 did not arrive within 2000 ms"
  std::string to_string() const;

 private:
  Code code_ = Code::kOk;
  std::string msg_;
};

inline Status OkStatus() { return Status(); }

// printf-style constructors.
Status make_status(Code code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace mk
