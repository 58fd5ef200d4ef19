// The mkernel command line: subcommands share this header.
#pragma once

#include <string>
#include <vector>

namespace mk {
namespace cli {
int doctor(const std::vector<std::string>& args);
int selfcheck(const std::vector<std::string>& args);
int bench(const std::vector<std::string>& args);
}  // namespace cli
}  // namespace mk
