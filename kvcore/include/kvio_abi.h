/* kvio_abi.h: the C ABI a native kvcore backend library exports (docs/native-abi.md).
 *
 * The one copy of the ABI's structs and prototypes: kvio_cuda and kvio_rocm build against it,
 * and so can a third-party library (kvcore.native_abi.INCLUDE_DIR is the folder to pass with
 * -I). kvcore's ctypes mirror (kvcore/native_abi.py) is checked against it by
 * tests/core/test_abi_header.py. Plain C (C99 and up, or C++), no GPU runtime types.
 *
 * Every function returns 0 on success, else the runtime's error code. Pointers documented as
 * device addresses are the GPU's; host_base and the report are addresses the GPU may
 * dereference at the same value (pinned memory from torch's allocator). */
#ifndef KVIO_ABI_H
#define KVIO_ABI_H

#include <stdint.h>

#define KVIO_ABI_VERSION 4

/* A library may define KVIO_API before including this header (kvio_cuda: with extern "C",
 * so that a definition that does not match its prototype fails to compile). */
#ifndef KVIO_API
#if defined(_WIN32)
#define KVIO_API __declspec(dllexport)
#else
#define KVIO_API __attribute__((visibility("default")))
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The host buffer's geometry: byte strides and sizes, passed by value. */
typedef struct kvio_layout {
    int64_t kv_stride;    /* bytes */
    int64_t layer_stride; /* bytes */
    int64_t page_stride;  /* bytes */
    int64_t token_stride; /* bytes, between tokens of one page */
    int64_t chunk_stride; /* bytes, between chunks of one element (page_head: heads) */
    int64_t page_size;    /* tokens per page */
    int64_t chunk_bytes;  /* contiguous bytes of one chunk */
    int64_t num_chunks;   /* chunks per element */
} kvio_layout;

/* Where kernels record an out-of-range device-resident index: 32 bytes in pinned host memory
 * the kernels store to with plain system-scope stores (value first, then epoch; never an
 * atomic read-modify-write on host memory). Read by Python only after the transfer's stream
 * work has completed. */
typedef struct kvio_report {
    uint64_t host_epoch;   /* set to bounds->epoch on a bad host index */
    int64_t host_value;    /* one bad host index value */
    uint64_t device_epoch; /* set to bounds->epoch on a bad device index */
    int64_t device_value;  /* one bad device index value */
} kvio_report;

/* Passed by pointer; read during the call only (its values travel in the kernel arguments). */
typedef struct kvio_bounds {
    int64_t host_tokens;   /* valid host indices are [0, host_tokens) */
    int64_t device_tokens; /* valid device indices are [0, device_tokens) */
    kvio_report* report;   /* where a violation is recorded (never NULL) */
    uint64_t epoch;        /* stored into *_epoch on a violation */
} kvio_bounds;

#ifdef __cplusplus
static_assert(sizeof(kvio_layout) == 64, "kvio_layout must be 8 int64 fields");
static_assert(sizeof(kvio_report) == 32, "kvio_report must be 32 bytes");
static_assert(sizeof(kvio_bounds) == 32, "kvio_bounds must be 32 bytes");
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
_Static_assert(sizeof(kvio_layout) == 64, "kvio_layout must be 8 int64 fields");
_Static_assert(sizeof(kvio_report) == 32, "kvio_report must be 32 bytes");
_Static_assert(sizeof(kvio_bounds) == 32, "kvio_bounds must be 32 bytes");
#endif

/* ---- required ------------------------------------------------------------------------- */

KVIO_API int kvio_abi_version(void);
KVIO_API const char* kvio_error_string(int code);
KVIO_API int kvio_has_batched_memcpy(void);

KVIO_API int kvio_transfer_direct(int direction, const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                  int32_t layer_begin, int32_t layer_count, void* host_base,
                                  kvio_layout layout, const void* host_idx, int host_idx_64,
                                  const void* dev_idx, int dev_idx_64, int64_t n_tokens,
                                  void* stream, const kvio_bounds* bounds);

KVIO_API int kvio_write_back_staged(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                    int32_t num_layers, void* host_base, kvio_layout layout,
                                    const int64_t* host_idx_cpu, const void* dev_idx,
                                    int dev_idx_64, int64_t n_tokens, void* staging,
                                    int64_t staging_bytes, int use_batched, void* stream,
                                    const kvio_bounds* bounds);

/* ---- optional (kvcore looks each one up and does without it) -------------------------- */

KVIO_API int kvio_transfer_direct_chained(int direction, const uint64_t* k_ptrs,
                                          const uint64_t* v_ptrs, int32_t layer_begin,
                                          int32_t layer_count, void* host_base,
                                          kvio_layout layout, const void* host_idx,
                                          int host_idx_64, const void* dev_idx, int dev_idx_64,
                                          int64_t n_tokens, void* stream,
                                          const kvio_bounds* bounds);

KVIO_API int kvio_load_all_staged(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                  int32_t num_layers, void* host_base, kvio_layout layout,
                                  const int64_t* host_idx_cpu, const void* dev_idx,
                                  int dev_idx_64, int64_t n_tokens, void* staging,
                                  int64_t staging_bytes, int use_batched, void* stream,
                                  const kvio_bounds* bounds);

KVIO_API int kvio_load_layer_dma(void* k_dst, void* v_dst, int32_t layer, void* host_base,
                                 kvio_layout layout, const int64_t* host_idx_cpu,
                                 const int64_t* dev_idx_cpu, int64_t n_tokens, int use_batched,
                                 void* stream, const kvio_bounds* bounds);

KVIO_API int kvio_has_layer_signals(void);
KVIO_API int kvio_load_layers_signaled(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                       int32_t num_layers, void* host_base, kvio_layout layout,
                                       const void* host_idx, int host_idx_64,
                                       const void* dev_idx, int dev_idx_64, int64_t n_tokens,
                                       uint32_t* counters, uint32_t* flags, uint32_t epoch,
                                       void* stream, const kvio_bounds* bounds);
/* kvio_load_layers_signaled_inline and kvio_transfer_direct_inline (optional): the calls
 * without _inline, whose host_idx is CPU memory, read during the call (an index outside
 * [0, bounds->host_tokens) is refused before anything is enqueued) and carried in the launch
 * itself, so nothing uploads it and the caller may reuse it at once. A library that exports
 * one takes any n_tokens up to KVIO_INLINE_INDEX_TOKENS, and more where host_idx holds at
 * most KVIO_INLINE_INDEX_PAGES whole pages of layout.page_size, a power of two (each run of
 * page_size indices counts up by one from a multiple of page_size). It may refuse a call
 * whose work moves 2^31 bytes or more in one grid (n_tokens times the bytes of a token's
 * element, times 2 with V, times layer_count for kvio_transfer_direct_inline). A refused
 * call returns an error and enqueues nothing.
 * kvio_transfer_direct_inline never reads the host before the previous kernel of the stream
 * completed (the guarantee kvio_transfer_direct_chained may use is not used). */
#define KVIO_INLINE_INDEX_TOKENS 960
#define KVIO_INLINE_INDEX_PAGES 960
KVIO_API int kvio_transfer_direct_inline(int direction, const uint64_t* k_ptrs,
                                         const uint64_t* v_ptrs, int32_t layer_begin,
                                         int32_t layer_count, void* host_base,
                                         kvio_layout layout, const void* host_idx,
                                         int host_idx_64, const void* dev_idx, int dev_idx_64,
                                         int64_t n_tokens, void* stream,
                                         const kvio_bounds* bounds);
KVIO_API int kvio_load_layers_signaled_inline(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                              int32_t num_layers, void* host_base,
                                              kvio_layout layout, const void* host_idx,
                                              int host_idx_64, const void* dev_idx,
                                              int dev_idx_64, int64_t n_tokens,
                                              uint32_t* counters, uint32_t* flags,
                                              uint32_t epoch, void* stream,
                                              const kvio_bounds* bounds);
KVIO_API int kvio_wait_layer_signal(const uint32_t* flag, uint32_t epoch, void* stream);
KVIO_API int kvio_signaled_layer_group(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                       int32_t num_layers, void* host_base, kvio_layout layout,
                                       int64_t n_tokens, void* stream, int32_t* group);

KVIO_API int kvio_copy_to_device(void* dst, const void* src, int64_t nbytes, void* stream);

/* Asynchronous staged write-back: checks its arguments as kvio_write_back_staged does (same
 * codes), keeps what it needs of the host indices (each page's first; the caller's array is
 * free again at return), records on after_stream the point the transfer follows
 * (nothing when it is `stream`; NULL is the legacy default stream, as everywhere in this
 * ABI), and hands the transfer to a library thread, which issues it on `stream`.
 * *job receives a handle for kvio_job_status / kvio_job_wait (KVIO_JOB_PENDING, 0 once all
 * its work completed, else the error that failed it) and must be given back with
 * kvio_job_release. kvio_jobs_flush blocks until every job handed over was issued. */
#define KVIO_JOB_PENDING (-1)
KVIO_API int kvio_write_back_staged_async(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                          int32_t num_layers, void* host_base,
                                          kvio_layout layout, const int64_t* host_idx_cpu,
                                          const void* dev_idx, int dev_idx_64,
                                          int64_t n_tokens, void* staging,
                                          int64_t staging_bytes, int use_batched, void* stream,
                                          void* after_stream, const kvio_bounds* bounds,
                                          void** job);
/* kvio_write_back_staged_after (optional, with the job functions): the same call as
 * kvio_write_back_staged_async, issued by the calling thread before it returns. A write-back
 * below the pipelining size that fits half the staging buffer gathers on `stream` into the
 * half the previous one did not use and copies to the host on a copy stream of the staging
 * buffer's own, so consecutive write-backs overlap; the job completes after that copy.
 * Every later staged transfer through the same buffer waits for it first (not one captured
 * into a graph: docs/native-abi.md). While the library's thread has a write-back through the
 * same buffer waiting or is issuing one, this one goes to the thread too (as with
 * kvio_write_back_staged_async), rather than waiting for that issue. */
KVIO_API int kvio_write_back_staged_after(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                          int32_t num_layers, void* host_base,
                                          kvio_layout layout, const int64_t* host_idx_cpu,
                                          const void* dev_idx, int dev_idx_64,
                                          int64_t n_tokens, void* staging,
                                          int64_t staging_bytes, int use_batched, void* stream,
                                          void* after_stream, const kvio_bounds* bounds,
                                          void** job);
/* kvio_transfer_direct_after (optional, with kvio_job_status, _wait and _release):
 * kvio_transfer_direct's transfer of every layer given, issued on `stream` after the work
 * enqueued on after_stream so far (recorded as for kvio_write_back_staged_after; nothing when
 * it is `stream`), with a job, as *job of kvio_write_back_staged_async, that completes after
 * the kernel. host_inline 1: host_idx is CPU memory, read during the call and carried in the
 * launch as by kvio_transfer_direct_inline (its limits); 0: device memory, as
 * kvio_transfer_direct. Its checks and codes are those calls'; a refused call hands out no
 * job and enqueues nothing; one that moves nothing hands out a job already finished. */
KVIO_API int kvio_transfer_direct_after(int direction, const uint64_t* k_ptrs,
                                        const uint64_t* v_ptrs, int32_t layer_begin,
                                        int32_t layer_count, void* host_base, kvio_layout layout,
                                        const void* host_idx, int host_idx_64,
                                        const void* dev_idx, int dev_idx_64, int64_t n_tokens,
                                        int host_inline, void* stream, void* after_stream,
                                        const kvio_bounds* bounds, void** job);
KVIO_API int kvio_job_status(void* job);
KVIO_API int kvio_job_wait(void* job);
KVIO_API void kvio_job_release(void* job);
KVIO_API void kvio_jobs_flush(void);

#ifdef __cplusplus
}
#endif

#endif /* KVIO_ABI_H */
