// CPU tests of build_topology and friends on hand-made RankInfo vectors (made-up hosts,
// processes and GPUs): no GPU and no second machine needed.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "mkernel/runtime/topology.h"
#include "tests/common/test_util.h"

namespace mk {
namespace {

struct Host {
  uint64_t hash;
  std::string name;
};

// Two random, distinct hosts per test so nothing relies on particular hash values.
std::vector<Host> make_hosts(std::mt19937_64& rng, int n) {
  std::vector<Host> hosts;
  for (int i = 0; i < n; ++i) {
    uint64_t h;
    bool dup;
    do {
      h = rng() | 1;
      dup = false;
      for (const auto& x : hosts) dup |= (x.hash == h);
    } while (dup);
    hosts.push_back({h, "node" + std::to_string(i) + "-" + std::to_string(rng() % 100000)});
  }
  return hosts;
}

// One rank's info: a fresh template from local_host_info(rank), fields overwritten.
RankInfo make_info(int rank, const Host& host, uint64_t pid, int device, uint64_t gpu_seed) {
  RankInfo info = local_host_info(rank);
  info.host_hash = host.hash;
  memset(info.hostname, 0, sizeof(info.hostname));
  snprintf(info.hostname, sizeof(info.hostname), "%s", host.name.c_str());
  info.pid = pid;
  info.cuda_device = device;
  info.sm_count = 132;
  memset(info.pci_bus_id, 0, sizeof(info.pci_bus_id));
  memset(info.gpu_uuid, 0, sizeof(info.gpu_uuid));
  if (device >= 0) {
    snprintf(info.pci_bus_id, sizeof(info.pci_bus_id), "0000:%02x:00.0", 0x10 + device);
    std::mt19937_64 g(gpu_seed);
    for (auto& b : info.gpu_uuid) b = static_cast<uint8_t>(g() | 1);  // never all-zero
  }
  return info;
}

// A GPU uuid seed unique to (host, device).
uint64_t gpu_seed(const Host& h, int device) { return h.hash * 1315423911ull + device + 1; }

bool allow_all(const RankInfo&, const RankInfo&) { return true; }
bool deny_all(const RankInfo&, const RankInfo&) { return false; }

// Structural checks every topology must satisfy, whatever the layout.
void check_consistent(const Topology& t, const std::vector<RankInfo>& infos, int rank) {
  const int W = static_cast<int>(infos.size());
  ASSERT_EQ(t.rank, rank);
  ASSERT_EQ(t.world, W);
  ASSERT_EQ(static_cast<int>(t.node_of.size()), W);
  ASSERT_EQ(static_cast<int>(t.local_rank_of.size()), W);
  ASSERT_EQ(static_cast<int>(t.path.size()), W);
  ASSERT_EQ(static_cast<int>(t.info.size()), W);
  ASSERT_EQ(static_cast<int>(t.node_ranks.size()), t.num_nodes);
  int total = 0;
  for (int n = 0; n < t.num_nodes; ++n) {
    const auto& nr = t.node_ranks[n];
    ASSERT_FALSE(nr.empty()) << "node " << n;
    for (size_t i = 0; i < nr.size(); ++i) {
      if (i) {
        EXPECT_LT(nr[i - 1], nr[i]) << "node_ranks[" << n << "] not ascending";
      }
      ASSERT_GE(nr[i], 0);
      ASSERT_LT(nr[i], W);
      EXPECT_EQ(t.node_of[nr[i]], n);
      EXPECT_EQ(t.local_rank_of[nr[i]], static_cast<int>(i));
    }
    total += static_cast<int>(nr.size());
  }
  EXPECT_EQ(total, W);
  EXPECT_EQ(t.node, t.node_of[rank]);
  EXPECT_EQ(t.local_rank, t.local_rank_of[rank]);
  EXPECT_EQ(t.local_size, static_cast<int>(t.node_ranks[t.node].size()));
  for (int r = 0; r < W; ++r) {
    EXPECT_EQ(memcmp(&t.info[r], &infos[r], sizeof(RankInfo)), 0) << "info of rank " << r;
    EXPECT_EQ(t.same_node(r), t.node_of[r] == t.node);
    if (r == rank) {
      EXPECT_EQ(t.path[r], PeerPath::kSelf);
    } else if (t.node_of[r] != t.node) {
      EXPECT_EQ(t.path[r], PeerPath::kNetwork) << "rank " << rank << " -> " << r;
    } else {
      EXPECT_NE(t.path[r], PeerPath::kNetwork) << "rank " << rank << " -> " << r;
    }
  }
  std::vector<int> mapped;
  for (int r = 0; r < W; ++r)
    if (t.path[r] != PeerPath::kNetwork) mapped.push_back(r);
  EXPECT_EQ(t.mapped_ranks(), mapped);
  EXPECT_EQ(t.mapped_ranks(), t.node_ranks[t.node]);
}

class TopologyTest : public ::testing::Test {
 protected:
  std::mt19937_64 rng{test::test_seed() ^ 0x70B0};
};

TEST_F(TopologyTest, SingleRank) {
  auto hosts = make_hosts(rng, 1);
  std::vector<RankInfo> infos = {make_info(0, hosts[0], 4242, 0, gpu_seed(hosts[0], 0))};
  Topology t;
  MK_ASSERT_OK(build_topology(0, infos, 0, deny_all, &t));
  check_consistent(t, infos, 0);
  EXPECT_EQ(t.num_nodes, 1);
  EXPECT_EQ(t.local_size, 1);
  EXPECT_EQ(t.local_rank, 0);
  EXPECT_FALSE(t.emulated_nodes);
  EXPECT_EQ(t.path[0], PeerPath::kSelf);
  EXPECT_EQ(t.mapped_ranks(), std::vector<int>{0});
  EXPECT_EQ(host_local_index(infos, 0), 0);
  // ranks_per_node=1 with one rank: one emulated node.
  MK_ASSERT_OK(build_topology(0, infos, 1, nullptr, &t));
  EXPECT_TRUE(t.emulated_nodes);
  EXPECT_EQ(t.num_nodes, 1);
}

TEST_F(TopologyTest, TwoHostsFourRanks) {
  auto hosts = make_hosts(rng, 2);
  std::vector<RankInfo> infos;
  for (int r = 0; r < 4; ++r) {
    const Host& h = hosts[r / 2];
    infos.push_back(make_info(r, h, 1000 + r, r % 2, gpu_seed(h, r % 2)));
  }
  for (int rank = 0; rank < 4; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    Topology t;
    MK_ASSERT_OK(build_topology(rank, infos, 0, allow_all, &t));
    check_consistent(t, infos, rank);
    EXPECT_FALSE(t.emulated_nodes);
    EXPECT_EQ(t.num_nodes, 2);
    EXPECT_EQ(t.node, rank / 2);
    EXPECT_EQ(t.local_rank, rank % 2);
    EXPECT_EQ(t.local_size, 2);
    EXPECT_EQ(t.node_of, (std::vector<int>{0, 0, 1, 1}));
    EXPECT_EQ(t.local_rank_of, (std::vector<int>{0, 1, 0, 1}));
    EXPECT_EQ(t.node_ranks, (std::vector<std::vector<int>>{{0, 1}, {2, 3}}));
    for (int r = 0; r < 4; ++r) {
      PeerPath want = r == rank ? PeerPath::kSelf
                      : r / 2 == rank / 2 ? PeerPath::kIpc
                                          : PeerPath::kNetwork;
      EXPECT_EQ(t.path[r], want) << rank << " -> " << r << ": " << peer_path_name(t.path[r]);
    }
    EXPECT_EQ(host_local_index(infos, rank), rank % 2);
  }
}

TEST_F(TopologyTest, InterleavedHosts) {
  auto hosts = make_hosts(rng, 2);
  std::vector<RankInfo> infos;
  for (int r = 0; r < 4; ++r) {
    const Host& h = hosts[r % 2];  // 0,2 on A; 1,3 on B
    infos.push_back(make_info(r, h, 2000 + r, r / 2, gpu_seed(h, r / 2)));
  }
  for (int rank = 0; rank < 4; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    Topology t;
    MK_ASSERT_OK(build_topology(rank, infos, 0, allow_all, &t));
    check_consistent(t, infos, rank);
    EXPECT_EQ(t.num_nodes, 2);
    EXPECT_EQ(t.node_of, (std::vector<int>{0, 1, 0, 1}));
    EXPECT_EQ(t.node_ranks, (std::vector<std::vector<int>>{{0, 2}, {1, 3}}));
    EXPECT_EQ(t.local_rank_of, (std::vector<int>{0, 0, 1, 1}));
    EXPECT_EQ(t.local_rank, rank / 2);
    for (int r = 0; r < 4; ++r) {
      PeerPath want = r == rank ? PeerPath::kSelf
                      : r % 2 == rank % 2 ? PeerPath::kIpc
                                          : PeerPath::kNetwork;
      EXPECT_EQ(t.path[r], want) << rank << " -> " << r;
    }
    EXPECT_EQ(host_local_index(infos, rank), rank / 2);
  }
}

TEST_F(TopologyTest, EmulatedNodesOnOneHost) {
  auto hosts = make_hosts(rng, 1);
  std::vector<RankInfo> infos;
  for (int r = 0; r < 4; ++r)
    infos.push_back(make_info(r, hosts[0], 3000 + r, r, gpu_seed(hosts[0], r)));
  for (int rank = 0; rank < 4; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    Topology t;
    MK_ASSERT_OK(build_topology(rank, infos, 2, allow_all, &t));
    check_consistent(t, infos, rank);
    EXPECT_TRUE(t.emulated_nodes);
    EXPECT_EQ(t.num_nodes, 2);
    EXPECT_EQ(t.local_size, 2);
    EXPECT_EQ(t.node, rank / 2);
    EXPECT_EQ(t.local_rank, rank % 2);
    for (int r = 0; r < 4; ++r) {
      // Same host, but another emulated node: network only.
      PeerPath want = r == rank ? PeerPath::kSelf
                      : r / 2 == rank / 2 ? PeerPath::kIpc
                                          : PeerPath::kNetwork;
      EXPECT_EQ(t.path[r], want) << rank << " -> " << r;
    }
    // The host-local index ignores the emulation: all four share the host.
    EXPECT_EQ(host_local_index(infos, rank), rank);
    std::string d = t.describe();
    EXPECT_NE(d.find("emulated"), std::string::npos) << d;
  }
  // Without the override the same infos make one node of four.
  Topology t;
  MK_ASSERT_OK(build_topology(3, infos, 0, allow_all, &t));
  EXPECT_FALSE(t.emulated_nodes);
  EXPECT_EQ(t.num_nodes, 1);
  EXPECT_EQ(t.local_size, 4);
  EXPECT_EQ(t.mapped_ranks(), (std::vector<int>{0, 1, 2, 3}));
}

TEST_F(TopologyTest, RanksPerNodeMustDivideWorld) {
  auto hosts = make_hosts(rng, 1);
  std::vector<RankInfo> infos;
  for (int r = 0; r < 4; ++r) infos.push_back(make_info(r, hosts[0], 100 + r, -1, 0));
  Topology t;
  t.num_nodes = 77;  // must be left untouched on error
  Status s = build_topology(0, infos, 3, allow_all, &t);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("3"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("4"), std::string::npos) << s.message();
  EXPECT_EQ(t.num_nodes, 77);
  EXPECT_EQ(build_topology(0, infos, -1, allow_all, &t).code(), Code::kInvalidArgument);
  EXPECT_EQ(build_topology(0, infos, 8, allow_all, &t).code(), Code::kInvalidArgument);
  // Out-of-range rank and empty world.
  EXPECT_EQ(build_topology(4, infos, 0, allow_all, &t).code(), Code::kInvalidArgument);
  EXPECT_EQ(build_topology(-1, infos, 0, allow_all, &t).code(), Code::kInvalidArgument);
  EXPECT_EQ(build_topology(0, {}, 0, allow_all, &t).code(), Code::kInvalidArgument);
}

TEST_F(TopologyTest, EmulatedNodeSpanningHostsIsNamed) {
  auto hosts = make_hosts(rng, 2);
  // ranks 0,1,2 on A, rank 3 on B: with ranks_per_node=2 node 1 = {2 (A), 3 (B)}.
  std::vector<RankInfo> infos;
  for (int r = 0; r < 4; ++r) infos.push_back(make_info(r, hosts[r < 3 ? 0 : 1], 500 + r, -1, 0));
  Topology t;
  Status s = build_topology(0, infos, 2, allow_all, &t);
  ASSERT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("ranks 2 "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(" 3 "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(hosts[0].name), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(hosts[1].name), std::string::npos) << s.message();
  // ranks_per_node=1 is fine with the same infos, and so is the host-based layout.
  MK_EXPECT_OK(build_topology(0, infos, 1, allow_all, &t));
  EXPECT_EQ(t.num_nodes, 4);
  MK_EXPECT_OK(build_topology(0, infos, 0, allow_all, &t));
  EXPECT_EQ(t.num_nodes, 2);
}

TEST_F(TopologyTest, SameProcessRanks) {
  auto hosts = make_hosts(rng, 1);
  std::vector<RankInfo> infos;
  // Ranks 0,1 share a process (two GPUs in one process); rank 2 is another process.
  infos.push_back(make_info(0, hosts[0], 777, 0, gpu_seed(hosts[0], 0)));
  infos.push_back(make_info(1, hosts[0], 777, 1, gpu_seed(hosts[0], 1)));
  infos.push_back(make_info(2, hosts[0], 778, 2, gpu_seed(hosts[0], 2)));
  Topology t;
  MK_ASSERT_OK(build_topology(0, infos, 0, allow_all, &t));
  check_consistent(t, infos, 0);
  EXPECT_EQ(t.path[0], PeerPath::kSelf);
  EXPECT_EQ(t.path[1], PeerPath::kSameProcess);
  EXPECT_EQ(t.path[2], PeerPath::kIpc);
  MK_ASSERT_OK(build_topology(2, infos, 0, allow_all, &t));
  EXPECT_EQ(t.path[0], PeerPath::kIpc);
  EXPECT_EQ(t.path[1], PeerPath::kIpc);

  // The same pid on another host is another process.
  auto other = make_hosts(rng, 2);
  std::vector<RankInfo> two = {make_info(0, other[0], 555, -1, 0),
                               make_info(1, other[1], 555, -1, 0)};
  MK_ASSERT_OK(build_topology(0, two, 0, allow_all, &t));
  EXPECT_EQ(t.path[1], PeerPath::kNetwork);
}

TEST_F(TopologyTest, UnreachablePeerGpuIsNotSupported) {
  auto hosts = make_hosts(rng, 1);
  std::vector<RankInfo> infos;
  for (int r = 0; r < 2; ++r)
    infos.push_back(make_info(r, hosts[0], 900 + r, r, gpu_seed(hosts[0], r)));
  Topology t;
  Status s = build_topology(0, infos, 0, deny_all, &t);
  ASSERT_EQ(s.code(), Code::kNotSupported) << s.to_string();
  EXPECT_NE(s.message().find("rank 0"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(infos[1].pci_bus_id), std::string::npos) << s.message();
  // No PeerAccessFn at all is the same as one that says no.
  EXPECT_EQ(build_topology(1, infos, 0, nullptr, &t).code(), Code::kNotSupported);

  // The PeerAccessFn sees this rank as self and the peer as peer.
  int calls = 0;
  PeerAccessFn check = [&](const RankInfo& self, const RankInfo& peer) {
    ++calls;
    EXPECT_EQ(self.rank, 1);
    EXPECT_EQ(peer.rank, 0);
    return true;
  };
  MK_ASSERT_OK(build_topology(1, infos, 0, check, &t));
  EXPECT_GE(calls, 1);
  EXPECT_EQ(t.path[0], PeerPath::kIpc);

  // A peer on another node is never asked about and never an error.
  auto two_hosts = make_hosts(rng, 2);
  std::vector<RankInfo> apart = {make_info(0, two_hosts[0], 1, 0, gpu_seed(two_hosts[0], 0)),
                                 make_info(1, two_hosts[1], 2, 0, gpu_seed(two_hosts[1], 0))};
  MK_EXPECT_OK(build_topology(0, apart, 0, deny_all, &t));
  EXPECT_EQ(t.path[1], PeerPath::kNetwork);

  // A rank without a GPU does not need peer access.
  std::vector<RankInfo> nogpu = {make_info(0, hosts[0], 11, -1, 0), make_info(1, hosts[0], 12, -1, 0)};
  MK_EXPECT_OK(build_topology(0, nogpu, 0, deny_all, &t));
  EXPECT_EQ(t.path[1], PeerPath::kIpc);
}

TEST_F(TopologyTest, SharedGpuIsReachableWithoutPeerAccess) {
  auto hosts = make_hosts(rng, 1);
  // Ranks 0 and 1 (different processes) share one GPU: same uuid.
  std::vector<RankInfo> infos = {make_info(0, hosts[0], 41, 0, gpu_seed(hosts[0], 0)),
                                 make_info(1, hosts[0], 42, 0, gpu_seed(hosts[0], 0))};
  for (int rank = 0; rank < 2; ++rank) {
    Topology t;
    MK_ASSERT_OK(build_topology(rank, infos, 0, deny_all, &t));
    EXPECT_EQ(t.path[1 - rank], PeerPath::kIpc);
    EXPECT_EQ(t.gpu_sharers, 1);  // wait_backoff_ns -1 backs off on both
    EXPECT_NE(t.describe().find("shared with 1 other rank"), std::string::npos) << t.describe();
  }
  // Same uuid but device ordinals differ (each process sees the GPU under its own ordinal).
  infos[1].cuda_device = 3;
  Topology t;
  MK_EXPECT_OK(build_topology(0, infos, 0, deny_all, &t));
  EXPECT_EQ(t.gpu_sharers, 1);
  // A third rank on another GPU of the host, and a fourth on another host with the same uuid
  // bytes (another machine's GPU): neither shares rank 0's GPU.
  auto more = make_hosts(rng, 2);
  infos.push_back(make_info(2, hosts[0], 43, 1, gpu_seed(hosts[0], 1)));
  infos.push_back(make_info(3, more[1], 44, 0, gpu_seed(hosts[0], 0)));
  if (infos[3].host_hash == hosts[0].hash) infos[3].host_hash ^= 1;
  MK_EXPECT_OK(build_topology(0, infos, 0, allow_all, &t));
  EXPECT_EQ(t.gpu_sharers, 1);
  MK_EXPECT_OK(build_topology(2, infos, 0, allow_all, &t));
  EXPECT_EQ(t.gpu_sharers, 0);
  EXPECT_EQ(t.describe().find("shared with"), std::string::npos) << t.describe();
  infos.resize(2);
  // Without uuids the PCI bus id decides.
  memset(infos[0].gpu_uuid, 0, 16);
  memset(infos[1].gpu_uuid, 0, 16);
  snprintf(infos[1].pci_bus_id, sizeof(infos[1].pci_bus_id), "%s", infos[0].pci_bus_id);
  MK_EXPECT_OK(build_topology(0, infos, 0, deny_all, &t));
  EXPECT_EQ(t.gpu_sharers, 1);
  snprintf(infos[1].pci_bus_id, sizeof(infos[1].pci_bus_id), "0000:ab:00.0");
  EXPECT_EQ(build_topology(0, infos, 0, deny_all, &t).code(), Code::kNotSupported);
}

TEST_F(TopologyTest, VersionMismatchAndBadSlot) {
  auto hosts = make_hosts(rng, 1);
  std::vector<RankInfo> infos;
  for (int r = 0; r < 3; ++r) infos.push_back(make_info(r, hosts[0], 60 + r, -1, 0));
  infos[2].version = kRankInfoVersion + 1 + static_cast<uint32_t>(rng() % 100);
  Topology t;
  Status s = build_topology(0, infos, 0, allow_all, &t);
  ASSERT_EQ(s.code(), Code::kMismatch) << s.to_string();
  EXPECT_NE(s.message().find("rank 2"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(std::to_string(infos[2].version)), std::string::npos) << s.message();

  infos[2].version = kRankInfoVersion;
  infos[1].rank = 2;  // slot 1 holds rank 2's info
  EXPECT_FALSE(build_topology(0, infos, 0, allow_all, &t).ok());
}

// A peer's strings are not trusted: a host name or PCI bus id without its terminator (what
// no mkernel rank sends) is refused, naming the rank, instead of being read past its end.
TEST_F(TopologyTest, UnterminatedStringsFromAPeerAreRefused) {
  auto hosts = make_hosts(rng, 1);
  for (int field = 0; field < 2; ++field) {
    std::vector<RankInfo> infos;
    for (int r = 0; r < 3; ++r) infos.push_back(make_info(r, hosts[0], 70 + r, -1, 0));
    const int bad = 1 + static_cast<int>(rng() % 2);
    if (field == 0)
      memset(infos[bad].hostname, 'h', sizeof(infos[bad].hostname));
    else
      memset(infos[bad].pci_bus_id, 'p', sizeof(infos[bad].pci_bus_id));
    Topology t;
    Status s = build_topology(0, infos, 0, allow_all, &t);
    EXPECT_EQ(s.code(), Code::kMismatch) << s.to_string();
    EXPECT_NE(s.message().find("rank " + std::to_string(bad) + "'s"), std::string::npos) << s.message();
  }
}

TEST_F(TopologyTest, HostLocalIndex) {
  auto hosts = make_hosts(rng, 3);
  // Random assignment of 12 ranks to 3 hosts; the index counts lower ranks on the same host.
  std::vector<RankInfo> infos;
  std::vector<int> host_of;
  for (int r = 0; r < 12; ++r) {
    int h = static_cast<int>(rng() % 3);
    host_of.push_back(h);
    infos.push_back(make_info(r, hosts[h], 300 + r, -1, 0));
  }
  for (int r = 0; r < 12; ++r) {
    int want = 0;
    for (int q = 0; q < r; ++q) want += host_of[q] == host_of[r];
    EXPECT_EQ(host_local_index(infos, r), want) << "rank " << r;
  }
}

TEST_F(TopologyTest, DescribeMentionsNodeAndPaths) {
  auto hosts = make_hosts(rng, 2);
  std::vector<RankInfo> infos;
  for (int r = 0; r < 4; ++r)
    infos.push_back(make_info(r, hosts[r / 2], 70 + r, r % 2, gpu_seed(hosts[r / 2], r % 2)));
  Topology t;
  MK_ASSERT_OK(build_topology(3, infos, 0, allow_all, &t));
  std::string d = t.describe();
  EXPECT_FALSE(d.empty());
  EXPECT_NE(d.find("rank 3/4"), std::string::npos) << d;
  EXPECT_NE(d.find("node 1/2"), std::string::npos) << d;
  EXPECT_NE(d.find("local rank 1/2"), std::string::npos) << d;
  EXPECT_NE(d.find(hosts[1].name), std::string::npos) << d;
  EXPECT_NE(d.find(infos[3].pci_bus_id), std::string::npos) << d;
  EXPECT_NE(d.find("0:net"), std::string::npos) << d;
  EXPECT_NE(d.find("2:ipc"), std::string::npos) << d;
  EXPECT_NE(d.find("3:self"), std::string::npos) << d;
  EXPECT_EQ(t.mapped_ranks(), (std::vector<int>{2, 3}));
  EXPECT_STREQ(peer_path_name(PeerPath::kSameProcess), "process");
}

TEST_F(TopologyTest, LocalHostInfoIsSane) {
  RankInfo a = local_host_info(5);
  RankInfo b = local_host_info(6);
  EXPECT_EQ(a.version, kRankInfoVersion);
  EXPECT_EQ(a.rank, 5);
  EXPECT_EQ(a.cuda_device, -1);
  EXPECT_EQ(a.pid, static_cast<uint64_t>(getpid()));
  EXPECT_NE(a.hostname[0], '\0');
  EXPECT_NE(a.host_hash, 0u);
  EXPECT_EQ(a.host_hash, b.host_hash);
  EXPECT_STREQ(a.hostname, b.hostname);
  // Two local infos are the same host and the same process.
  std::vector<RankInfo> infos = {local_host_info(0), local_host_info(1)};
  Topology t;
  MK_ASSERT_OK(build_topology(0, infos, 0, nullptr, &t));
  EXPECT_EQ(t.num_nodes, 1);
  EXPECT_EQ(t.path[1], PeerPath::kSameProcess);
}

// Every world size and node layout: structure and paths.
TEST_F(TopologyTest, LayoutSweep) {
  for (int W : {1, 2, 3, 4, 6, 8, 16}) {
    for (int N : {1, 2, 4}) {
      if (W % N != 0) continue;
      const int per = W / N;
      auto hosts = make_hosts(rng, N);
      for (int layout = 0; layout < 3; ++layout) {
        // 0: consecutive ranks per host; 1: round-robin over hosts; 2: emulated on one host.
        std::vector<RankInfo> infos;
        std::vector<int> want_node(W);
        for (int r = 0; r < W; ++r) {
          int h = layout == 0 ? r / per : layout == 1 ? r % N : 0;
          want_node[r] = layout == 1 ? r % N : r / per;
          // One GPU per rank: its index among the ranks of its host so far.
          int dev = 0;
          for (const auto& x : infos) dev += x.host_hash == hosts[h].hash;
          infos.push_back(make_info(r, hosts[h], 10000 + r, dev, gpu_seed(hosts[h], dev)));
        }
        const int rpn = layout == 2 ? per : 0;
        for (int rank = 0; rank < W; ++rank) {
          SCOPED_TRACE("W=" + std::to_string(W) + " N=" + std::to_string(N) +
                       " layout=" + std::to_string(layout) + " rank=" + std::to_string(rank));
          Topology t;
          MK_ASSERT_OK(build_topology(rank, infos, rpn, allow_all, &t));
          check_consistent(t, infos, rank);
          if (HasFatalFailure()) return;
          EXPECT_EQ(t.num_nodes, N);
          EXPECT_EQ(t.local_size, per);
          EXPECT_EQ(t.emulated_nodes, layout == 2);
          for (int r = 0; r < W; ++r) {
            EXPECT_EQ(t.node_of[r], want_node[r]) << "rank " << r;
            PeerPath want = r == rank ? PeerPath::kSelf
                            : want_node[r] == want_node[rank] ? PeerPath::kIpc
                                                              : PeerPath::kNetwork;
            EXPECT_EQ(t.path[r], want) << rank << " -> " << r;
          }
          int local = 0;
          for (int r = 0; r < rank; ++r) local += want_node[r] == want_node[rank];
          EXPECT_EQ(t.local_rank, local);
        }
      }
    }
  }
}

}  // namespace
}  // namespace mk
