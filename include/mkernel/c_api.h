/* mkernel's C ABI (libmkernel_capi.so): what Python reaches through ctypes (python/mkernel/_capi.py,
 * checked against this header by tests/python/test_capi_header.py) and what C callers link.
 *
 * Every function returns 0 (MK_OK) on success or the mk_code_t of the failure; mk_last_error()
 * gives the message of the calling thread's last failure. Handles are opaque; a function marked
 * "collective" must be called by every rank of the communicator, in the same order. Streams are
 * cudaStream_t passed as void*. Tensors are device pointers, bf16 unless stated, row-major.
 *
 * Pure C (C99), usable from C++; nothing here depends on CUDA's headers. */
#ifndef MKERNEL_C_API_H_
#define MKERNEL_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define MK_C_EXPORT __attribute__((visibility("default")))
#else
#define MK_C_EXPORT
#endif

/* Bumped when a signature or a struct below changes. */
#define MK_C_API_VERSION 10

/* mk::Code, by value (include/mkernel/common/status.h). */
typedef enum mk_code {
  MK_OK = 0,
  MK_INVALID_ARGUMENT = 1,
  MK_MISMATCH = 2,
  MK_TIMEOUT = 3,
  MK_CUDA_ERROR = 4,
  MK_SYSTEM_ERROR = 5,
  MK_OUT_OF_MEMORY = 6,
  MK_NOT_SUPPORTED = 7,
  MK_REMOTE_ERROR = 8,
  MK_PERMISSION_DENIED = 9,
  MK_INTERNAL = 10
} mk_code_t;

typedef struct mk_comm_s* mk_comm_t;    /* a communicator */
typedef struct mk_fused_s* mk_fused_t;  /* a fused GEMM collective */
typedef struct mk_ring_s* mk_ring_t;    /* ring attention */
typedef struct mk_ring_bwd_s* mk_ring_bwd_t;  /* ring attention's backward */
typedef struct mk_moe_s* mk_moe_t;      /* MoE expert-parallel dispatch and combine */
typedef struct mk_coll_s* mk_coll_t;    /* a standalone collective */
typedef struct mk_moe_layer_s* mk_moe_layer_t;  /* a whole MoE layer (dispatch, experts, combine) */

typedef struct mk_comm_info {
  int rank, world;             /* this rank, all ranks */
  int node, nodes;             /* this rank's node, the number of nodes */
  int local_rank, local_size;  /* within the node */
  int device;                  /* the CUDA device this rank uses */
} mk_comm_info_t;

/* A key-value store the caller serves (PyTorch's c10d store, through ctypes). Each callback
 * returns 0 on success; on failure non-zero, with the caller's reason readable through `why`.
 * get copies the value into buf when it fits (cap bytes) and sets *len to its size; *found = 0
 * when the key is absent; a value larger than cap: *len says how large, and the call is repeated
 * (once, and only when *len is within what the library expects under that key: a larger value is
 * an error, MK_MISMATCH, and nothing of that size is allocated). why writes the reason of the
 * last failure into buf (cap bytes; the library terminates it at buf[cap - 1] whatever it wrote)
 * and returns 0. No callback may throw or unwind through the library. */
typedef int (*mk_store_set_fn)(void* ctx, const char* key, const void* data, size_t len);
typedef int (*mk_store_get_fn)(void* ctx, const char* key, void* buf, size_t cap, size_t* len, int* found);
typedef int (*mk_store_erase_fn)(void* ctx, const char* key);
typedef int (*mk_store_why_fn)(void* ctx, char* buf, size_t cap);

/* ---- errors, version, tunables ---- */

MK_C_EXPORT const char* mk_last_error(void);
MK_C_EXPORT int mk_api_version(void); /* MK_C_API_VERSION of the library */
/* A tunable by name (`mkernel doctor` lists them), before the objects that read it are created. */
MK_C_EXPORT int mk_tunable_set(const char* name, const char* value);

/* ---- attention (include/mkernel/attention/attention.h) ---- */

/* Strides are (batch, sequence, head) in elements, 3 per tensor: q, k, v, o (12). lse [B, H, Sq]
 * fp32 or null. causal: 0 or 1; q_pos0 / kv_pos0: global positions of the first rows. */
MK_C_EXPORT int mk_attention_forward(const void* q, const void* k, const void* v, void* o, float* lse,
                         const int64_t* strides12, int B, int H, int Hkv, int Sq, int Skv, int D,
                         float scale, int causal, int64_t q_pos0, int64_t kv_pos0, void* stream);
/* The backward (attention.h: BackwardArgs). Strides: 3 per tensor, q, k, v, o, dout, dq, dk, dv (24).
 * lse: the forward's [B, H, Sq] fp32. workspace: device memory of at least the bytes that
 * mk_attention_backward_workspace writes to *out (for the call's fastest schedule; attention.h:
 * backward_workspace_bytes(args)), 256-byte aligned. deterministic: 0 or 1. */
MK_C_EXPORT int mk_attention_backward_workspace(int B, int H, int Hkv, int Sq, int Skv, int D, int deterministic,
                                                size_t* out);
MK_C_EXPORT int mk_attention_backward(const void* q, const void* k, const void* v, const void* o, const void* dout,
                          const float* lse, void* dq, void* dk, void* dv, const int64_t* strides, int B, int H,
                          int Hkv, int Sq, int Skv, int D, float scale, int causal, int64_t q_pos0,
                          int64_t kv_pos0, int deterministic, void* workspace, size_t workspace_bytes,
                          void* stream);
/* Packed variable-length sequences (attention.h: cu_seqlens): B = 1, S rows holding n_docs
 * documents as cu_seqlens (device int32 [n_docs + 1]) says; strides and the rest as above; lse
 * [H, S]. */
MK_C_EXPORT int mk_attention_varlen_forward(const void* q, const void* k, const void* v, void* o, float* lse,
                                const int64_t* strides12, const int32_t* cu_seqlens, int n_docs, int H, int Hkv,
                                int S, int D, float scale, int causal, void* stream);
MK_C_EXPORT int mk_attention_varlen_backward_workspace(int H, int Hkv, int S, int D, int n_docs, int deterministic,
                                                       size_t* out);
MK_C_EXPORT int mk_attention_varlen_backward(const void* q, const void* k, const void* v, const void* o,
                                 const void* dout, const float* lse, void* dq, void* dk, void* dv,
                                 const int64_t* strides, const int32_t* cu_seqlens, int n_docs, int H, int Hkv,
                                 int S, int D, float scale, int causal, int deterministic, void* workspace,
                                 size_t workspace_bytes, void* stream);
MK_C_EXPORT int mk_attention_merge_init(float* o_acc, float* lse_acc, int B, int H, int S, int D, void* stream);
MK_C_EXPORT int mk_attention_merge(float* o_acc, float* lse_acc, const void* o_part, const int64_t* part_strides,
                       const float* lse_part, int B, int H, int S, int D, void* stream);
MK_C_EXPORT int mk_attention_merge_finish(const float* o_acc, void* o, const int64_t* o_strides, int B, int H,
                              int S, int D, void* stream);

/* ---- communicator over a caller's key-value store ---- */

/* Collective over the `size` ranks that share `prefix` in the store. device: -2 tunable, -1 local
 * rank % visible GPUs, >= 0 that GPU. ranks_per_node: -1 tunable, else emulated nodes of that many
 * ranks. The callbacks are called from this thread only, during this call and during collective
 * calls on the communicator (operator creation, destroy). erase and why may be null. */
MK_C_EXPORT int mk_comm_create_store(int rank, int size, const char* prefix, void* ctx, mk_store_set_fn set,
                         mk_store_get_fn get, mk_store_erase_fn erase, mk_store_why_fn why, int device,
                         int ranks_per_node, int require_gpu, mk_comm_t* out);
MK_C_EXPORT int mk_comm_info(mk_comm_t comm, mk_comm_info_t* out);
/* The communicator's health: a device wait that gave up, an abort, a proxy error. */
MK_C_EXPORT int mk_comm_check(mk_comm_t comm);
/* Collective: destroys the operators still attached, then the communicator, and frees it. */
MK_C_EXPORT int mk_comm_destroy(mk_comm_t comm);

/* ---- fused GEMM collectives (include/mkernel/ops/fused.h) ---- */

/* kind: 0 ag_gemm, 1 gemm_rs, 2 gemm_ar. Collective. comm_ctas -1: tunable. staging "" or null:
 * tunable. */
MK_C_EXPORT int mk_fused_create(mk_comm_t comm, int kind, int64_t M, int64_t N, int64_t K, int deterministic,
                    int comm_ctas, const char* staging, mk_fused_t* out);
/* As mk_fused_create, on uneven shards (fused.h: PlanShape::rows): shard_rows[nrows] (host memory)
 * each rank's rows, nrows the world size, each >= 1, summing to M; A (ag_gemm) and C (gemm_rs) are
 * then this rank's shard_rows[rank] rows. shard_rows NULL and nrows 0: as mk_fused_create. */
MK_C_EXPORT int mk_fused_create_rows(mk_comm_t comm, int kind, int64_t M, int64_t N, int64_t K,
                                     const int64_t* shard_rows, int nrows, int deterministic, int comm_ctas,
                                     const char* staging, mk_fused_t* out);
/* A, B, C (fused.h: shapes per kind). Enqueues on `stream`; capturable in a CUDA graph. */
MK_C_EXPORT int mk_fused_run(mk_fused_t op, const void* A, const void* B, void* C, void* stream);
/* ag_gemm: the gathered A [M, K] of the last call (valid once it completed on its stream). */
MK_C_EXPORT int mk_fused_gathered_a(mk_fused_t op, const void** out);
/* Copies the gathered A [M, K] of the last call into dst, on `stream` (after that call). */
MK_C_EXPORT int mk_fused_copy_gathered_a(mk_fused_t op, void* dst, void* stream);
MK_C_EXPORT int mk_fused_comm_ctas(mk_fused_t op, int* out);
/* Collective: destroys (idempotent; a no-op after its communicator was destroyed) and frees. */
MK_C_EXPORT int mk_fused_destroy(mk_fused_t op);

/* ---- standalone collectives (include/mkernel/ops/collective.h) ---- */

/* kind: 0 allgather, 1 reduce_scatter, 2 allreduce; dtype: 0 bf16, 1 fp32. count: elements per
 * rank as collective.h defines it (a multiple of 8). chunk_elems 0 and ctas 0: the defaults.
 * staging "" or null: tunable. Collective. */
MK_C_EXPORT int mk_coll_create(mk_comm_t comm, int kind, int dtype, int64_t count, int64_t chunk_elems, int ctas,
                               const char* staging, mk_coll_t* out);
/* src [in_elems] -> dst [out_elems], of the operator's dtype (all-reduce: dst may be src).
 * Enqueues on `stream`; capturable in a CUDA graph. */
MK_C_EXPORT int mk_coll_run(mk_coll_t op, const void* src, void* dst, void* stream);
/* Elements of in and of out per rank. */
MK_C_EXPORT int mk_coll_in_elems(mk_coll_t op, int64_t* out);
MK_C_EXPORT int mk_coll_out_elems(mk_coll_t op, int64_t* out);
/* The operator's input workspace (a zero-copy input), and for all-reduce its output workspace
 * (null for the other kinds): device pointers. */
MK_C_EXPORT int mk_coll_input(mk_coll_t op, void** out);
MK_C_EXPORT int mk_coll_output(mk_coll_t op, void** out);
/* Collective: destroys (idempotent; a no-op after its communicator was destroyed) and frees. */
MK_C_EXPORT int mk_coll_destroy(mk_coll_t op);

/* ---- ring attention (include/mkernel/ops/ring_attention.h) ---- */

/* layout: 0 contiguous, 1 zigzag. Collective. scale 0: 1/sqrt(D). */
MK_C_EXPORT int mk_ring_create(mk_comm_t comm, int B, int H, int Hkv, int D, int64_t S, int layout, int causal,
                   float scale, int comm_ctas, const char* staging, mk_ring_t* out);
/* As mk_ring_create on uneven shards (ring_attention.h: RingAttentionShape::rows): shard_rows[nrows] (host
 * memory) each rank's tokens, nrows the world size, each >= 1 (zigzag >= 2), summing to S; q, k, v, o and lse
 * are then this rank's shard_rows[rank] tokens where S/W says. shard_rows NULL and nrows 0: as mk_ring_create. */
MK_C_EXPORT int mk_ring_create_rows(mk_comm_t comm, int B, int H, int Hkv, int D, int64_t S, int layout, int causal,
                                    float scale, const int64_t* shard_rows, int nrows, int comm_ctas,
                                    const char* staging, mk_ring_t* out);
/* q, o [B, S/W, H, D], k, v [B, S/W, Hkv, D] contiguous; lse [B, H, S/W] fp32 or null. */
MK_C_EXPORT int mk_ring_run(mk_ring_t op, const void* q, const void* k, const void* v, void* o, float* lse,
                void* stream);
/* As mk_ring_run over packed documents (B = 1): cu_seqlens device int32 [n_docs + 1], the documents' bounds in
 * the whole sequence's positions, the same on every rank (RingAttentionArgs::cu_seqlens). */
MK_C_EXPORT int mk_ring_run_packed(mk_ring_t op, const void* q, const void* k, const void* v, void* o, float* lse,
                                   const int32_t* cu_seqlens, int n_docs, void* stream);
MK_C_EXPORT int mk_ring_destroy(mk_ring_t op);
/* Shard rows balancing the ring's work for packed documents (ring_attention.h: ring_balanced_rows):
 * host_cu_seqlens int32 [n_docs + 1] from 0 to S (host memory); host_rows [world] (host) gets the
 * contiguous layout's counts for mk_ring_create_rows. Local (no communicator, no GPU). */
MK_C_EXPORT int mk_ring_balanced_rows(const int32_t* host_cu_seqlens, int n_docs, int world, int causal,
                                      int64_t* host_rows);
/* The backward (RingAttentionBackward): same arguments as mk_ring_create. Collective. */
MK_C_EXPORT int mk_ring_backward_create(mk_comm_t comm, int B, int H, int Hkv, int D, int64_t S, int layout, int causal,
                                        float scale, int comm_ctas, const char* staging, mk_ring_bwd_t* out);
/* The backward on uneven shards: shard_rows, nrows as mk_ring_create_rows's (the forward's). */
MK_C_EXPORT int mk_ring_backward_create_rows(mk_comm_t comm, int B, int H, int Hkv, int D, int64_t S, int layout,
                                             int causal, float scale, const int64_t* shard_rows, int nrows,
                                             int comm_ctas, const char* staging, mk_ring_bwd_t* out);
/* q, o, dout, dq [B, S/W, H, D], k, v, dk, dv [B, S/W, Hkv, D] bf16 contiguous; lse [B, H, S/W] fp32 (the
 * forward's). */
MK_C_EXPORT int mk_ring_backward_run(mk_ring_bwd_t op, const void* q, const void* k, const void* v, const void* o,
                                     const void* dout, const float* lse, void* dq, void* dk, void* dv, void* stream);
/* As mk_ring_backward_run over the forward's packed documents (cu_seqlens, n_docs as mk_ring_run_packed's). */
MK_C_EXPORT int mk_ring_backward_run_packed(mk_ring_bwd_t op, const void* q, const void* k, const void* v,
                                            const void* o, const void* dout, const float* lse, void* dq, void* dk,
                                            void* dv, const int32_t* cu_seqlens, int n_docs, void* stream);
MK_C_EXPORT int mk_ring_backward_destroy(mk_ring_bwd_t op);

/* ---- MoE dispatch and combine (include/mkernel/ops/moe.h) ---- */

/* Collective. mode: 0 auto, 1 throughput, 2 low latency. comm_ctas 0: tunable. recv_capacity 0:
 * the worst case. staging "" or null: tunable. */
MK_C_EXPORT int mk_moe_create(mk_comm_t comm, int64_t hidden, int num_experts, int topk, int64_t max_tokens_per_rank,
                  int expert_align, int64_t recv_capacity, int mode, int comm_ctas, const char* staging,
                  mk_moe_t* out);
/* Rows of recv_x / y (the buffers dispatch fills and combine reads), and the experts of this rank. */
MK_C_EXPORT int mk_moe_recv_rows(mk_moe_t ep, int64_t* out);
MK_C_EXPORT int mk_moe_local_experts(mk_moe_t ep, int* out);
/* x [tokens, H]; topk_ids [tokens, k] int32 (-1: no expert); topk_weights [tokens, k] fp32;
 * d_num_tokens: device int32 (tokens of this call) or null; recv_x [recv_rows, H] expert-major;
 * counts [local experts] int32; offsets [local experts + 1] int32 or null. */
MK_C_EXPORT int mk_moe_dispatch(mk_moe_t ep, const void* x, const int32_t* topk_ids, const float* topk_weights,
                    const int32_t* d_num_tokens, int64_t tokens, void* recv_x, int32_t* counts,
                    int32_t* offsets, void* stream);
/* y [recv_rows, H] in the last dispatch's layout; combined [tokens, H]. */
MK_C_EXPORT int mk_moe_combine(mk_moe_t ep, const void* y, void* combined, void* stream);
/* Sizes of an operator with this config on `world` ranks in `nodes` nodes of `local` ranks, before
 * any communicator (frameworks' shape functions): rows of recv_x / y, and the bytes of one routing
 * (mk_moe_dispatch_routed). mode as mk_moe_create's. */
MK_C_EXPORT int mk_moe_sizes(int world, int nodes, int local, int64_t hidden, int num_experts, int topk,
                             int64_t max_tokens_per_rank, int expert_align, int64_t recv_capacity, int mode,
                             int64_t* host_recv_rows, int64_t* host_routing_bytes);
/* Bytes of one routing of this operator (what mk_moe_sizes says for its config and layout). */
MK_C_EXPORT int mk_moe_routing_bytes(mk_moe_t ep, int64_t* out);
/* mk_moe_dispatch with its routing kept in the caller's device memory `routing` (routing_bytes >=
 * mk_moe_routing_bytes, 16-byte aligned, zeroed before its first dispatch) instead of the
 * operator's: each dispatch in flight keeps its own, for its combine and a backward pass.
 * topk_weights may be null (unit weights, for a combine given none). */
MK_C_EXPORT int mk_moe_dispatch_routed(mk_moe_t ep, const void* x, const int32_t* topk_ids, const float* topk_weights,
                                       const int32_t* d_num_tokens, int64_t tokens, void* recv_x, int32_t* counts,
                                       int32_t* offsets, void* routing, int64_t routing_bytes, void* stream);
/* combine along the routing a mk_moe_dispatch_routed of this operator wrote into `routing`;
 * topk_weights [tokens, k] fp32 this call's weights, or null: the dispatch's. */
MK_C_EXPORT int mk_moe_combine_routed(mk_moe_t ep, const void* y, const float* topk_weights, const void* routing,
                                      int64_t routing_bytes, void* combined, void* stream);
/* After the stream completed: MK_OK, or the first bad input a dispatch or combine met on the device
 * (an expert id out of range, more tokens than max_tokens_per_rank, a receive overflow). */
MK_C_EXPORT int mk_moe_check(mk_moe_t ep);
/* Collective: destroys (idempotent) and frees. */
MK_C_EXPORT int mk_moe_destroy(mk_moe_t ep);

/* ---- The MoE layer (include/mkernel/ops/moe_layer.h) ---- */

/* Collective: dispatch and combine as mk_moe_create's, each local expert's gated MLP of width
 * intermediate (a multiple of 8). */
MK_C_EXPORT int mk_moe_layer_create(mk_comm_t comm, int64_t hidden, int num_experts, int topk,
                                    int64_t max_tokens_per_rank, int expert_align, int64_t recv_capacity,
                                    int64_t intermediate, int mode, int comm_ctas, const char* staging,
                                    mk_moe_layer_t* out);
/* combined [tokens, H] = sum_k topk_weights[t, k] * FFN_{e(t, k)}(x[t]); w1 [E_local, 2I, H] (gate
 * rows, then up rows), w2 [E_local, H, I], bf16; other arguments as mk_moe_dispatch's. */
MK_C_EXPORT int mk_moe_layer_run(mk_moe_layer_t layer, const void* x, const int32_t* topk_ids,
                                 const float* topk_weights, const int32_t* d_num_tokens, int64_t tokens,
                                 const void* w1, const void* w2, void* combined, void* stream);
/* After the stream completed: MK_OK, or the first bad input a call met on the device. */
MK_C_EXPORT int mk_moe_layer_check(mk_moe_layer_t layer);
/* Collective: destroys (idempotent) and frees. */
MK_C_EXPORT int mk_moe_layer_destroy(mk_moe_layer_t layer);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* MKERNEL_C_API_H_ */
