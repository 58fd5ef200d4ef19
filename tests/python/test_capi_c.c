/* The C ABI from C (include/mkernel/c_api.h compiled as C99, linked against libmkernel_capi.so):
 * the version, and the errors of calls that need no GPU — null handles and arguments, an unknown
 * tunable, a store that reports a value of 2^62 bytes, a store failure whose reason fills the
 * whole buffer unterminated — each with its code and a message naming the function (the lying
 * store once ended the process with std::bad_alloc escaping the C ABI). ctest: capi_c (label capi). */
#include <stdio.h>
#include <string.h>

#include "mkernel/c_api.h"

static int failures = 0;
#define EXPECT(cond, ...)                          \
  do {                                             \
    if (!(cond)) {                                 \
      fprintf(stderr, "FAILED: %s: ", #cond);      \
      fprintf(stderr, __VA_ARGS__);                \
      fprintf(stderr, "\n");                       \
      ++failures;                                  \
    }                                              \
  } while (0)

/* A call that must fail with `code` and a message containing `word`. */
static void expect_error(int rc, int code, const char* word, const char* what) {
  const char* msg = mk_last_error();
  EXPECT(rc == code, "%s returned %d, expected %d (%s)", what, rc, code, msg);
  EXPECT(msg != NULL && strstr(msg, word) != NULL, "%s: message '%s' lacks '%s'", what, msg ? msg : "(null)", word);
}

/* A store that fails nothing and holds, under every key, a value it says is 2^62 bytes long. */
static int lying_set(void* ctx, const char* key, const void* data, size_t len) {
  (void)ctx, (void)key, (void)data, (void)len;
  return 0;
}
static int lying_get(void* ctx, const char* key, void* buf, size_t cap, size_t* len, int* found) {
  (void)ctx, (void)key;
  memset(buf, 0x5a, cap);
  *len = (size_t)1 << 62;
  *found = 1;
  return 0;
}
/* A store that fails every set, and says why with more than the buffer holds, unterminated. */
static int failing_set(void* ctx, const char* key, const void* data, size_t len) {
  (void)ctx, (void)key, (void)data, (void)len;
  return 1;
}
static int long_why(void* ctx, char* buf, size_t cap) {
  (void)ctx;
  memset(buf, 'w', cap);
  return 0;
}

int main(void) {
  mk_comm_info_t info;
  mk_comm_t comm = NULL;
  mk_fused_t fused = NULL;
  mk_ring_t ring = NULL;
  mk_ring_bwd_t ring_bwd = NULL;
  mk_moe_t moe = NULL;
  mk_coll_t coll = NULL;
  int64_t rows = 0;

  EXPECT(mk_api_version() == MK_C_API_VERSION, "library version %d, header %d", mk_api_version(), MK_C_API_VERSION);
  EXPECT(sizeof(mk_comm_info_t) == 7 * sizeof(int), "mk_comm_info_t is %zu bytes", sizeof(mk_comm_info_t));

  expect_error(mk_comm_info(NULL, &info), MK_INVALID_ARGUMENT, "mk_comm_info", "mk_comm_info(NULL)");
  expect_error(mk_comm_check(NULL), MK_INVALID_ARGUMENT, "mk_comm_check", "mk_comm_check(NULL)");
  expect_error(mk_comm_create_store(0, 1, "p", NULL, NULL, NULL, NULL, NULL, -1, -1, 0, &comm), MK_INVALID_ARGUMENT,
               "mk_comm_create_store", "mk_comm_create_store without callbacks");
  EXPECT(comm == NULL, "a failed create left a handle");
  expect_error(mk_fused_create(NULL, 1, 128, 128, 128, 0, -1, "", &fused), MK_INVALID_ARGUMENT, "mk_fused_create",
               "mk_fused_create(NULL)");
  expect_error(mk_fused_run(NULL, NULL, NULL, NULL, NULL), MK_INVALID_ARGUMENT, "mk_fused_run", "mk_fused_run(NULL)");
  {
    const int64_t rows[2] = {100, 28};
    expect_error(mk_fused_create_rows(NULL, 1, 128, 128, 128, rows, 2, 0, -1, "", &fused), MK_INVALID_ARGUMENT,
                 "mk_fused_create", "mk_fused_create_rows(NULL)");
  }
  expect_error(mk_ring_create(NULL, 1, 8, 8, 128, 1024, 1, 1, 0.f, -1, NULL, &ring), MK_INVALID_ARGUMENT,
               "mk_ring_create", "mk_ring_create(NULL)");
  expect_error(mk_ring_backward_create(NULL, 1, 8, 8, 128, 1024, 1, 1, 0.f, -1, NULL, &ring_bwd), MK_INVALID_ARGUMENT,
               "mk_ring_backward_create", "mk_ring_backward_create(NULL)");
  {
    const int64_t rows[2] = {500, 524};
    expect_error(mk_ring_create_rows(NULL, 1, 8, 8, 128, 1024, 1, 1, 0.f, rows, 2, -1, NULL, &ring),
                 MK_INVALID_ARGUMENT, "mk_ring_create", "mk_ring_create_rows(NULL)");
    expect_error(mk_ring_backward_create_rows(NULL, 1, 8, 8, 128, 1024, 1, 1, 0.f, rows, 2, -1, NULL, &ring_bwd),
                 MK_INVALID_ARGUMENT, "mk_ring_backward_create", "mk_ring_backward_create_rows(NULL)");
  }
  {  /* balanced shard rows: host only, no GPU */
    const int32_t cu[3] = {0, 2, 8};
    int64_t got[2] = {0, 0};
    EXPECT(mk_ring_balanced_rows(cu, 2, 2, 0, got) == MK_OK && got[0] + got[1] == 8 && got[0] >= 1 && got[1] >= 1,
           "mk_ring_balanced_rows: two shards of 8 tokens");
    /* non-causal: work 2, 2, then 6 x 6; the least largest share is 22: 2 + 2 + 6 + 6 + 6 | 6 + 6 + 6 */
    EXPECT(got[0] == 5 && got[1] == 3, "mk_ring_balanced_rows: the least largest share");
    expect_error(mk_ring_balanced_rows(cu, 2, 9, 0, got), MK_INVALID_ARGUMENT, "8 tokens for 9 ranks",
                 "mk_ring_balanced_rows(8 tokens, 9 ranks)");
    expect_error(mk_ring_balanced_rows(NULL, 2, 2, 0, got), MK_INVALID_ARGUMENT, "ring_balanced_rows",
                 "mk_ring_balanced_rows(NULL)");
  }
  EXPECT(ring_bwd == NULL, "a failed create left a handle");
  expect_error(mk_ring_backward_run(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL),
               MK_INVALID_ARGUMENT, "mk_ring_backward_run", "mk_ring_backward_run(NULL)");
  expect_error(mk_moe_create(NULL, 1024, 8, 2, 128, 1, 0, 0, 0, NULL, &moe), MK_INVALID_ARGUMENT, "mk_moe_create",
               "mk_moe_create(NULL)");
  expect_error(mk_moe_recv_rows(NULL, &rows), MK_INVALID_ARGUMENT, "mk_moe_recv_rows", "mk_moe_recv_rows(NULL)");
  expect_error(mk_moe_dispatch(NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL, NULL, NULL), MK_INVALID_ARGUMENT,
               "mk_moe_dispatch", "mk_moe_dispatch(NULL)");
  expect_error(mk_coll_create(NULL, 2, 0, 64, 0, 0, "", &coll), MK_INVALID_ARGUMENT, "mk_coll_create",
               "mk_coll_create(NULL)");
  expect_error(mk_coll_run(NULL, NULL, NULL, NULL), MK_INVALID_ARGUMENT, "mk_coll_run", "mk_coll_run(NULL)");
  expect_error(mk_coll_in_elems(NULL, &rows), MK_INVALID_ARGUMENT, "mk_coll_in_elems", "mk_coll_in_elems(NULL)");
  EXPECT(coll == NULL, "a failed create left a handle");
  expect_error(mk_tunable_set("no_such_setting", "1"), MK_INVALID_ARGUMENT, "no_such_setting", "an unknown tunable");
  /* Sizes from the store are checked before anything of that size is allocated. Two ranks: the
   * bootstrap reads the peer's key (a world of one reads nothing). */
  expect_error(mk_comm_create_store(0, 2, "lie", NULL, lying_set, lying_get, NULL, NULL, -1, -1, 0, &comm),
               MK_MISMATCH, "4611686018427387904 bytes", "a store value of 2^62 bytes");
  EXPECT(comm == NULL, "a failed create left a handle");
  /* The reason is cut at the buffer's last byte and terminated there. */
  expect_error(mk_comm_create_store(0, 1, "why", NULL, failing_set, lying_get, NULL, long_why, -1, -1, 0, &comm),
               MK_SYSTEM_ERROR, "failed: wwww", "a failing store with a long reason");
  EXPECT(strlen(mk_last_error()) < 1024, "the reason was not cut: %zu characters", strlen(mk_last_error()));
  EXPECT(comm == NULL, "a failed create left a handle");
  /* Destroying nothing is a no-op. */
  EXPECT(mk_comm_destroy(NULL) == MK_OK && mk_fused_destroy(NULL) == MK_OK && mk_ring_destroy(NULL) == MK_OK &&
             mk_ring_backward_destroy(NULL) == MK_OK && mk_moe_destroy(NULL) == MK_OK && mk_coll_destroy(NULL) == MK_OK,
         "destroy(NULL) failed");
  if (failures == 0) printf("capi_c: ok (C ABI version %d)\n", mk_api_version());
  return failures == 0 ? 0 : 1;
}
