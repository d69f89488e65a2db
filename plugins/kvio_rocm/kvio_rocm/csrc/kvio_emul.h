// CPU emulation of the few HIP runtime calls kvio_rocm.hip makes (tests only).
//
// kvio_rocm.hip compiled with -DKVIO_EMULATE as plain C++ becomes a shared library with the
// same C ABI whose "device" is the CPU: device and host pointers are ordinary addresses, a
// kernel launch runs every work-item of every workgroup in turn, memcpys are memcpy. That lets
// tests on a machine without a GPU exercise the launcher and the kernel index math against the
// reference, through the real ctypes binding. Counters and an error injector are exported for
// the tests (kvio_emul_*). Nothing here is built into the real library.
#ifndef KVIO_ROCM_EMUL_H
#define KVIO_ROCM_EMUL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KVIO_API_EMUL __attribute__((visibility("default")))
// Split launches at 32768 work-items (1 << 30 on a GPU) so small tests cover the split.
#define KVIO_MAX_ITEMS_PER_LAUNCH (1u << 15)

typedef enum hipError_t {
    hipSuccess = 0,
    hipErrorInvalidValue = 1,
    hipErrorOutOfMemory = 2,
    hipErrorInvalidDevice = 101,
    hipErrorInvalidDeviceFunction = 98,
    hipErrorNotSupported = 801,
    hipErrorLaunchFailure = 719,
    hipErrorUnknown = 999,
} hipError_t;

typedef struct ihipStream_t* hipStream_t;

typedef enum hipMemcpyKind {
    hipMemcpyHostToHost = 0,
    hipMemcpyHostToDevice = 1,
    hipMemcpyDeviceToHost = 2,
    hipMemcpyDeviceToDevice = 3,
    hipMemcpyDefault = 4,
} hipMemcpyKind;

typedef enum hipDeviceAttribute_t {
    hipDeviceAttributeMultiprocessorCount = 63,
} hipDeviceAttribute_t;

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

thread_local unsigned kvio_emul_workitem_x;
thread_local unsigned kvio_emul_workgroup_x;

// Counters: [0] kernel launches, [1] work-items run, [2] hipMemcpyAsync calls,
// [3] hipMemcpyBatchAsync calls, [4] copies inside batches, [5] bytes copied by memcpys.
static int64_t kvio_emul_count[6];
// Error injection: the next call of kind [0] kernel launch, [1] hipMemcpyAsync,
// [2] hipMemcpyBatchAsync fails with this code (once).
static int kvio_emul_fail_code[3];
static int kvio_emul_sticky_error = 0; // what hipGetLastError returns

extern "C" KVIO_API_EMUL void kvio_emul_reset(void) {
    memset(kvio_emul_count, 0, sizeof kvio_emul_count);
    memset(kvio_emul_fail_code, 0, sizeof kvio_emul_fail_code);
    kvio_emul_sticky_error = 0;
}
extern "C" KVIO_API_EMUL void kvio_emul_counters(int64_t* out) {
    memcpy(out, kvio_emul_count, sizeof kvio_emul_count);
}
extern "C" KVIO_API_EMUL void kvio_emul_fail_next(int which, int code) {
    if (which >= 0 && which < 3) kvio_emul_fail_code[which] = code;
}

static int kvio_emul_take_failure(int which) {
    const int c = kvio_emul_fail_code[which];
    kvio_emul_fail_code[which] = 0;
    return c;
}

extern "C" KVIO_API_EMUL const char* hipGetErrorString(hipError_t e) {
    switch (e) {
    case hipSuccess: return "no error";
    case hipErrorInvalidValue: return "invalid argument";
    case hipErrorOutOfMemory: return "out of memory";
    case hipErrorInvalidDevice: return "invalid device ordinal";
    case hipErrorInvalidDeviceFunction: return "invalid device function";
    case hipErrorNotSupported: return "operation not supported";
    case hipErrorLaunchFailure: return "unspecified launch failure";
    default: return "unknown error";
    }
}

extern "C" KVIO_API_EMUL hipError_t hipGetLastError(void) {
    const int e = kvio_emul_sticky_error;
    kvio_emul_sticky_error = 0;
    return (hipError_t)e;
}

extern "C" KVIO_API_EMUL hipError_t hipGetDevice(int* dev) {
    *dev = 0;
    return hipSuccess;
}

extern "C" KVIO_API_EMUL hipError_t hipDeviceGetAttribute(int* v, hipDeviceAttribute_t a, int) {
    if (a != hipDeviceAttributeMultiprocessorCount) return hipErrorInvalidValue;
    *v = 1; // one "CU" (8 workgroups at most): launches become grid-stride loops
    return hipSuccess;
}

extern "C" KVIO_API_EMUL hipError_t hipMemcpyAsync(void* dst, const void* src, size_t n,
                                                  hipMemcpyKind, hipStream_t) {
    if (const int f = kvio_emul_take_failure(1)) return (hipError_t)f;
    memmove(dst, src, n);
    kvio_emul_count[2] += 1;
    kvio_emul_count[5] += (int64_t)n;
    return hipSuccess;
}

// Same shape as ROCm 7.1's hipMemcpyBatchAsync; the library finds it with dladdr + dlsym just
// as it finds the real one in libamdhip64.
extern "C" KVIO_API_EMUL hipError_t hipMemcpyBatchAsync(void** dsts, void** srcs, size_t* sizes,
                                                       size_t count, void* attrs,
                                                       size_t* attrs_idxs, size_t num_attrs,
                                                       size_t* fail_idx, hipStream_t) {
    (void)attrs_idxs;
    if (const int f = kvio_emul_take_failure(2)) {
        if (fail_idx) *fail_idx = 0;
        return (hipError_t)f;
    }
    if (!dsts || !srcs || !sizes || count == 0) return hipErrorInvalidValue;
    if ((attrs && num_attrs == 0) || (!attrs && num_attrs != 0)) return hipErrorInvalidValue;
    kvio_emul_count[3] += 1;
    for (size_t i = 0; i < count; ++i) {
        memmove(dsts[i], srcs[i], sizes[i]);
        kvio_emul_count[4] += 1;
        kvio_emul_count[5] += (int64_t)sizes[i];
    }
    return hipSuccess;
}

#include "kvio_device.h" // the kernels, compiled as CPU functions

extern "C" KVIO_API_EMUL hipError_t hipLaunchKernel(const void* f, dim3 grid, dim3 block,
                                                   void** args, size_t, hipStream_t) {
    if (const int c = kvio_emul_take_failure(0)) {
        kvio_emul_sticky_error = c; // launch errors surface through hipGetLastError
        return hipSuccess;
    }
    // Every kernel of kvio_device.h takes one kvio_copy_params by value.
    typedef void (*kernel_t)(kvio_copy_params);
    const kernel_t k = reinterpret_cast<kernel_t>(const_cast<void*>(f));
    kvio_emul_count[0] += 1;
    for (unsigned b = 0; b < grid.x; ++b) {
        for (unsigned t = 0; t < block.x; ++t) {
            kvio_emul_workgroup_x = b;
            kvio_emul_workitem_x = t;
            k(*static_cast<kvio_copy_params*>(args[0]));
            kvio_emul_count[1] += 1;
        }
    }
    return hipSuccess;
}

#endif // KVIO_ROCM_EMUL_H
