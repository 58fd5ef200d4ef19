// mkernel — topology: which ranks share a node, a process, a GPU, and how each peer is reached.
//
// Nodes come from host identity (hostname + boot id) unless ranks_per_node = k > 0, which
// makes consecutive groups of k ranks one *emulated* node (one host posing as several).
// Ranks on different nodes — emulated or real — never share pointers: their path is kNetwork.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "mkernel/common/status.h"

namespace mk {

// What each rank publishes about itself (fixed layout: it travels through the bootstrap).
struct RankInfo {
  uint32_t version;        // kRankInfoVersion
  int32_t rank;
  uint64_t host_hash;      // hostname + boot id
  uint64_t pid;
  int32_t cuda_device;     // ordinal in its own process; -1: no GPU
  int32_t sm_count;
  char hostname[64];
  char pci_bus_id[32];     // "0000:19:00.0"; empty without GPU
  uint8_t gpu_uuid[16];
};
constexpr uint32_t kRankInfoVersion = 1;
static_assert(sizeof(RankInfo) == 144, "RankInfo travels between ranks; keep its layout fixed");

enum class PeerPath : int {
  kSelf = 0,
  kSameProcess = 1,  // same node and process: plain pointers (peer access if another GPU)
  kIpc = 2,          // same node, another process: memory mapped through VMM FD / cudaIpc
  kNetwork = 3,      // another node (or unreachable by IPC): only through the network
};
const char* peer_path_name(PeerPath p);

struct Topology {
  int rank = 0;
  int world = 1;
  int node = 0;                          // this rank's node
  int num_nodes = 1;
  int local_rank = 0;                    // index within its node
  int local_size = 1;
  bool emulated_nodes = false;           // ranks_per_node override in force
  std::vector<int> node_of;              // [world]
  std::vector<int> local_rank_of;        // [world]
  std::vector<std::vector<int>> node_ranks;  // [num_nodes] -> global ranks, ascending
  std::vector<PeerPath> path;            // [world] how this rank reaches each rank
  std::vector<RankInfo> info;            // [world]
  int gpu_sharers = 0;                   // other ranks on this rank's GPU (MPS, several per process)

  bool same_node(int r) const { return node_of[r] == node; }
  // Ranks this rank maps memory of (itself included): same node, path != kNetwork.
  std::vector<int> mapped_ranks() const;
  std::string describe() const;  // multi-line summary for logs and `mkernel selfcheck`
};

// Whether this rank's GPU can map memory of the GPU described by `peer` (same GPU, or P2P).
using PeerAccessFn = std::function<bool(const RankInfo& self, const RankInfo& peer)>;

// Pure function of the gathered infos: unit-tested on the CPU with made-up hosts.
// Errors: ranks_per_node not dividing world, an emulated node spanning two hosts,
// an intra-node peer this GPU cannot reach (named).
Status build_topology(int rank, const std::vector<RankInfo>& infos, int ranks_per_node,
                      const PeerAccessFn& can_access, Topology* out);

// Index of `rank` among the ranks on its *host* (not emulated node): used to pick a GPU.
int host_local_index(const std::vector<RankInfo>& infos, int rank);

// Fills hostname, host_hash and pid of this process (no GPU fields).
RankInfo local_host_info(int rank);
// Fills the GPU fields for `device` (CUDA runtime). Error if the device cannot be queried.
Status fill_gpu_info(int device, RankInfo* info);
// The default PeerAccessFn: same UUID, or a visible device with cudaDeviceCanAccessPeer.
bool cuda_peer_access(const RankInfo& self, const RankInfo& peer);

}  // namespace mk
