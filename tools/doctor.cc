// `mkernel doctor`: what this machine offers mkernel, and every tunable with its source.
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#ifdef MK_HAVE_LIBFABRIC
#include <rdma/fabric.h>
#endif

#include "mkernel/common/cuda_check.h"
#include "mkernel/mkernel.h"
#include "mkernel/net/backend.h"
#include "src/common/env_defaults.h"
#include "tools/cli.h"

namespace mk {
namespace cli {
namespace {

// NVML through dlopen: doctor works (and says so) where the driver's NVML is absent.
struct Nvml {
  void* lib = nullptr;
  int (*init)() = nullptr;
  int (*by_pci)(const char*, void**) = nullptr;
  int (*link_state)(void*, unsigned, int*) = nullptr;
  bool load() {
    lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return false;
    init = reinterpret_cast<int (*)()>(dlsym(lib, "nvmlInit_v2"));
    by_pci = reinterpret_cast<int (*)(const char*, void**)>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    link_state = reinterpret_cast<int (*)(void*, unsigned, int*)>(dlsym(lib, "nvmlDeviceGetNvLinkState"));
    return init && by_pci && link_state && init() == 0;
  }
  // Active NVLink links of the GPU at `pci`; -1 when unknown.
  int active_links(const char* pci) {
    void* dev = nullptr;
    if (by_pci(pci, &dev) != 0) return -1;
    int n = 0;
    for (unsigned l = 0; l < 18; ++l) {
      int active = 0;
      if (link_state(dev, l, &active) == 0 && active) ++n;
    }
    return n;
  }
};

void section(const char* t) { printf("\n== %s\n", t); }

void report_build() {
  section("build");
  printf("mkernel %s; CUDA runtime (built against) %d.%d\n", version(), CUDART_VERSION / 1000,
         (CUDART_VERSION % 1000) / 10);
  printf("MPI: %s; libfabric: %s; CUTLASS headers: %s\n", have_mpi() ? "yes" : "no",
#ifdef MK_HAVE_LIBFABRIC
         "yes",
#else
         "no",
#endif
         MK_CUTLASS_FOUND ? MK_CUTLASS_PATH : "not found");
}

bool report_gpus() {
  section("GPUs");
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();
    printf("no GPU: %s\n", no_gpu_reason().c_str());  // the words Communicator::create uses
    printf("mkernel runs its CPU parts (bootstrap, topology, tests labelled cpu) here; GPU work "
           "needs an NVIDIA Hopper GPU (sm_90a).\n");
    return false;
  }
  printf("driver supports CUDA %d.%d, runtime %d.%d, %d GPU(s)\n", drv / 1000, (drv % 1000) / 10,
         rt / 1000, (rt % 1000) / 10, n);
  Nvml nvml;
  bool have_nvml = nvml.load();
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess) continue;
    char pci[32] = {0};
    cudaDeviceGetPCIBusId(pci, sizeof(pci), d);
    int mps = 0;
    cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, d);
    int links = have_nvml ? nvml.active_links(pci) : -1;
    printf("GPU %d: %s, sm_%d%d, %d SMs, %.1f GiB, %s, MPS %s, NVLink %s%s\n", d, p.name, p.major,
           p.minor, p.multiProcessorCount, p.totalGlobalMem / double(1 << 30), pci,
           mps ? "on" : "off", links < 0 ? "unknown" : std::to_string(links).c_str(),
           links < 0 ? "" : " active links");
    if (p.major != 9)
      printf("  note: mkernel's kernels are built for sm_90a (Hopper); this GPU cannot run them\n");
  }
  if (n > 1) {
    printf("peer access (row can map column):\n     ");
    for (int j = 0; j < n; ++j) printf(" %3d", j);
    printf("\n");
    for (int i = 0; i < n; ++i) {
      printf("  %2d ", i);
      for (int j = 0; j < n; ++j) {
        int ok = 0;
        if (i != j) cudaDeviceCanAccessPeer(&ok, i, j);
        printf(" %3s", i == j ? "-" : (ok ? "yes" : "no"));
      }
      printf("\n");
    }
  }
  return true;
}

void report_mps() {
  section("MPS");
  const char* pipe = getenv("CUDA_MPS_PIPE_DIRECTORY");
  std::string dir = pipe ? pipe : "/tmp/nvidia-mps";
  struct stat st;
  bool control = stat((dir + "/control").c_str(), &st) == 0;
  printf("control pipe %s/control: %s\n", dir.c_str(), control ? "present (daemon running)" : "absent");
  if (const char* p = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))
    printf("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%s\n", p);
  printf("several ranks on one GPU need MPS (nvidia-cuda-mps-control -d) to run side by side\n");
}

// ---- symmetric memory: the peer mapping (VMM or cudaIpc) a job gets on this machine, and
// why. Checked by doing it: a one-rank communicator in this process, then two ranks as two
// processes (this binary runs itself as `mkernel doctor --symmem-peer DIR`), which exchange
// VMM file descriptors or cudaIpc handles exactly as a job's ranks do.

constexpr const char* kPeerFlag = "--symmem-peer";

// A key-value store in a private directory (mode 0700): the bootstrap of the two-process
// check. A get fails once `peer_gone` says the other process is gone, so nothing waits for a
// dead peer until the bootstrap timeout.
StoreCallbacks dir_store(const std::string& dir, std::function<bool()> peer_gone) {
  auto path = [dir](const std::string& key) {
    std::string p = dir + "/";
    char b[4];
    for (unsigned char c : key) {
      if (isalnum(c) || c == '_' || c == '-') {
        p += static_cast<char>(c);
      } else {
        snprintf(b, sizeof(b), "%%%02x", c);
        p += b;
      }
    }
    return p;
  };
  StoreCallbacks cb;
  cb.set = [dir, path](const std::string& key, const std::vector<uint8_t>& v) -> Status {
    static int n = 0;
    const std::string tmp = dir + "/.tmp." + std::to_string(getpid()) + "." + std::to_string(n++);
    int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return make_status(Code::kSystemError, "doctor store: %s: %s", tmp.c_str(), strerror(errno));
    bool ok = v.empty() || write(fd, v.data(), v.size()) == static_cast<ssize_t>(v.size());
    ok = close(fd) == 0 && ok;
    if (!ok || rename(tmp.c_str(), path(key).c_str()) != 0)  // readers see all or nothing
      return make_status(Code::kSystemError, "doctor store: writing %s: %s", key.c_str(), strerror(errno));
    return OkStatus();
  };
  cb.try_get = [path, peer_gone](const std::string& key, size_t max_bytes, std::vector<uint8_t>* v,
                                 bool* found) -> Status {
    *found = false;
    int fd = open(path(key).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno != ENOENT) return make_status(Code::kSystemError, "doctor store: reading %s: %s", key.c_str(), strerror(errno));
      if (peer_gone()) return make_status(Code::kRemoteError, "doctor: the other process of the check has exited");
      return OkStatus();
    }
    v->clear();
    uint8_t buf[4096];
    ssize_t k;
    while (v->size() <= max_bytes && (k = read(fd, buf, sizeof(buf))) > 0) v->insert(v->end(), buf, buf + k);
    close(fd);
    *found = true;
    return OkStatus();
  };
  cb.erase = [path](const std::string& key) -> Status {
    unlink(path(key).c_str());
    return OkStatus();
  };
  return cb;
}

void remove_dir(const std::string& dir) {
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d))
      if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
        unlink((dir + "/" + e->d_name).c_str());
    closedir(d);
  }
  rmdir(dir.c_str());
}

// What one rank of a check saw.
struct SymmemOutcome {
  Status status;          // the first failure, if any
  int device = -1;
  SymmetricMode requested = SymmetricMode::kAuto;
  SymmetricMode mode = SymmetricMode::kAuto;
  std::string fallback;   // SymmetricHeap::fallback_reason()
  PeerPath peer_path = PeerPath::kSelf;  // how rank 0 reaches rank 1 (two-rank check)
  bool peer_checked = false;             // rank 1's copy was read through its mapping
};

SymmemOutcome failed_outcome(const Status& s) {
  SymmemOutcome o;
  o.status = s;
  return o;
}

// Create a communicator over `bs`, allocate a small symmetric buffer, fill it with a byte
// tagged by rank and, with two ranks, read the other rank's copy through its mapping.
// Collective: every rank takes the same steps.
SymmemOutcome symmem_check(std::unique_ptr<Bootstrap> bs) {
  SymmemOutcome out;
  CommConfig cfg;
  cfg.require_gpu = true;
  cfg.ranks_per_node = 0;  // real hosts: an emulated split (MK_RANKS_PER_NODE) maps nothing
  std::unique_ptr<Communicator> comm;
  out.status = Communicator::create(std::move(bs), cfg, &comm);
  if (!out.status.ok()) return out;
  const int rank = comm->rank(), world = comm->world();
  out.device = comm->device();
  const int other = world > 1 ? 1 - rank : rank;
  out.peer_path = comm->topology().path[other];
  SymmetricBuffer* b = nullptr;
  out.status = comm->heap().alloc(4096, &b);
  out.requested = comm->heap().requested_mode();
  out.mode = comm->heap().mode();
  out.fallback = comm->heap().fallback_reason();
  if (!out.status.ok()) return out;
  // Rank-tagged bytes: a wrong mapping shows as the wrong rank's tag, not just a wrong value.
  Status mine = [&]() -> Status {
    MK_CUDA_CHECK(cudaMemset(b->local(), 0x30 + rank, b->size()));
    MK_CUDA_CHECK(cudaDeviceSynchronize());
    return OkStatus();
  }();
  Status s = agree(comm->bootstrap(), mine, "doctor: filling the buffer");
  if (s.ok() && world > 1 && b->peer(other)) {
    mine = [&]() -> Status {
      std::vector<uint8_t> host(b->size(), 0);
      MK_CUDA_CHECK(cudaMemcpy(host.data(), b->peer(other), host.size(), cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < host.size(); ++i)
        if (host[i] != 0x30 + other)
          return make_status(Code::kInternal,
                             "rank %d read byte %zu of rank %d's copy as 0x%02x, expected 0x%02x",
                             rank, i, other, host[i], 0x30 + other);
      return OkStatus();
    }();
    s = agree(comm->bootstrap(), mine, "doctor: reading the other rank's copy");
    out.peer_checked = s.ok();
  }
  Status f = comm->heap().free(b);
  if (s.ok()) s = f;
  Status d = comm->destroy();
  if (s.ok()) s = d;
  out.status = s;
  return out;
}

// Rank 1 of the two-process check (this binary, started by report_symmem).
int symmem_peer(const std::string& dir) {
  const pid_t parent = getppid();
  std::unique_ptr<Bootstrap> bs;
  Status s = make_store_bootstrap(1, 2, "doctor", dir_store(dir, [parent] { return getppid() != parent; }), &bs);
  SymmemOutcome o = s.ok() ? symmem_check(std::move(bs)) : failed_outcome(s);
  if (!o.status.ok()) fprintf(stderr, "mkernel doctor (second process): %s\n", o.status.to_string().c_str());
  return o.status.ok() ? 0 : 1;
}

void print_mode(const char* who, const SymmemOutcome& o) {
  printf("%s: peer mapping %s (symmem_mode=%s)\n", who, symmetric_mode_name(o.mode),
         symmetric_mode_name(o.requested));
  if (!o.fallback.empty())
    printf("  FALLBACK to cudaIpc: %s\n", o.fallback.c_str());
}

void report_symmem(bool have_gpu) {
  section("symmetric memory (peer mapping)");
  if (!have_gpu) {
    printf("cannot check without a GPU: peer mapping (CUDA VMM, or cudaIpc as fallback) needs one. "
           "On a GPU machine this section shows the mode a job gets and why; a job that falls "
           "back from VMM to cudaIpc logs it at WARN.\n");
    return;
  }
  // 1. one rank in this process
  std::vector<std::unique_ptr<Bootstrap>> one;
  Status s = make_thread_world(1, &one);
  SymmemOutcome o1 = s.ok() ? symmem_check(std::move(one[0])) : failed_outcome(s);
  if (!o1.status.ok()) {
    printf("one rank: FAILED: %s\n", o1.status.to_string().c_str());
    if (!o1.fallback.empty()) printf("  after a FALLBACK to cudaIpc: %s\n", o1.fallback.c_str());
    return;
  }
  print_mode(("one rank on GPU " + std::to_string(o1.device)).c_str(), o1);

  // 2. two ranks as two processes of this host, as mpirun would start them
  char tmpl[] = "/tmp/mkernel-doctor-XXXXXX";
  char exe[4096];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (!mkdtemp(tmpl) || n <= 0) {
    printf("two processes: not checked (%s)\n", n <= 0 ? "cannot find this binary" : strerror(errno));
    return;
  }
  exe[n] = '\0';
  const std::string dir = tmpl;
  fflush(nullptr);
  pid_t child = fork();
  if (child == 0) {
    // Exec at once (no CUDA call after fork); die with the parent.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    execl(exe, exe, "doctor", kPeerFlag, dir.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  if (child < 0) {
    printf("two processes: not checked (fork: %s)\n", strerror(errno));
    remove_dir(dir);
    return;
  }
  auto child_gone = [child] {
    siginfo_t si;
    memset(&si, 0, sizeof(si));
    return waitid(P_PID, child, &si, WEXITED | WNOHANG | WNOWAIT) == 0 && si.si_pid == child;
  };
  std::unique_ptr<Bootstrap> bs;
  s = make_store_bootstrap(0, 2, "doctor", dir_store(dir, child_gone), &bs);
  SymmemOutcome o2 = s.ok() ? symmem_check(std::move(bs)) : failed_outcome(s);
  // Reap the child (bounded: it finishes with the collective steps above, or has failed).
  int wst = 0;
  pid_t w = 0;
  for (int i = 0; i < 300 && (w = waitpid(child, &wst, WNOHANG)) == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  if (w == 0) {
    kill(child, SIGKILL);
    waitpid(child, &wst, 0);
  }
  remove_dir(dir);
  if (!o2.status.ok()) {
    printf("two processes: FAILED: %s\n", o2.status.to_string().c_str());
    if (!o2.fallback.empty()) printf("  after a FALLBACK to cudaIpc: %s\n", o2.fallback.c_str());
    return;
  }
  if (o2.peer_path != PeerPath::kIpc) {
    printf("two processes: they do not map each other here (path %s), nothing to exchange\n",
           peer_path_name(o2.peer_path));
    return;
  }
  print_mode("two processes (a job's ranks on one host)", o2);
  printf("  each read the other's copy through its mapping: %s\n", o2.peer_checked ? "ok" : "not checked");
}

void report_fabric() {
  section("libfabric");
#ifdef MK_HAVE_LIBFABRIC
  uint32_t v = fi_version();
  printf("libfabric %u.%u\n", FI_MAJOR(v), FI_MINOR(v));
  apply_env_defaults();  // as the library's own first fi_getinfo does
  printf("udp;ofi_rxd window: FI_OFI_RXD_MAX_UNACKED=%d\n", rxd_max_unacked());
  fi_info* hints = fi_allocinfo();
  hints->ep_attr->type = FI_EP_RDM;
  fi_info* info = nullptr;
  int rc = fi_getinfo(FI_VERSION(1, 10), nullptr, nullptr, 0, hints, &info);
  if (rc != 0) {
    printf("no RDM provider: %s\n", fi_strerror(-rc));
  } else {
    // One line per provider, with the fabrics (networks) it serves.
    std::vector<std::string> order;
    std::map<std::string, std::set<std::string>> fabrics;
    std::map<std::string, uint64_t> caps;
    for (fi_info* i = info; i; i = i->next) {
      std::string prov = i->fabric_attr->prov_name ? i->fabric_attr->prov_name : "?";
      if (!fabrics.count(prov)) order.push_back(prov);
      fabrics[prov].insert(i->fabric_attr->name ? i->fabric_attr->name : "?");
      caps[prov] |= i->caps;
    }
    for (const auto& prov : order) {
      std::string f;
      for (const auto& x : fabrics[prov]) f += (f.empty() ? "" : ", ") + x;
      printf("provider %-16s RDM%s%s  [%s]\n", prov.c_str(), (caps[prov] & FI_RMA) ? ", RMA" : "",
             (caps[prov] & FI_HMEM) ? ", HMEM (GPU memory)" : "", f.c_str());
    }
    fi_freeinfo(info);
  }
  fi_freeinfo(hints);
#else
  printf("not built with libfabric (scripts/setup.sh installs libfabric-dev)\n");
#endif
}

// How each provider would carry a fused operator's traffic between nodes with net_staging=auto:
// directly from GPU memory (GPUDirect RDMA, when the provider registers GPU memory) or staged
// through pinned host memory, and why. A one-rank backend per provider, on this rank's GPU.
void report_staging(bool have_gpu) {
  section("network staging (net_staging=auto, per provider)");
#ifdef MK_HAVE_LIBFABRIC
  std::vector<std::unique_ptr<Bootstrap>> one;
  Status s = make_thread_world(1, &one);
  RankInfo me = local_host_info(0);
  if (s.ok() && have_gpu) s = fill_gpu_info(0, &me);
  Topology topo;
  if (s.ok()) s = build_topology(0, {me}, 0, nullptr, &topo);
  if (!s.ok()) {
    printf("not checked: %s\n", s.to_string().c_str());
    return;
  }
  for (const std::string& prov : net::libfabric_providers()) {
    net::BackendConfig cfg;
    cfg.kind = "libfabric";
    cfg.provider = prov;
    std::unique_ptr<net::Backend> be;
    Status bs = net::create_backend(*one[0], topo, cfg, &be);
    if (!bs.ok()) {
      printf("%-16s unusable here: %s\n", prov.c_str(), bs.message().c_str());
      continue;
    }
    const net::BackendCaps c = be->caps();
    if (c.cuda_windows)
      printf("%-16s direct: GPU memory registered (GPUDirect RDMA; flushed before each arrival flag)\n",
             prov.c_str());
    else
      printf("%-16s staged through pinned host memory: %s\n", prov.c_str(),
             !have_gpu ? "no GPU here" : c.cuda_windows_note.empty() ? "no FI_HMEM" : c.cuda_windows_note.c_str());
    (void)be->finalize();
  }
#else
  printf("not built with libfabric\n");
#endif
}

// Every tunable with its value and source; a bad value is flagged on its line and counted.
int report_tunables(const std::vector<std::string>& providers) {
  section("tunables (set MK_<NAME> or mk::tunables::set; docs/tunables.md)");
  int bad = 0;
  for (const TunableValue& v : tunables::snapshot()) {
    printf("%-22s %-26s = %-10s [%s]  %s\n", v.def->name, v.def->env,
           v.value.empty() ? "\"\"" : v.value.c_str(), tunable_source_name(v.source), v.def->help);
    Status s = tunables::validate(*v.def, v.value);
    // A provider name this machine's libfabric does not offer (when it lists any).
    if (s.ok() && std::string(v.def->name) == "net_provider" && v.value != "auto" && !providers.empty()) {
      const std::string want = net::normalize_provider(v.value);
      bool offered = false;
      for (const std::string& p : providers) offered = offered || p == want;
      if (!offered) {
        std::string list;
        for (const std::string& p : providers) list += (list.empty() ? "" : ", ") + p;
        s = Status(Code::kInvalidArgument, std::string(v.def->env) + "='" + v.value +
                                               "': no such provider here (offered: " + list + ")");
      }
    }
    if (!s.ok()) {
      printf("%-22s ^ INVALID: %s\n", "", s.message().c_str());
      ++bad;
    }
  }
  return bad;
}

}  // namespace

int doctor(const std::vector<std::string>& args) {
  if (args.size() == 2 && args[0] == kPeerFlag) return symmem_peer(args[1]);
  if (args.size() == 1 && args[0] == "--tunables-md") {
    fputs(tunables::markdown().c_str(), stdout);  // docs/tunables.md
    return 0;
  }
  if (!args.empty()) {
    fprintf(stderr, "mkernel doctor: unexpected argument '%s' (usage: mkernel doctor [--tunables-md])\n",
            args[0].c_str());
    return 2;
  }
  report_build();
  const bool have_gpu = report_gpus();
  report_mps();
  report_symmem(have_gpu);
  report_fabric();
  report_staging(have_gpu);
  const int bad = report_tunables(net::libfabric_providers());
  if (bad) {
    printf("\ndoctor: %d setting(s) not valid (flagged above)\n", bad);
    return 1;
  }
  return 0;
}

}  // namespace cli
}  // namespace mk
