// mkernel's C ABI (libmkernel_capi.so): what Python reaches through ctypes (python/mkernel).
// Every function returns 0 on success or the mk::Code of the failure; mk_last_error() gives the
// message of the calling thread's last failure.
#include <cstdint>
#include <cstring>
#include <string>

#include "mkernel/attention/attention.h"

namespace {
thread_local std::string g_last_error;
int ret(const mk::Status& s) {
  if (s.ok()) return 0;
  g_last_error = s.to_string();
  return static_cast<int>(s.code());
}
mk::attention::Strides strides(const int64_t* s) { return mk::attention::Strides{s[0], s[1], s[2]}; }
}  // namespace

extern "C" {

__attribute__((visibility("default"))) const char* mk_last_error() { return g_last_error.c_str(); }

// Strides are (batch, sequence, head) in elements, 3 per tensor: q, k, v, o.
__attribute__((visibility("default"))) int mk_attention_forward(const void* q, const void* k, const void* v, void* o,
                                                                float* lse, const int64_t* strides12, int B, int H,
                                                                int Hkv, int Sq, int Skv, int D, float scale,
                                                                int causal, int64_t q_pos0, int64_t kv_pos0,
                                                                void* stream) {
  mk::attention::ForwardArgs a;
  a.q = q, a.k = k, a.v = v, a.o = o, a.lse = lse;
  a.q_stride = strides(strides12);
  a.k_stride = strides(strides12 + 3);
  a.v_stride = strides(strides12 + 6);
  a.o_stride = strides(strides12 + 9);
  a.B = B, a.H = H, a.Hkv = Hkv, a.Sq = Sq, a.Skv = Skv, a.D = D;
  a.scale = scale;
  a.causal = causal != 0;
  a.q_pos0 = q_pos0, a.kv_pos0 = kv_pos0;
  return ret(mk::attention::forward(a, static_cast<cudaStream_t>(stream)));
}

__attribute__((visibility("default"))) int mk_attention_merge_init(float* o_acc, float* lse_acc, int B, int H, int S,
                                                                   int D, void* stream) {
  return ret(mk::attention::merge_init(o_acc, lse_acc, B, H, S, D, static_cast<cudaStream_t>(stream)));
}

__attribute__((visibility("default"))) int mk_attention_merge(float* o_acc, float* lse_acc, const void* o_part,
                                                              const int64_t* part_strides, const float* lse_part,
                                                              int B, int H, int S, int D, void* stream) {
  mk::attention::MergeArgs a;
  a.o_acc = o_acc, a.lse_acc = lse_acc, a.o_part = o_part, a.part_stride = strides(part_strides);
  a.lse_part = lse_part, a.B = B, a.H = H, a.S = S, a.D = D;
  return ret(mk::attention::merge(a, static_cast<cudaStream_t>(stream)));
}

__attribute__((visibility("default"))) int mk_attention_merge_finish(const float* o_acc, void* o,
                                                                     const int64_t* o_strides, int B, int H, int S,
                                                                     int D, void* stream) {
  return ret(mk::attention::merge_finish(o_acc, o, strides(o_strides), B, H, S, D, static_cast<cudaStream_t>(stream)));
}

}  // extern "C"
