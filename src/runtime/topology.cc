#include "mkernel/runtime/topology.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include <cuda_runtime_api.h>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "src/common/wire.h"

namespace mk {

const char* peer_path_name(PeerPath p) {
  switch (p) {
    case PeerPath::kSelf: return "self";
    case PeerPath::kSameProcess: return "process";
    case PeerPath::kIpc: return "ipc";
    case PeerPath::kNetwork: return "net";
  }
  return "?";
}

std::vector<int> Topology::mapped_ranks() const {
  std::vector<int> out;
  for (int r = 0; r < world; ++r)
    if (path[r] != PeerPath::kNetwork) out.push_back(r);
  return out;
}

std::string Topology::describe() const {
  std::ostringstream os;
  os << "rank " << rank << "/" << world << ": node " << node << "/" << num_nodes
     << (emulated_nodes ? " (emulated)" : "") << ", local rank " << local_rank << "/"
     << local_size << ", host " << info[rank].hostname << ", GPU " << info[rank].cuda_device;
  if (info[rank].pci_bus_id[0]) os << " (" << info[rank].pci_bus_id << ")";
  if (gpu_sharers) os << " shared with " << gpu_sharers << " other rank(s)";
  os << "; paths:";
  for (int r = 0; r < world; ++r) os << " " << r << ":" << peer_path_name(path[r]);
  return os.str();
}

namespace {
uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}
bool same_gpu(const RankInfo& a, const RankInfo& b) {
  static const uint8_t zero[16] = {0};
  if (a.host_hash != b.host_hash || a.cuda_device < 0 || b.cuda_device < 0) return false;
  if (memcmp(a.gpu_uuid, zero, 16) != 0) return memcmp(a.gpu_uuid, b.gpu_uuid, 16) == 0;
  return strcmp(a.pci_bus_id, b.pci_bus_id) == 0 && a.pci_bus_id[0];
}
}  // namespace

int host_local_index(const std::vector<RankInfo>& infos, int rank) {
  int idx = 0;
  for (int r = 0; r < rank; ++r)
    if (infos[r].host_hash == infos[rank].host_hash) ++idx;
  return idx;
}

Status build_topology(int rank, const std::vector<RankInfo>& infos, int ranks_per_node,
                      const PeerAccessFn& can_access, Topology* out) {
  const int world = static_cast<int>(infos.size());
  MK_REQUIRE(world >= 1 && rank >= 0 && rank < world, Code::kInvalidArgument,
             "topology: rank %d outside world of %d", rank, world);
  for (int r = 0; r < world; ++r) {
    MK_REQUIRE(infos[r].version == kRankInfoVersion, Code::kMismatch,
               "topology: rank %d speaks RankInfo version %u, this rank %u (mixed mkernel builds?)",
               r, infos[r].version, kRankInfoVersion);
    MK_REQUIRE(infos[r].rank == r, Code::kInternal, "topology: slot %d holds rank %d", r,
               infos[r].rank);
    MK_REQUIRE(is_terminated(infos[r].hostname) && is_terminated(infos[r].pci_bus_id), Code::kMismatch,
               "topology: rank %d's host name or PCI bus id is not terminated (not an mkernel rank?)", r);
  }
  MK_REQUIRE(ranks_per_node >= 0, Code::kInvalidArgument, "ranks_per_node must be >= 0, got %d",
             ranks_per_node);
  Topology t;
  t.rank = rank;
  t.world = world;
  t.info = infos;
  t.node_of.assign(world, -1);
  if (ranks_per_node > 0) {
    MK_REQUIRE(world % ranks_per_node == 0, Code::kInvalidArgument,
               "ranks_per_node=%d does not divide the world of %d ranks", ranks_per_node, world);
    t.emulated_nodes = true;
    for (int r = 0; r < world; ++r) {
      t.node_of[r] = r / ranks_per_node;
      int first = t.node_of[r] * ranks_per_node;
      MK_REQUIRE(infos[r].host_hash == infos[first].host_hash, Code::kInvalidArgument,
                 "ranks_per_node=%d puts ranks %d (host %s) and %d (host %s) in one node; an "
                 "emulated node must not span hosts",
                 ranks_per_node, first, infos[first].hostname, r, infos[r].hostname);
    }
    t.num_nodes = world / ranks_per_node;
  } else {
    std::map<uint64_t, int> node_of_host;
    for (int r = 0; r < world; ++r) {
      auto it = node_of_host.find(infos[r].host_hash);
      if (it == node_of_host.end())
        it = node_of_host.emplace(infos[r].host_hash, static_cast<int>(node_of_host.size())).first;
      t.node_of[r] = it->second;
    }
    t.num_nodes = static_cast<int>(node_of_host.size());
  }
  t.node_ranks.assign(t.num_nodes, {});
  t.local_rank_of.assign(world, 0);
  for (int r = 0; r < world; ++r) {
    t.local_rank_of[r] = static_cast<int>(t.node_ranks[t.node_of[r]].size());
    t.node_ranks[t.node_of[r]].push_back(r);
  }
  t.node = t.node_of[rank];
  t.local_rank = t.local_rank_of[rank];
  t.local_size = static_cast<int>(t.node_ranks[t.node].size());

  const RankInfo& me = infos[rank];
  for (int r = 0; r < world; ++r) t.gpu_sharers += r != rank && same_gpu(me, infos[r]);
  t.path.assign(world, PeerPath::kNetwork);
  for (int r = 0; r < world; ++r) {
    if (r == rank) {
      t.path[r] = PeerPath::kSelf;
      continue;
    }
    if (t.node_of[r] != t.node) continue;  // another node: network only, never pointers
    const RankInfo& p = infos[r];
    bool reach = same_gpu(me, p) || (can_access && can_access(me, p));
    MK_REQUIRE(me.cuda_device < 0 || reach, Code::kNotSupported,
               "topology: rank %d (GPU %s) cannot map memory of rank %d (GPU %s) on the same "
               "node: no peer access between the GPUs (is CUDA_VISIBLE_DEVICES hiding the peer GPU?)",
               rank, me.pci_bus_id, r, p.pci_bus_id);
    t.path[r] = (p.pid == me.pid && p.host_hash == me.host_hash) ? PeerPath::kSameProcess
                                                                  : PeerPath::kIpc;
  }
  *out = std::move(t);
  return OkStatus();
}

RankInfo local_host_info(int rank) {
  RankInfo info;
  memset(&info, 0, sizeof(info));
  info.version = kRankInfoVersion;
  info.rank = rank;
  info.cuda_device = -1;
  gethostname(info.hostname, sizeof(info.hostname) - 1);
  std::string boot_id;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  if (f) std::getline(f, boot_id);
  uint64_t h = fnv1a(info.hostname, strlen(info.hostname));
  info.host_hash = fnv1a(boot_id.data(), boot_id.size(), h);
  info.pid = static_cast<uint64_t>(getpid());
  return info;
}

Status fill_gpu_info(int device, RankInfo* info) {
  info->cuda_device = device;
  MK_CUDA_CHECK(cudaDeviceGetAttribute(&info->sm_count, cudaDevAttrMultiProcessorCount, device));
  MK_CUDA_CHECK(cudaDeviceGetPCIBusId(info->pci_bus_id, sizeof(info->pci_bus_id), device));
  cudaDeviceProp prop;
  MK_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  memcpy(info->gpu_uuid, prop.uuid.bytes, 16);
  return OkStatus();
}

bool cuda_peer_access(const RankInfo& self, const RankInfo& peer) {
  if (same_gpu(self, peer)) return true;
  int peer_dev = -1;
  if (cudaDeviceGetByPCIBusId(&peer_dev, peer.pci_bus_id) != cudaSuccess) {
    cudaGetLastError();
    return false;  // not visible in this process: cannot tell, so not reachable
  }
  int ok = 0;
  if (cudaDeviceCanAccessPeer(&ok, self.cuda_device, peer_dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return ok != 0;
}

}  // namespace mk
