// What the symmetric heap borrows from its communicator (private).
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "mkernel/runtime/bootstrap.h"
#include "mkernel/runtime/symmetric_heap.h"
#include "mkernel/runtime/topology.h"
#include "src/runtime/ipc_socket.h"

namespace mk {

struct HeapContext {
  Bootstrap* bs = nullptr;
  const Topology* topo = nullptr;
  IpcServer* ipc = nullptr;  // null when no peer is reached through IPC
  IpcSecret secret{};
  // [world] each rank's IPC socket name, exchanged through the bootstrap; "" for a rank that
  // runs no IPC server. ipc_fetch_fd connects to these names only.
  std::vector<std::string> ipc_names;
  int device = -1;           // -1: no GPU
  SymmetricMode requested = SymmetricMode::kAuto;
  std::vector<int> process_devices;  // devices of the same-process ranks of this node (incl. own)
  std::vector<cudaStream_t> own_streams;  // the communicator's streams: synced (bounded) before a free
};

}  // namespace mk
