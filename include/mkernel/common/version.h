// mkernel — the library's version.
#pragma once

namespace mk {
const char* version();  // "major.minor.patch"
}  // namespace mk
