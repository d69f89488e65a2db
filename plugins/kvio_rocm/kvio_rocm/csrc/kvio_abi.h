/* The C ABI of docs/native-abi.md, as the ROCm library exports it.
 *
 * Plain C (no HIP types) so that ctypes, the CPU emulation build and hipcc all read the same
 * declarations. Pointers documented as "device" are device addresses; host_base is an address
 * the GPU may dereference at the same value (hipHostMalloc / torch pinned memory, see
 * kvio_device.h). */
#ifndef KVIO_ROCM_ABI_H
#define KVIO_ROCM_ABI_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVIO_ABI_VERSION 2

#if defined(_WIN32)
#define KVIO_API __declspec(dllexport)
#else
#define KVIO_API __attribute__((visibility("default")))
#endif

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

/* ABI v2: where kernels record an out-of-range device-resident index (docs/native-abi.md).
 * 32 bytes in pinned host memory the kernels store to with plain system-scope stores (value
 * first, then epoch; never an atomic read-modify-write on host memory). Read by Python only
 * after the transfer's stream event has completed. */
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
    kvio_report* report;   /* where a violation is recorded (never NULL in v2) */
    uint64_t epoch;        /* stored into *_epoch on a violation */
} kvio_bounds;

KVIO_API int kvio_abi_version(void);
KVIO_API const char* kvio_error_string(int code);

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

/* optional in the ABI: kvio_write_back_staged's arguments, host pages -> device pool */
KVIO_API int kvio_load_all_staged(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                  int32_t num_layers, void* host_base, kvio_layout layout,
                                  const int64_t* host_idx_cpu, const void* dev_idx,
                                  int dev_idx_64, int64_t n_tokens, void* staging,
                                  int64_t staging_bytes, int use_batched, void* stream,
                                  const kvio_bounds* bounds);

/* optional in the ABI: one asynchronous copy of pinned host bytes to the device */
KVIO_API int kvio_copy_to_device(void* dst, const void* src, int64_t nbytes, void* stream);

KVIO_API int kvio_has_batched_memcpy(void);

#ifdef __cplusplus
}
#endif

#endif /* KVIO_ROCM_ABI_H */
