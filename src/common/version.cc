#include "mkernel/common/version.h"

namespace mk {
const char* version() { return MK_VERSION; }
}  // namespace mk
