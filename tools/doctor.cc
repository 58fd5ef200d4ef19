// `mkernel doctor`: what this machine offers mkernel, and every tunable with its source.
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#ifdef MK_HAVE_LIBFABRIC
#include <rdma/fabric.h>
#endif

#include "mkernel/mkernel.h"
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
    if (drv == 0)
      printf("no GPU: no NVIDIA driver on this machine (%s)\n",
             e != cudaSuccess ? cudaGetErrorName(e) : "no device visible");
    else
      printf("no GPU: %s (driver supports CUDA %d.%d)\n",
             e != cudaSuccess ? cudaGetErrorString(e) : "no device visible", drv / 1000,
             (drv % 1000) / 10);
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

void report_fabric() {
  section("libfabric");
#ifdef MK_HAVE_LIBFABRIC
  uint32_t v = fi_version();
  printf("libfabric %u.%u\n", FI_MAJOR(v), FI_MINOR(v));
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

void report_tunables() {
  section("tunables (set MK_<NAME> or mk::tunables::set)");
  for (const TunableValue& v : tunables::snapshot())
    printf("%-22s %-26s = %-10s [%s]  %s\n", v.def->name, v.def->env,
           v.value.empty() ? "\"\"" : v.value.c_str(), tunable_source_name(v.source), v.def->help);
}

}  // namespace

int doctor(const std::vector<std::string>&) {
  report_build();
  report_gpus();
  report_mps();
  report_fabric();
  report_tunables();
  return 0;
}

}  // namespace cli
}  // namespace mk
