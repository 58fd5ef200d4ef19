// mkernel — fused multi-GPU, multi-node kernels. The one header users include.
#pragma once

#include "mkernel/common/check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/status.h"
#include "mkernel/common/tunables.h"
#include "mkernel/common/version.h"
#include "mkernel/device/diag.h"
#include "mkernel/device/launch.h"
#include "mkernel/device/views.h"
#include "mkernel/runtime/bootstrap.h"
#include "mkernel/runtime/communicator.h"
#include "mkernel/runtime/symmetric_heap.h"
#include "mkernel/runtime/topology.h"
