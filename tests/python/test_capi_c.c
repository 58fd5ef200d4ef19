/* The C ABI from C (include/mkernel/c_api.h compiled as C99, linked against libmkernel_capi.so):
 * the version, and the errors of calls that need no GPU — null handles and arguments, an unknown
 * tunable — each with its code and a message naming the function. ctest: capi_c (label capi). */
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

int main(void) {
  mk_comm_info_t info;
  mk_comm_t comm = NULL;
  mk_fused_t fused = NULL;
  mk_ring_t ring = NULL;
  mk_moe_t moe = NULL;
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
  expect_error(mk_ring_create(NULL, 1, 8, 8, 128, 1024, 1, 1, 0.f, -1, NULL, &ring), MK_INVALID_ARGUMENT,
               "mk_ring_create", "mk_ring_create(NULL)");
  expect_error(mk_moe_create(NULL, 1024, 8, 2, 128, 1, 0, 0, 0, NULL, &moe), MK_INVALID_ARGUMENT, "mk_moe_create",
               "mk_moe_create(NULL)");
  expect_error(mk_moe_recv_rows(NULL, &rows), MK_INVALID_ARGUMENT, "mk_moe_recv_rows", "mk_moe_recv_rows(NULL)");
  expect_error(mk_moe_dispatch(NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL, NULL, NULL), MK_INVALID_ARGUMENT,
               "mk_moe_dispatch", "mk_moe_dispatch(NULL)");
  expect_error(mk_tunable_set("no_such_setting", "1"), MK_INVALID_ARGUMENT, "no_such_setting", "an unknown tunable");
  /* Destroying nothing is a no-op. */
  EXPECT(mk_comm_destroy(NULL) == MK_OK && mk_fused_destroy(NULL) == MK_OK && mk_ring_destroy(NULL) == MK_OK &&
             mk_moe_destroy(NULL) == MK_OK,
         "destroy(NULL) failed");
  if (failures == 0) printf("capi_c: ok (C ABI version %d)\n", mk_api_version());
  return failures == 0 ? 0 : 1;
}
