/* null_kvio.c: the kvio ABI (kvcore/include/kvio_abi.h) with every function doing nothing and
 * succeeding, for scripts/probe_null_device.py: kvcore's own CPU cost on a GPU's submit path,
 * measured with the runtime calls taken out. Built against the header, so a prototype that
 * drifts from the ABI fails to compile. Nothing here moves data. */
#include "kvio_abi.h"
#include <stddef.h>
static int finished_job; /* every job has completed */
/* how many CPU host indices an _inline call takes (their values are not read here) */
static int fits_inline(int64_t n, kvio_layout g) {
    int64_t p = g.page_size;
    return n <= KVIO_INLINE_INDEX_TOKENS ||
           (p > 1 && (p & (p - 1)) == 0 && n % p == 0 && n / p <= KVIO_INLINE_INDEX_PAGES);
}
KVIO_API int kvio_abi_version(void) { return KVIO_ABI_VERSION; }
KVIO_API const char* kvio_error_string(int code) { (void)code; return "null"; }
KVIO_API int kvio_has_batched_memcpy(void) { return 1; }
KVIO_API int kvio_transfer_direct(int a, const uint64_t* b, const uint64_t* c, int32_t d, int32_t e, void* f, kvio_layout g, const void* h, int i, const void* j, int k, int64_t l, void* m, const kvio_bounds* n) { return 0; }
KVIO_API int kvio_transfer_direct_chained(int a, const uint64_t* b, const uint64_t* c, int32_t d, int32_t e, void* f, kvio_layout g, const void* h, int i, const void* j, int k, int64_t l, void* m, const kvio_bounds* n) { return 0; }
KVIO_API int kvio_transfer_direct_inline(int a, const uint64_t* b, const uint64_t* c, int32_t d, int32_t e, void* f, kvio_layout g, const void* h, int i, const void* j, int k, int64_t l, void* m, const kvio_bounds* n) { return fits_inline(l, g) ? 0 : 1; }
KVIO_API int kvio_write_back_staged(const uint64_t* a, const uint64_t* b, int32_t c, void* d, kvio_layout e, const int64_t* f, const void* g, int h, int64_t i, void* j, int64_t k, int l, void* m, const kvio_bounds* n) { return 0; }
KVIO_API int kvio_load_all_staged(const uint64_t* a, const uint64_t* b, int32_t c, void* d, kvio_layout e, const int64_t* f, const void* g, int h, int64_t i, void* j, int64_t k, int l, void* m, const kvio_bounds* n) { return 0; }
KVIO_API int kvio_load_layer_dma(void* a, void* b, int32_t c, void* d, kvio_layout e, const int64_t* f, const int64_t* g, int64_t h, int i, void* j, const kvio_bounds* k) { return 0; }
KVIO_API int kvio_has_layer_signals(void) { return 1; }
KVIO_API int kvio_load_layers_signaled(const uint64_t* a, const uint64_t* b, int32_t c, void* d, kvio_layout e, const void* f, int g, const void* h, int i, int64_t j, uint32_t* k, uint32_t* l, uint32_t m, void* n, const kvio_bounds* o) { return 0; }
KVIO_API int kvio_load_layers_signaled_inline(const uint64_t* a, const uint64_t* b, int32_t c, void* d, kvio_layout e, const void* f, int g, const void* h, int i, int64_t j, uint32_t* k, uint32_t* l, uint32_t m, void* n, const kvio_bounds* o) { return fits_inline(j, e) ? 0 : 1; }
KVIO_API int kvio_wait_layer_signal(const uint32_t* a, uint32_t b, void* c) { return 0; }
KVIO_API int kvio_signaled_layer_group(const uint64_t* a, const uint64_t* b, int32_t c, void* d, kvio_layout e, int64_t f, void* g, int32_t* group) { *group = 4; /* kvio_cuda's group for these shapes */ return 0; }
KVIO_API int kvio_copy_to_device(void* a, const void* b, int64_t c, void* d) { return 0; }
KVIO_API int kvio_write_back_staged_async(const uint64_t* a, const uint64_t* b, int32_t c, void* d, kvio_layout e, const int64_t* f, const void* g, int h, int64_t i, void* j, int64_t k, int l, void* m, void* n, const kvio_bounds* o, void** job) { *job = &finished_job; return 0; }
KVIO_API int kvio_write_back_staged_after(const uint64_t* a, const uint64_t* b, int32_t c, void* d, kvio_layout e, const int64_t* f, const void* g, int h, int64_t i, void* j, int64_t k, int l, void* m, void* n, const kvio_bounds* o, void** job) { *job = &finished_job; return 0; }
KVIO_API int kvio_transfer_direct_after(int a, const uint64_t* b, const uint64_t* c, int32_t d, int32_t e, void* f, kvio_layout g, const void* h, int i, const void* j, int k, int64_t l, int inl, void* m, void* m2, const kvio_bounds* n, void** job) { if (inl && !fits_inline(l, g)) return 1; *job = &finished_job; return 0; }
KVIO_API int kvio_job_status(void* job) { return 0; }
KVIO_API int kvio_job_wait(void* job) { return 0; }
KVIO_API void kvio_job_release(void* job) {}
KVIO_API void kvio_jobs_flush(void) {}
