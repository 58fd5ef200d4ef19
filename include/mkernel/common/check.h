// mkernel — check macros. Each logs "file:line -> code" at WARN on failure and returns the
// Status to the caller, so a failure leaves a backtrace in the log (as NCCL's NCCLCHECK).
#pragma once

#include <cerrno>

#include "mkernel/common/log.h"
#include "mkernel/common/status.h"

namespace mk {
namespace detail {
void log_check_failure(const char* file, int line, const char* expr, const Status& s);
Status cuda_status(int err, const char* expr, const char* file, int line);
Status errno_status(int err, const char* expr, const char* file, int line);
}  // namespace detail
}  // namespace mk

// Propagates a failing mk::Status.
#define MK_CHECK(expr)                                              \
  do {                                                              \
    ::mk::Status mk_check_s_ = (expr);                              \
    if (!mk_check_s_.ok()) {                                        \
      ::mk::detail::log_check_failure(__FILE__, __LINE__, #expr,    \
                                      mk_check_s_);                 \
      return mk_check_s_;                                           \
    }                                                               \
  } while (0)

// Returns kInvalidArgument (or the given code) with a formatted message if cond is false.
#define MK_REQUIRE(cond, code, ...)                                 \
  do {                                                              \
    if (!(cond)) return ::mk::make_status((code), __VA_ARGS__);     \
  } while (0)

// For OS calls returning < 0 on failure with errno set.
#define MK_SYS_CHECK(expr)                                                         \
  do {                                                                             \
    if ((expr) < 0) {                                                              \
      ::mk::Status mk_s_ = ::mk::detail::errno_status(errno, #expr, __FILE__, __LINE__); \
      ::mk::detail::log_check_failure(__FILE__, __LINE__, #expr, mk_s_);           \
      return mk_s_;                                                                \
    }                                                                              \
  } while (0)
