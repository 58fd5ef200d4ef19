// The document windows of packed documents for ring attention's kernels (fmha_launch.h:
// doc_windows; the window rule: doc_window.h).
#include <cuda_runtime_api.h>

#include <algorithm>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "src/attention/doc_window.h"
#include "src/attention/fmha_launch.h"

namespace mk {
namespace attention {

namespace {

struct Segs {
  DocSegment s[3];
  int n;
};

__global__ void doc_windows_kernel(const int32_t* cu, int n_docs, int32_t S, Segs segs, int64_t n_out,
                                   DocWindow* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n_out; i += int64_t(gridDim.x) * blockDim.x) {
    DocWindow w{S, S};
    for (int k = 0; k < segs.n; ++k) {
      const DocSegment& g = segs.s[k];
      if (i >= g.out0 && i < g.out0 + g.len) w = doc_window(cu, n_docs, S, int32_t(g.pos0 + (i - g.out0)));
    }
    out[i] = w;
  }
}

}  // namespace

Status doc_windows(const int32_t* cu, int n_docs, int32_t S, const DocSegment* segs, int nseg, int64_t n_out,
                   DocWindow* out, cudaStream_t stream) {
  MK_REQUIRE(cu && out && n_docs >= 1 && S >= 1 && nseg >= 0 && nseg <= 3, Code::kInternal,
             "doc_windows: cu %p, n_docs %d, S %d, %d segments", static_cast<const void*>(cu), n_docs, S, nseg);
  Segs g{};
  g.n = nseg;
  for (int k = 0; k < nseg; ++k) {
    MK_REQUIRE(segs[k].pos0 >= 0 && segs[k].pos0 + segs[k].len <= S && segs[k].out0 >= 0 &&
                   segs[k].out0 + segs[k].len <= n_out,
               Code::kInternal, "doc_windows: segment %d (out %lld, position %lld, %lld rows) outside %d / %lld", k,
               (long long)segs[k].out0, (long long)segs[k].pos0, (long long)segs[k].len, S, (long long)n_out);
    g.s[k] = segs[k];
  }
  if (n_out == 0) return OkStatus();
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n_out + threads - 1) / threads, 1024);
  doc_windows_kernel<<<int(blocks), threads, 0, stream>>>(cu, n_docs, S, g, n_out, out);
  MK_CUDA_CHECK(cudaGetLastError());
  return OkStatus();
}

}  // namespace attention
}  // namespace mk
