// mkernel's C ABI (libmkernel_capi.so), declared in include/mkernel/c_api.h: what Python reaches
// through ctypes (python/mkernel/_capi.py). Every function returns 0 on success or the mk::Code of
// the failure; mk_last_error() gives the message of the calling thread's last failure.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "mkernel/attention/attention.h"
#include "mkernel/c_api.h"
#include "mkernel/common/tunables.h"
#include "mkernel/ops/collective.h"
#include "mkernel/ops/fused.h"
#include "mkernel/ops/moe.h"
#include "mkernel/ops/moe_layer.h"
#include "mkernel/ops/ring_attention.h"
#include "mkernel/runtime/bootstrap.h"
#include "mkernel/runtime/communicator.h"
#include "mkernel/runtime/topology.h"

namespace {
thread_local std::string g_last_error;
int ret(const mk::Status& s) {
  if (s.ok()) return 0;
  g_last_error = s.to_string();
  return static_cast<int>(s.code());
}
mk::attention::Strides strides(const int64_t* s) { return mk::attention::Strides{s[0], s[1], s[2]}; }
// The backward's arguments of mk_attention_backward and mk_attention_varlen_backward (strides: 3 per
// tensor, q, k, v, o, dout, dq, dk, dv).
mk::attention::BackwardArgs backward_args(const void* q, const void* k, const void* v, const void* o, const void* dout,
                                          const float* lse, void* dq, void* dk, void* dv, const int64_t* strides24,
                                          int B, int H, int Hkv, int Sq, int Skv, int D, float scale, int causal,
                                          int deterministic, void* workspace, size_t workspace_bytes) {
  mk::attention::BackwardArgs a;
  a.q = q, a.k = k, a.v = v, a.o = o, a.dout = dout, a.lse = lse;
  a.dq = dq, a.dk = dk, a.dv = dv;
  mk::attention::Strides* st[8] = {&a.q_stride, &a.k_stride, &a.v_stride, &a.o_stride,
                                   &a.do_stride, &a.dq_stride, &a.dk_stride, &a.dv_stride};
  for (int i = 0; i < 8; ++i) *st[i] = strides(strides24 + 3 * i);
  a.B = B, a.H = H, a.Hkv = Hkv, a.Sq = Sq, a.Skv = Skv, a.D = D;
  a.scale = scale;
  a.causal = causal != 0;
  a.deterministic = deterministic != 0;
  a.workspace = workspace;
  a.workspace_bytes = workspace_bytes;
  return a;
}
// A fused operator with the shape it was created for.
struct FusedHandle {
  std::unique_ptr<mk::ops::FusedGemm> op;
  mk::ops::FusedKind kind;
  int64_t M, N, K;
};
FusedHandle* handle(mk_fused_t h) { return reinterpret_cast<FusedHandle*>(h); }
mk::ops::FusedGemm* fused(mk_fused_t h) { return handle(h)->op.get(); }
mk::Communicator* comm_of(mk_comm_t c) { return reinterpret_cast<mk::Communicator*>(c); }
mk::ops::RingAttention* ring_of(mk_ring_t r) { return reinterpret_cast<mk::ops::RingAttention*>(r); }
mk::ops::RingAttentionBackward* ring_bwd_of(mk_ring_bwd_t r) {
  return reinterpret_cast<mk::ops::RingAttentionBackward*>(r);
}
mk::ops::MoeEp* moe_of(mk_moe_t m) { return reinterpret_cast<mk::ops::MoeEp*>(m); }
mk::ops::MoeLayer* moe_layer_of(mk_moe_layer_t m) { return reinterpret_cast<mk::ops::MoeLayer*>(m); }
mk::ops::MoeConfig moe_config(int64_t hidden, int num_experts, int topk, int64_t max_tokens_per_rank,
                              int expert_align, int64_t recv_capacity) {
  mk::ops::MoeConfig cfg;
  cfg.hidden = hidden;
  cfg.num_experts = num_experts;
  cfg.topk = topk;
  cfg.max_tokens_per_rank = max_tokens_per_rank;
  cfg.expert_align = expert_align;
  cfg.recv_capacity = recv_capacity;
  return cfg;
}
mk::ops::MoeOptions moe_options(int mode, int comm_ctas, const char* staging) {
  mk::ops::MoeOptions opt;
  opt.mode = static_cast<mk::ops::MoeMode>(mode);
  opt.comm_ctas = comm_ctas;
  opt.staging = staging ? staging : "";
  return opt;
}
mk::ops::Collective* coll_of(mk_coll_t c) { return reinterpret_cast<mk::ops::Collective*>(c); }

// The header's codes are mk::Code's values.
static_assert(MK_OK == static_cast<int>(mk::Code::kOk) && MK_INVALID_ARGUMENT == static_cast<int>(mk::Code::kInvalidArgument) &&
                  MK_MISMATCH == static_cast<int>(mk::Code::kMismatch) && MK_TIMEOUT == static_cast<int>(mk::Code::kTimeout) &&
                  MK_CUDA_ERROR == static_cast<int>(mk::Code::kCudaError) &&
                  MK_SYSTEM_ERROR == static_cast<int>(mk::Code::kSystemError) &&
                  MK_OUT_OF_MEMORY == static_cast<int>(mk::Code::kOutOfMemory) &&
                  MK_NOT_SUPPORTED == static_cast<int>(mk::Code::kNotSupported) &&
                  MK_REMOTE_ERROR == static_cast<int>(mk::Code::kRemoteError) &&
                  MK_PERMISSION_DENIED == static_cast<int>(mk::Code::kPermissionDenied) &&
                  MK_INTERNAL == static_cast<int>(mk::Code::kInternal),
              "c_api.h's mk_code_t differs from mk::Code");

int invalid(const std::string& what) { return ret(mk::Status(mk::Code::kInvalidArgument, what)); }

// The callback's reason, terminated here whatever it wrote (at most kWhyBytes - 1 characters).
constexpr size_t kWhyBytes = 512;
mk::Status store_failure(const char* op, const std::string& key, mk_store_why_fn why, void* ctx) {
  char reason[kWhyBytes] = {0};
  if (why && why(ctx, reason, sizeof(reason)) != 0) reason[0] = '\0';
  reason[sizeof(reason) - 1] = '\0';
  return mk::Status(mk::Code::kSystemError,
                    std::string("store ") + op + " '" + key + "' failed" + (reason[0] ? std::string(": ") + reason : ""));
}

mk::StoreCallbacks store_callbacks(void* ctx, mk_store_set_fn set, mk_store_get_fn get, mk_store_erase_fn erase,
                                   mk_store_why_fn why) {
  mk::StoreCallbacks cb;
  cb.set = [=](const std::string& key, const std::vector<uint8_t>& value) -> mk::Status {
    if (set(ctx, key.c_str(), value.data(), value.size()) != 0) return store_failure("set", key, why, ctx);
    return mk::Status();
  };
  // The size the callback reports is checked against what the bootstrap expects under the key
  // before anything of that size is allocated: a store anyone can write to must not choose it.
  cb.try_get = [=](const std::string& key, size_t max_bytes, std::vector<uint8_t>* value, bool* found) -> mk::Status {
    value->resize(std::max<size_t>(1, std::min<size_t>(max_bytes, 256)));
    for (int attempt = 0; attempt < 2; ++attempt) {
      size_t len = 0;
      int f = 0;
      if (get(ctx, key.c_str(), value->data(), value->size(), &len, &f) != 0) return store_failure("get", key, why, ctx);
      *found = f != 0;
      if (!*found) {
        value->clear();
        return mk::Status();
      }
      if (len > max_bytes)
        return mk::Status(mk::Code::kMismatch, "store get '" + key + "': the store holds " + std::to_string(len) +
                                                   " bytes under it, mkernel expects at most " +
                                                   std::to_string(max_bytes) +
                                                   " (another job or writer using this key prefix?)");
      if (len <= value->size()) {
        value->resize(len);
        return mk::Status();
      }
      value->resize(len);
    }
    return mk::Status(mk::Code::kInternal, "store get '" + key + "': the value kept growing between two reads");
  };
  if (erase) {
    cb.erase = [=](const std::string& key) -> mk::Status {
      if (erase(ctx, key.c_str()) != 0) return store_failure("erase", key, why, ctx);
      return mk::Status();
    };
  }
  return cb;
}

// Every entry point runs its body through guard(): no C++ exception crosses the C boundary (an
// allocation failure, a callback's size, a library bug); each becomes a status with the entry's name.
void set_error(mk::Code code, const char* fn, const char* what) noexcept {
  try {
    g_last_error = mk::Status(code, std::string(fn) + ": " + what).to_string();
  } catch (...) {
    g_last_error.clear();  // no memory even for the message: the code still says what happened
  }
}
template <class F>
int guard(const char* fn, F&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    set_error(mk::Code::kOutOfMemory, fn, "out of host memory");
    return static_cast<int>(mk::Code::kOutOfMemory);
  } catch (const std::exception& e) {
    set_error(mk::Code::kInternal, fn, e.what());
  } catch (...) {
    set_error(mk::Code::kInternal, fn, "an unknown exception");
  }
  return static_cast<int>(mk::Code::kInternal);
}
}  // namespace

extern "C" {

const char* mk_last_error(void) { return g_last_error.c_str(); }

int mk_api_version(void) { return MK_C_API_VERSION; }

// Strides are (batch, sequence, head) in elements, 3 per tensor: q, k, v, o.
int mk_attention_forward(const void* q, const void* k, const void* v, void* o, float* lse, const int64_t* strides12,
                         int B, int H, int Hkv, int Sq, int Skv, int D, float scale, int causal, int64_t q_pos0,
                         int64_t kv_pos0, void* stream) {
  return guard("mk_attention_forward", [&]() -> int {
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
  });
}

int mk_attention_backward_workspace(int B, int H, int Hkv, int Sq, int Skv, int D, int deterministic, size_t* bytes) {
  return guard("mk_attention_backward_workspace", [&]() -> int {
    if (!bytes) return ret(mk::make_status(mk::Code::kInvalidArgument, "mk_attention_backward_workspace: null bytes"));
    *bytes = 0;
    if (B <= 0 || H <= 0 || Hkv <= 0 || Sq <= 0 || Skv <= 0 || (D != 64 && D != 128))
      return ret(mk::make_status(mk::Code::kInvalidArgument,
                                 "mk_attention_backward_workspace: B %d H %d Hkv %d Sq %d Skv %d D %d (positive; D 64 "
                                 "or 128)",
                                 B, H, Hkv, Sq, Skv, D));
    mk::attention::BackwardArgs a;
    a.B = B, a.H = H, a.Hkv = Hkv, a.Sq = Sq, a.Skv = Skv, a.D = D;
    a.deterministic = deterministic != 0;
    *bytes = mk::attention::backward_workspace_bytes(a);
    return ret(mk::OkStatus());
  });
}

// Strides are (batch, sequence, head) in elements, 3 per tensor: q, k, v, o, dout, dq, dk, dv.
int mk_attention_backward(const void* q, const void* k, const void* v, const void* o, const void* dout,
                          const float* lse, void* dq, void* dk, void* dv, const int64_t* strides24, int B, int H,
                          int Hkv, int Sq, int Skv, int D, float scale, int causal, int64_t q_pos0, int64_t kv_pos0,
                          int deterministic, void* workspace, size_t workspace_bytes, void* stream) {
  return guard("mk_attention_backward", [&]() -> int {
    if (!strides24) return ret(mk::make_status(mk::Code::kInvalidArgument, "mk_attention_backward: null strides"));
    mk::attention::BackwardArgs a = backward_args(q, k, v, o, dout, lse, dq, dk, dv, strides24, B, H, Hkv, Sq, Skv, D,
                                                  scale, causal, deterministic, workspace, workspace_bytes);
    a.q_pos0 = q_pos0, a.kv_pos0 = kv_pos0;
    return ret(mk::attention::backward(a, static_cast<cudaStream_t>(stream)));
  });
}

int mk_attention_varlen_forward(const void* q, const void* k, const void* v, void* o, float* lse,
                                const int64_t* strides12, const int32_t* cu_seqlens, int n_docs, int H, int Hkv, int S,
                                int D, float scale, int causal, void* stream) {
  return guard("mk_attention_varlen_forward", [&]() -> int {
    if (!strides12) return ret(mk::make_status(mk::Code::kInvalidArgument, "mk_attention_varlen_forward: null strides"));
    if (!cu_seqlens)
      return ret(mk::make_status(mk::Code::kInvalidArgument, "mk_attention_varlen_forward: null cu_seqlens"));
    mk::attention::ForwardArgs a;
    a.q = q, a.k = k, a.v = v, a.o = o, a.lse = lse;
    a.q_stride = strides(strides12);
    a.k_stride = strides(strides12 + 3);
    a.v_stride = strides(strides12 + 6);
    a.o_stride = strides(strides12 + 9);
    a.B = 1, a.H = H, a.Hkv = Hkv, a.Sq = S, a.Skv = S, a.D = D;
    a.scale = scale;
    a.causal = causal != 0;
    a.cu_seqlens = cu_seqlens, a.n_docs = n_docs;
    return ret(mk::attention::forward(a, static_cast<cudaStream_t>(stream)));
  });
}

int mk_attention_varlen_backward_workspace(int H, int Hkv, int S, int D, int n_docs, int deterministic,
                                           size_t* bytes) {
  return guard("mk_attention_varlen_backward_workspace", [&]() -> int {
    if (!bytes)
      return ret(mk::make_status(mk::Code::kInvalidArgument, "mk_attention_varlen_backward_workspace: null bytes"));
    *bytes = 0;
    if (H <= 0 || Hkv <= 0 || S <= 0 || (D != 64 && D != 128) || n_docs < 1)
      return ret(mk::make_status(mk::Code::kInvalidArgument,
                                 "mk_attention_varlen_backward_workspace: H %d Hkv %d S %d D %d n_docs %d (positive; "
                                 "D 64 or 128)",
                                 H, Hkv, S, D, n_docs));
    mk::attention::BackwardArgs a;
    a.B = 1, a.H = H, a.Hkv = Hkv, a.Sq = S, a.Skv = S, a.D = D;
    a.cu_seqlens = reinterpret_cast<const int32_t*>(uintptr_t(16));  // only its presence counts here
    a.n_docs = n_docs;
    a.deterministic = deterministic != 0;
    *bytes = mk::attention::backward_workspace_bytes(a);
    if (*bytes == 0)
      return ret(mk::make_status(mk::Code::kInvalidArgument,
                                 "mk_attention_varlen_backward_workspace: %d documents over %d rows are too many", n_docs,
                                 S));
    return ret(mk::OkStatus());
  });
}

int mk_attention_varlen_backward(const void* q, const void* k, const void* v, const void* o, const void* dout,
                                 const float* lse, void* dq, void* dk, void* dv, const int64_t* strides24,
                                 const int32_t* cu_seqlens, int n_docs, int H, int Hkv, int S, int D, float scale,
                                 int causal, int deterministic, void* workspace, size_t workspace_bytes,
                                 void* stream) {
  return guard("mk_attention_varlen_backward", [&]() -> int {
    if (!strides24)
      return ret(mk::make_status(mk::Code::kInvalidArgument, "mk_attention_varlen_backward: null strides"));
    if (!cu_seqlens)
      return ret(mk::make_status(mk::Code::kInvalidArgument, "mk_attention_varlen_backward: null cu_seqlens"));
    mk::attention::BackwardArgs a = backward_args(q, k, v, o, dout, lse, dq, dk, dv, strides24, 1, H, Hkv, S, S, D, scale,
                                                  causal, deterministic, workspace, workspace_bytes);
    a.cu_seqlens = cu_seqlens, a.n_docs = n_docs;
    return ret(mk::attention::backward(a, static_cast<cudaStream_t>(stream)));
  });
}

int mk_attention_merge_init(float* o_acc, float* lse_acc, int B, int H, int S, int D, void* stream) {
  return guard("mk_attention_merge_init", [&]() -> int {
    return ret(mk::attention::merge_init(o_acc, lse_acc, B, H, S, D, static_cast<cudaStream_t>(stream)));
  });
}

int mk_attention_merge(float* o_acc, float* lse_acc, const void* o_part, const int64_t* part_strides,
                       const float* lse_part, int B, int H, int S, int D, void* stream) {
  return guard("mk_attention_merge", [&]() -> int {
    mk::attention::MergeArgs a;
    a.o_acc = o_acc, a.lse_acc = lse_acc, a.o_part = o_part, a.part_stride = strides(part_strides);
    a.lse_part = lse_part, a.B = B, a.H = H, a.S = S, a.D = D;
    return ret(mk::attention::merge(a, static_cast<cudaStream_t>(stream)));
  });
}

int mk_attention_merge_finish(const float* o_acc, void* o, const int64_t* o_strides, int B, int H, int S, int D,
                              void* stream) {
  return guard("mk_attention_merge_finish", [&]() -> int {
    return ret(mk::attention::merge_finish(o_acc, o, strides(o_strides), B, H, S, D, static_cast<cudaStream_t>(stream)));
  });
}

// ---- communicator over a caller's key-value store ----

// Collective over the `size` ranks that share `prefix` in the store. device: -2 tunable, -1
// local rank % visible GPUs, >= 0 that GPU. ranks_per_node: -1 tunable, else emulated nodes of
// that many ranks. The callbacks are called from this thread only, during this call and during
// collective calls on the communicator (operator creation, destroy).
int mk_comm_create_store(int rank, int size, const char* prefix, void* ctx, mk_store_set_fn set, mk_store_get_fn get,
                         mk_store_erase_fn erase, mk_store_why_fn why, int device, int ranks_per_node, int require_gpu,
                         mk_comm_t* out) {
  return guard("mk_comm_create_store", [&]() -> int {
    if (!out || !set || !get || !prefix) return invalid("mk_comm_create_store: null argument");
    *out = nullptr;
    std::unique_ptr<mk::Bootstrap> bs;
    mk::Status s = mk::make_store_bootstrap(rank, size, prefix, store_callbacks(ctx, set, get, erase, why), &bs);
    if (!s.ok()) return ret(s);
    mk::CommConfig cfg;
    cfg.device = device;
    cfg.ranks_per_node = ranks_per_node;
    cfg.require_gpu = require_gpu != 0;
    std::unique_ptr<mk::Communicator> comm;
    s = mk::Communicator::create(std::move(bs), cfg, &comm);
    if (!s.ok()) return ret(s);
    *out = reinterpret_cast<mk_comm_t>(comm.release());
    return 0;
  });
}

int mk_comm_info(mk_comm_t comm, mk_comm_info_t* out) {
  return guard("mk_comm_info", [&]() -> int {
    if (!comm || !out) return invalid("mk_comm_info: null argument");
    mk::Communicator* c = comm_of(comm);
    const mk::Topology& t = c->topology();
    *out = mk_comm_info_t{c->rank(), c->world(), t.node, t.num_nodes, t.local_rank, t.local_size, c->device()};
    return 0;
  });
}

// The communicator's health: a device wait that gave up, an abort, a proxy error.
int mk_comm_check(mk_comm_t comm) {
  return guard("mk_comm_check", [&]() -> int {
    if (!comm) return invalid("mk_comm_check: null communicator");
    return ret(comm_of(comm)->check());
  });
}

// Collective: destroys the operators still attached, then the communicator, and frees it.
int mk_comm_destroy(mk_comm_t comm) {
  return guard("mk_comm_destroy", [&]() -> int {
    if (!comm) return 0;
    mk::Communicator* c = comm_of(comm);
    mk::Status s = c->destroy();
    delete c;
    return ret(s);
  });
}

// A tunable by name (`mkernel doctor` lists them), before the objects that read it are created.
int mk_tunable_set(const char* name, const char* value) {
  return guard("mk_tunable_set", [&]() -> int {
    if (!name || !value) return invalid("mk_tunable_set: null argument");
    return ret(mk::tunables::set(name, value));
  });
}

// ---- fused GEMM collectives (include/mkernel/ops/fused.h) ----

// kind: 0 ag_gemm, 1 gemm_rs, 2 gemm_ar. Collective. comm_ctas -1: tunable. staging: "" tunable.
int mk_fused_create(mk_comm_t comm, int kind, int64_t M, int64_t N, int64_t K, int deterministic, int comm_ctas,
                    const char* staging, mk_fused_t* out) {
  return mk_fused_create_rows(comm, kind, M, N, K, nullptr, 0, deterministic, comm_ctas, staging, out);
}

// Uneven shards: shard_rows[nrows] (host), each rank's rows (PlanShape::rows); NULL and 0: even.
int mk_fused_create_rows(mk_comm_t comm, int kind, int64_t M, int64_t N, int64_t K, const int64_t* shard_rows,
                         int nrows, int deterministic, int comm_ctas, const char* staging, mk_fused_t* out) {
  return guard("mk_fused_create", [&]() -> int {
    if (!comm || !out) return invalid("mk_fused_create: null argument");
    if (kind < 0 || kind > 2) return invalid("mk_fused_create: kind " + std::to_string(kind) + " is not 0, 1 or 2");
    if (nrows < 0 || (nrows > 0) != (shard_rows != nullptr))
      return invalid("mk_fused_create: shard_rows and nrows must both be given (or NULL and 0)");
    *out = nullptr;
    mk::ops::FusedOptions opt;
    opt.deterministic = deterministic != 0;
    opt.comm_ctas = comm_ctas;
    opt.staging = staging ? staging : "";
    auto h = std::make_unique<FusedHandle>();
    h->kind = static_cast<mk::ops::FusedKind>(kind);
    h->M = M, h->N = N, h->K = K;
    std::vector<int64_t> rows;
    if (nrows > 0) rows.assign(shard_rows, shard_rows + nrows);
    mk::Status s = mk::ops::FusedGemm::create(comm_of(comm), h->kind, mk::ops::PlanShape(M, N, K, rows), opt, &h->op);
    if (!s.ok()) return ret(s);
    *out = reinterpret_cast<mk_fused_t>(h.release());
    return 0;
  });
}

// bf16 A, B, C (fused.h: shapes per kind). Enqueues on `stream`; capturable in a CUDA graph.
int mk_fused_run(mk_fused_t op, const void* A, const void* B, void* C, void* stream) {
  return guard("mk_fused_run", [&]() -> int {
    if (!op) return invalid("mk_fused_run: null operator");
    mk::ops::FusedArgs a;
    a.A = A, a.B = B, a.C = C;
    return ret(fused(op)->run(a, static_cast<cudaStream_t>(stream)));
  });
}

// ag_gemm: the gathered A [M, K] of the last call (valid once it completed on its stream).
int mk_fused_gathered_a(mk_fused_t op, const void** out) {
  return guard("mk_fused_gathered_a", [&]() -> int {
    if (!op || !out) return invalid("mk_fused_gathered_a: null argument");
    *out = fused(op)->gathered_a();
    return 0;
  });
}

// Copies the gathered A [M, K] bf16 of the last call into dst, on `stream` (after that call).
int mk_fused_copy_gathered_a(mk_fused_t op, void* dst, void* stream) {
  return guard("mk_fused_copy_gathered_a", [&]() -> int {
    if (!op || !dst) return invalid("mk_fused_copy_gathered_a: null argument");
    FusedHandle* h = handle(op);
    if (h->kind != mk::ops::FusedKind::kAgGemm) return invalid("mk_fused_copy_gathered_a: not an ag_gemm operator");
    cudaError_t e = cudaMemcpyAsync(dst, h->op->gathered_a(), static_cast<size_t>(h->M * h->K) * 2, cudaMemcpyDeviceToDevice,
                                    static_cast<cudaStream_t>(stream));
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // not left behind for the next launch's check
      return ret(mk::Status(mk::Code::kCudaError, std::string("mk_fused_copy_gathered_a: ") + cudaGetErrorString(e)));
    }
    return 0;
  });
}

int mk_fused_comm_ctas(mk_fused_t op, int* out) {
  return guard("mk_fused_comm_ctas", [&]() -> int {
    if (!op || !out) return invalid("mk_fused_comm_ctas: null argument");
    *out = fused(op)->comm_ctas();
    return 0;
  });
}

// Collective: destroys (idempotent; a no-op after its communicator was destroyed) and frees.
int mk_fused_destroy(mk_fused_t op) {
  return guard("mk_fused_destroy", [&]() -> int {
    if (!op) return 0;
    FusedHandle* h = handle(op);
    mk::Status s = h->op->destroy();
    delete h;
    return ret(s);
  });
}

// ---- standalone collectives (include/mkernel/ops/collective.h) ----

// kind: 0 allgather, 1 reduce_scatter, 2 allreduce; dtype: 0 bf16, 1 fp32. Collective.
int mk_coll_create(mk_comm_t comm, int kind, int dtype, int64_t count, int64_t chunk_elems, int ctas,
                   const char* staging, mk_coll_t* out) {
  return guard("mk_coll_create", [&]() -> int {
    if (!comm || !out) return invalid("mk_coll_create: null argument");
    if (kind < 0 || kind > 2) return invalid("mk_coll_create: kind " + std::to_string(kind) + " is not 0, 1 or 2");
    if (dtype < 0 || dtype > 1) return invalid("mk_coll_create: dtype " + std::to_string(dtype) + " is not 0 (bf16) or 1 (fp32)");
    *out = nullptr;
    mk::ops::CollectiveOptions opt;
    opt.chunk_elems = chunk_elems;
    opt.ctas = ctas;
    opt.staging = staging ? staging : "";
    std::unique_ptr<mk::ops::Collective> op;
    mk::Status s = mk::ops::Collective::create(comm_of(comm), static_cast<mk::ops::CollectiveKind>(kind), count,
                                               static_cast<mk::ops::CollDType>(dtype), opt, &op);
    if (!s.ok()) return ret(s);
    *out = reinterpret_cast<mk_coll_t>(op.release());
    return 0;
  });
}

int mk_coll_run(mk_coll_t op, const void* src, void* dst, void* stream) {
  return guard("mk_coll_run", [&]() -> int {
    if (!op) return invalid("mk_coll_run: null operator");
    return ret(coll_of(op)->run({src, dst}, static_cast<cudaStream_t>(stream)));
  });
}

int mk_coll_in_elems(mk_coll_t op, int64_t* out) {
  return guard("mk_coll_in_elems", [&]() -> int {
    if (!op || !out) return invalid("mk_coll_in_elems: null argument");
    *out = coll_of(op)->in_elems();
    return 0;
  });
}

int mk_coll_out_elems(mk_coll_t op, int64_t* out) {
  return guard("mk_coll_out_elems", [&]() -> int {
    if (!op || !out) return invalid("mk_coll_out_elems: null argument");
    *out = coll_of(op)->out_elems();
    return 0;
  });
}

int mk_coll_input(mk_coll_t op, void** out) {
  return guard("mk_coll_input", [&]() -> int {
    if (!op || !out) return invalid("mk_coll_input: null argument");
    *out = coll_of(op)->input();
    return 0;
  });
}

int mk_coll_output(mk_coll_t op, void** out) {
  return guard("mk_coll_output", [&]() -> int {
    if (!op || !out) return invalid("mk_coll_output: null argument");
    *out = coll_of(op)->output();
    return 0;
  });
}

// Collective: destroys (idempotent; a no-op after its communicator was destroyed) and frees.
int mk_coll_destroy(mk_coll_t op) {
  return guard("mk_coll_destroy", [&]() -> int {
    if (!op) return 0;
    mk::ops::Collective* c = coll_of(op);
    mk::Status s = c->destroy();
    delete c;
    return ret(s);
  });
}

// ---- ring attention (include/mkernel/ops/ring_attention.h) ----

// layout: 0 contiguous, 1 zigzag. Collective. scale 0: 1/sqrt(D).
namespace {
int ring_shape(const char* what, int B, int H, int Hkv, int D, int64_t S, int layout, int causal, float scale,
               int comm_ctas, const char* staging, const int64_t* shard_rows, int nrows,
               mk::ops::RingAttentionShape* shape, mk::ops::RingAttentionOptions* opt) {
  if (layout != 0 && layout != 1)
    return invalid(std::string(what) + ": layout " + std::to_string(layout) + " is not 0 or 1");
  if (nrows < 0 || (nrows > 0) != (shard_rows != nullptr))
    return invalid(std::string(what) + ": shard_rows and nrows must both be given (or NULL and 0)");
  if (nrows > 0) shape->rows.assign(shard_rows, shard_rows + nrows);
  shape->B = B, shape->H = H, shape->Hkv = Hkv, shape->D = D, shape->S = S;
  shape->layout = static_cast<mk::ops::SeqLayout>(layout);
  shape->causal = causal != 0;
  opt->comm_ctas = comm_ctas;
  opt->scale = scale;
  opt->staging = staging ? staging : "";
  return 0;
}
}  // namespace

int mk_ring_create(mk_comm_t comm, int B, int H, int Hkv, int D, int64_t S, int layout, int causal, float scale,
                   int comm_ctas, const char* staging, mk_ring_t* out) {
  return mk_ring_create_rows(comm, B, H, Hkv, D, S, layout, causal, scale, nullptr, 0, comm_ctas, staging, out);
}

int mk_ring_create_rows(mk_comm_t comm, int B, int H, int Hkv, int D, int64_t S, int layout, int causal, float scale,
                        const int64_t* shard_rows, int nrows, int comm_ctas, const char* staging, mk_ring_t* out) {
  return guard("mk_ring_create", [&]() -> int {
    if (!comm || !out) return invalid("mk_ring_create: null argument");
    *out = nullptr;
    mk::ops::RingAttentionShape shape;
    mk::ops::RingAttentionOptions opt;
    if (int e = ring_shape("mk_ring_create", B, H, Hkv, D, S, layout, causal, scale, comm_ctas, staging, shard_rows,
                           nrows, &shape, &opt))
      return e;
    std::unique_ptr<mk::ops::RingAttention> op;
    mk::Status s = mk::ops::RingAttention::create(comm_of(comm), shape, opt, &op);
    if (!s.ok()) return ret(s);
    *out = reinterpret_cast<mk_ring_t>(op.release());
    return 0;
  });
}

int mk_ring_balanced_rows(const int32_t* host_cu_seqlens, int n_docs, int world, int causal, int64_t* host_rows) {
  return guard("mk_ring_balanced_rows", [&]() -> int {
    if (!host_rows) return invalid("mk_ring_balanced_rows: null host_rows");
    std::vector<int64_t> rows;
    mk::Status s = mk::ops::ring_balanced_rows(host_cu_seqlens, n_docs, world, causal != 0, &rows);
    if (!s.ok()) return ret(s);
    std::copy(rows.begin(), rows.end(), host_rows);
    return 0;
  });
}

int mk_ring_backward_create(mk_comm_t comm, int B, int H, int Hkv, int D, int64_t S, int layout, int causal,
                            float scale, int comm_ctas, const char* staging, mk_ring_bwd_t* out) {
  return mk_ring_backward_create_rows(comm, B, H, Hkv, D, S, layout, causal, scale, nullptr, 0, comm_ctas, staging,
                                      out);
}

int mk_ring_backward_create_rows(mk_comm_t comm, int B, int H, int Hkv, int D, int64_t S, int layout, int causal,
                                 float scale, const int64_t* shard_rows, int nrows, int comm_ctas,
                                 const char* staging, mk_ring_bwd_t* out) {
  return guard("mk_ring_backward_create", [&]() -> int {
    if (!comm || !out) return invalid("mk_ring_backward_create: null argument");
    *out = nullptr;
    mk::ops::RingAttentionShape shape;
    mk::ops::RingAttentionOptions opt;
    if (int e = ring_shape("mk_ring_backward_create", B, H, Hkv, D, S, layout, causal, scale, comm_ctas, staging,
                           shard_rows, nrows, &shape, &opt))
      return e;
    std::unique_ptr<mk::ops::RingAttentionBackward> op;
    mk::Status s = mk::ops::RingAttentionBackward::create(comm_of(comm), shape, opt, &op);
    if (!s.ok()) return ret(s);
    *out = reinterpret_cast<mk_ring_bwd_t>(op.release());
    return 0;
  });
}

int mk_ring_backward_run(mk_ring_bwd_t op, const void* q, const void* k, const void* v, const void* o,
                         const void* dout, const float* lse, void* dq, void* dk, void* dv, void* stream) {
  return guard("mk_ring_backward_run", [&]() -> int {
    if (!op) return invalid("mk_ring_backward_run: null operator");
    mk::ops::RingAttentionBackwardArgs a{q, k, v, o, dout, lse, dq, dk, dv};
    return ret(ring_bwd_of(op)->run(a, static_cast<cudaStream_t>(stream)));
  });
}

int mk_ring_backward_run_packed(mk_ring_bwd_t op, const void* q, const void* k, const void* v, const void* o,
                                const void* dout, const float* lse, void* dq, void* dk, void* dv,
                                const int32_t* cu_seqlens, int n_docs, void* stream) {
  return guard("mk_ring_backward_run_packed", [&]() -> int {
    if (!op) return invalid("mk_ring_backward_run_packed: null operator");
    mk::ops::RingAttentionBackwardArgs a{q, k, v, o, dout, lse, dq, dk, dv};
    a.cu_seqlens = cu_seqlens, a.n_docs = n_docs;
    return ret(ring_bwd_of(op)->run(a, static_cast<cudaStream_t>(stream)));
  });
}

int mk_ring_backward_destroy(mk_ring_bwd_t op) {
  return guard("mk_ring_backward_destroy", [&]() -> int {
    if (!op) return 0;
    mk::ops::RingAttentionBackward* o = ring_bwd_of(op);
    mk::Status s = o->destroy();
    delete o;
    return ret(s);
  });
}

// q, o [B, S/W, H, D], k, v [B, S/W, Hkv, D] bf16 contiguous; lse [B, H, S/W] fp32 or null.
int mk_ring_run(mk_ring_t op, const void* q, const void* k, const void* v, void* o, float* lse, void* stream) {
  return guard("mk_ring_run", [&]() -> int {
    if (!op) return invalid("mk_ring_run: null operator");
    mk::ops::RingAttentionArgs a;
    a.q = q, a.k = k, a.v = v, a.o = o, a.lse = lse;
    return ret(ring_of(op)->run(a, static_cast<cudaStream_t>(stream)));
  });
}

int mk_ring_run_packed(mk_ring_t op, const void* q, const void* k, const void* v, void* o, float* lse,
                       const int32_t* cu_seqlens, int n_docs, void* stream) {
  return guard("mk_ring_run_packed", [&]() -> int {
    if (!op) return invalid("mk_ring_run_packed: null operator");
    mk::ops::RingAttentionArgs a;
    a.q = q, a.k = k, a.v = v, a.o = o, a.lse = lse;
    a.cu_seqlens = cu_seqlens, a.n_docs = n_docs;
    return ret(ring_of(op)->run(a, static_cast<cudaStream_t>(stream)));
  });
}

int mk_ring_destroy(mk_ring_t op) {
  return guard("mk_ring_destroy", [&]() -> int {
    if (!op) return 0;
    mk::ops::RingAttention* o = ring_of(op);
    mk::Status s = o->destroy();
    delete o;
    return ret(s);
  });
}

// ---- MoE dispatch and combine (include/mkernel/ops/moe.h) ----

int mk_moe_create(mk_comm_t comm, int64_t hidden, int num_experts, int topk, int64_t max_tokens_per_rank,
                  int expert_align, int64_t recv_capacity, int mode, int comm_ctas, const char* staging,
                  mk_moe_t* out) {
  return guard("mk_moe_create", [&]() -> int {
    if (!comm || !out) return invalid("mk_moe_create: null argument");
    if (mode < 0 || mode > 2) return invalid("mk_moe_create: mode " + std::to_string(mode) + " is not 0, 1 or 2");
    *out = nullptr;
    const mk::ops::MoeConfig cfg =
        moe_config(hidden, num_experts, topk, max_tokens_per_rank, expert_align, recv_capacity);
    const mk::ops::MoeOptions opt = moe_options(mode, comm_ctas, staging);
    std::unique_ptr<mk::ops::MoeEp> ep;
    mk::Status s = mk::ops::MoeEp::create(comm_of(comm), cfg, opt, &ep);
    if (!s.ok()) return ret(s);
    *out = reinterpret_cast<mk_moe_t>(ep.release());
    return 0;
  });
}

int mk_moe_recv_rows(mk_moe_t ep, int64_t* out) {
  return guard("mk_moe_recv_rows", [&]() -> int {
    if (!ep || !out) return invalid("mk_moe_recv_rows: null argument");
    *out = moe_of(ep)->recv_rows();
    return 0;
  });
}

int mk_moe_local_experts(mk_moe_t ep, int* out) {
  return guard("mk_moe_local_experts", [&]() -> int {
    if (!ep || !out) return invalid("mk_moe_local_experts: null argument");
    *out = moe_of(ep)->local_experts();
    return 0;
  });
}

int mk_moe_dispatch(mk_moe_t ep, const void* x, const int32_t* topk_ids, const float* topk_weights,
                    const int32_t* d_num_tokens, int64_t tokens, void* recv_x, int32_t* counts, int32_t* offsets,
                    void* stream) {
  return guard("mk_moe_dispatch", [&]() -> int {
    if (!ep) return invalid("mk_moe_dispatch: null operator");
    mk::ops::MoeDispatchArgs a;
    a.x = x, a.topk_ids = topk_ids, a.topk_weights = topk_weights, a.d_num_tokens = d_num_tokens, a.tokens = tokens;
    mk::ops::MoeDispatchOut o;
    o.recv_x = recv_x, o.counts = counts, o.offsets = offsets;
    return ret(moe_of(ep)->dispatch(a, o, static_cast<cudaStream_t>(stream)));
  });
}

int mk_moe_combine(mk_moe_t ep, const void* y, void* combined, void* stream) {
  return guard("mk_moe_combine", [&]() -> int {
    if (!ep) return invalid("mk_moe_combine: null operator");
    mk::ops::MoeCombineArgs a;
    a.y = y;
    return ret(moe_of(ep)->combine(a, combined, static_cast<cudaStream_t>(stream)));
  });
}

int mk_moe_sizes(int world, int nodes, int local, int64_t hidden, int num_experts, int topk,
                 int64_t max_tokens_per_rank, int expert_align, int64_t recv_capacity, int mode,
                 int64_t* host_recv_rows, int64_t* host_routing_bytes) {
  return guard("mk_moe_sizes", [&]() -> int {
    if (!host_recv_rows || !host_routing_bytes) return invalid("mk_moe_sizes: null output");
    if (world < 1 || nodes < 1 || local < 1 || nodes * local != world)
      return invalid("mk_moe_sizes: " + std::to_string(nodes) + " nodes of " + std::to_string(local) +
                     " ranks are not " + std::to_string(world) + " ranks");
    if (mode < 0 || mode > 2) return invalid("mk_moe_sizes: mode " + std::to_string(mode) + " is not 0, 1 or 2");
    const mk::ops::MoeConfig cfg =
        moe_config(hidden, num_experts, topk, max_tokens_per_rank, expert_align, recv_capacity);
    mk::Topology topo;
    topo.world = world;
    topo.num_nodes = nodes;
    topo.local_size = local;
    mk::ops::MoeMemory m;
    mk::Status s = mk::ops::MoeEp::can_implement(cfg, world);
    if (s.ok()) s = mk::ops::MoeEp::buffer_bytes(cfg, topo, false, &m, static_cast<mk::ops::MoeMode>(mode));
    if (!s.ok()) return ret(s);
    *host_recv_rows = m.recv_rows;
    *host_routing_bytes = int64_t(m.handle_bytes);
    return 0;
  });
}

int mk_moe_routing_bytes(mk_moe_t ep, int64_t* out) {
  return guard("mk_moe_routing_bytes", [&]() -> int {
    if (!ep || !out) return invalid("mk_moe_routing_bytes: null argument");
    *out = int64_t(moe_of(ep)->handle_bytes());
    return 0;
  });
}

int mk_moe_dispatch_routed(mk_moe_t ep, const void* x, const int32_t* topk_ids, const float* topk_weights,
                           const int32_t* d_num_tokens, int64_t tokens, void* recv_x, int32_t* counts, int32_t* offsets,
                           void* routing, int64_t routing_bytes, void* stream) {
  return guard("mk_moe_dispatch_routed", [&]() -> int {
    if (!ep) return invalid("mk_moe_dispatch_routed: null operator");
    if (routing_bytes < 0) return invalid("mk_moe_dispatch_routed: negative routing_bytes");
    std::unique_ptr<mk::ops::MoeHandle> h;
    mk::Status s = moe_of(ep)->create_handle(routing, uint64_t(routing_bytes), false, &h);
    if (!s.ok()) return ret(s);
    mk::ops::MoeDispatchArgs a;
    a.x = x, a.topk_ids = topk_ids, a.topk_weights = topk_weights, a.d_num_tokens = d_num_tokens, a.tokens = tokens;
    mk::ops::MoeDispatchOut o;
    o.recv_x = recv_x, o.counts = counts, o.offsets = offsets;
    return ret(moe_of(ep)->dispatch(a, o, static_cast<cudaStream_t>(stream), h.get()));
  });
}

int mk_moe_combine_routed(mk_moe_t ep, const void* y, const float* topk_weights, const void* routing,
                          int64_t routing_bytes, void* combined, void* stream) {
  return guard("mk_moe_combine_routed", [&]() -> int {
    if (!ep) return invalid("mk_moe_combine_routed: null operator");
    if (routing_bytes < 0) return invalid("mk_moe_combine_routed: negative routing_bytes");
    std::unique_ptr<mk::ops::MoeHandle> h;
    // The combine reads the routing; the handle's type is non-const only because a dispatch
    // writes through it.
    mk::Status s = moe_of(ep)->create_handle(const_cast<void*>(routing), uint64_t(routing_bytes), true, &h);
    if (!s.ok()) return ret(s);
    mk::ops::MoeCombineArgs a;
    a.y = y;
    a.topk_weights = topk_weights;
    return ret(moe_of(ep)->combine(a, combined, static_cast<cudaStream_t>(stream), h.get()));
  });
}

int mk_moe_check(mk_moe_t ep) {
  return guard("mk_moe_check", [&]() -> int {
    if (!ep) return invalid("mk_moe_check: null operator");
    return ret(moe_of(ep)->check());
  });
}

int mk_moe_destroy(mk_moe_t ep) {
  return guard("mk_moe_destroy", [&]() -> int {
    if (!ep) return 0;
    mk::ops::MoeEp* e = moe_of(ep);
    mk::Status s = e->destroy();
    delete e;
    return ret(s);
  });
}

// ---- The MoE layer (include/mkernel/ops/moe_layer.h) ----

int mk_moe_layer_create(mk_comm_t comm, int64_t hidden, int num_experts, int topk, int64_t max_tokens_per_rank,
                        int expert_align, int64_t recv_capacity, int64_t intermediate, int mode, int comm_ctas,
                        const char* staging, mk_moe_layer_t* out) {
  return guard("mk_moe_layer_create", [&]() -> int {
    if (!comm || !out) return invalid("mk_moe_layer_create: null argument");
    if (mode < 0 || mode > 2) return invalid("mk_moe_layer_create: mode " + std::to_string(mode) + " is not 0, 1 or 2");
    *out = nullptr;
    mk::ops::MoeLayerConfig cfg;
    cfg.moe = moe_config(hidden, num_experts, topk, max_tokens_per_rank, expert_align, recv_capacity);
    cfg.intermediate = intermediate;
    const mk::ops::MoeOptions opt = moe_options(mode, comm_ctas, staging);
    std::unique_ptr<mk::ops::MoeLayer> layer;
    mk::Status s = mk::ops::MoeLayer::create(comm_of(comm), cfg, opt, &layer);
    if (!s.ok()) return ret(s);
    *out = reinterpret_cast<mk_moe_layer_t>(layer.release());
    return 0;
  });
}

int mk_moe_layer_run(mk_moe_layer_t layer, const void* x, const int32_t* topk_ids, const float* topk_weights,
                     const int32_t* d_num_tokens, int64_t tokens, const void* w1, const void* w2, void* combined,
                     void* stream) {
  return guard("mk_moe_layer_run", [&]() -> int {
    if (!layer) return invalid("mk_moe_layer_run: null layer");
    mk::ops::MoeLayerArgs a;
    a.x = x, a.topk_ids = topk_ids, a.topk_weights = topk_weights, a.d_num_tokens = d_num_tokens, a.tokens = tokens;
    a.w1 = w1, a.w2 = w2;
    return ret(moe_layer_of(layer)->run(a, combined, static_cast<cudaStream_t>(stream)));
  });
}

int mk_moe_layer_check(mk_moe_layer_t layer) {
  return guard("mk_moe_layer_check", [&]() -> int {
    if (!layer) return invalid("mk_moe_layer_check: null layer");
    return ret(moe_layer_of(layer)->check());
  });
}

int mk_moe_layer_destroy(mk_moe_layer_t layer) {
  return guard("mk_moe_layer_destroy", [&]() -> int {
    if (!layer) return 0;
    mk::ops::MoeLayer* l = moe_layer_of(layer);
    mk::Status s = l->destroy();
    delete l;
    return ret(s);
  });
}

}  // extern "C"
