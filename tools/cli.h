// The mkernel command line: subcommands and the argument reader they share.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mk {
namespace cli {
int doctor(const std::vector<std::string>& args);
int selfcheck(const std::vector<std::string>& args);
int bench(const std::vector<std::string>& args);

// One pass over a subcommand's arguments. Options are "--name value" or "--name=value".
// Every error is one line naming the option and the value; the caller prints it and exits with
// 2 before any collective or GPU work (every rank gets the same argv, so every rank fails the
// same way).
class ArgReader {
 public:
  explicit ArgReader(std::vector<std::string> args) : args_(std::move(args)) {}
  bool done() const { return i_ >= args_.size(); }
  // The next token ("--name" of "--name=value").
  std::string next();
  // The string value of the option just read: its "=value", else the next token. A missing
  // value (end of line, an empty value, or a token that starts with "--") is an error.
  bool value(std::string* v);
  // An integer value in [lo, hi]: rejects non-numeric text, trailing garbage ("12x"), signs
  // outside the range (negatives, 0 when lo > 0) and values that overflow.
  bool int_value(int64_t lo, int64_t hi, int64_t* v);
  bool int_value(int lo, int hi, int* v);
  // After next(): an option that takes no value must not have been given "=value".
  bool no_value();
  const std::string& error() const { return err_; }
  // Sets error() to `msg` (for checks the caller makes) and returns false.
  bool fail(const std::string& msg);

 private:
  std::vector<std::string> args_;
  size_t i_ = 0;
  std::string opt_;                 // the option just read
  std::string inline_;              // its "=value", if any
  bool has_inline_ = false;
  std::string err_;
};

// The rank this process will have under mpirun (from the launcher's environment), or -1 when
// not launched by MPI: errors found before the communicator exists are printed by rank 0 only.
int launch_rank();
// The number of ranks of this launch (from the launcher's environment), or -1 when not launched
// by MPI.
int launch_size();
}  // namespace cli
}  // namespace mk
