// Built only by the ctest layer_probe (target mk_layer_probe, not part of `all`): a unit of
// the common layer that includes a header of a higher layer. It must not compile, as a layer
// target sees only its own and lower layers' headers (CMakeLists.txt, mk_layer).
#include "mkernel/common/status.h"
#include "mkernel/runtime/communicator.h"
