// A stand-in for ROCm's <hip/hip_runtime.h>, declaring only what kvio_rocm.hip uses, with the
// same names and signatures (ROCm 7.1's hip_runtime_api.h). It lets tests compile the host
// side in real HIP mode (clang -x hip, host and device passes) on a machine without ROCm.
// Nothing here is linked or run.
#pragma once
#include <stddef.h>
#include <stdint.h>

#define __host__ __attribute__((host))
#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __shared__ __attribute__((shared))

#define HIP_VERSION_MAJOR 7
#define HIP_VERSION_MINOR 1
#define HIP_VERSION_PATCH 0
#define HIP_VERSION (HIP_VERSION_MAJOR * 10000000 + HIP_VERSION_MINOR * 100000 + HIP_VERSION_PATCH)

typedef enum hipError_t {
    hipSuccess = 0,
    hipErrorInvalidValue = 1,
    hipErrorInvalidDevice = 101,
    hipErrorNotSupported = 801,
} hipError_t;
typedef struct ihipStream_t* hipStream_t;
typedef enum hipMemcpyKind {
    hipMemcpyHostToHost = 0,
    hipMemcpyHostToDevice = 1,
    hipMemcpyDeviceToHost = 2,
    hipMemcpyDeviceToDevice = 3,
    hipMemcpyDefault = 4,
} hipMemcpyKind;
typedef enum hipDeviceAttribute_t { hipDeviceAttributeMultiprocessorCount = 63 } hipDeviceAttribute_t;
struct dim3 {
    uint32_t x, y, z;
    __host__ __device__ constexpr dim3(uint32_t x_ = 1, uint32_t y_ = 1, uint32_t z_ = 1)
        : x(x_), y(y_), z(z_) {}
};
typedef enum hipMemcpySrcAccessOrder { hipMemcpySrcAccessOrderStream = 1 } hipMemcpySrcAccessOrder;
typedef struct hipMemLocation { int type; int id; } hipMemLocation;
typedef struct hipMemcpyAttributes {
    hipMemcpySrcAccessOrder srcAccessOrder;
    hipMemLocation srcLocHint;
    hipMemLocation dstLocHint;
    unsigned int flags;
} hipMemcpyAttributes;

extern "C" {
hipError_t hipGetDevice(int* deviceId);
hipError_t hipDeviceGetAttribute(int* pi, hipDeviceAttribute_t attr, int deviceId);
hipError_t hipLaunchKernel(const void* function_address, dim3 numBlocks, dim3 dimBlocks,
                           void** args, size_t sharedMemBytes, hipStream_t stream);
hipError_t hipGetLastError(void);
const char* hipGetErrorString(hipError_t hipError);
hipError_t hipMemcpyAsync(void* dst, const void* src, size_t sizeBytes, hipMemcpyKind kind,
                          hipStream_t stream);
hipError_t hipMemcpyBatchAsync(void** dsts, void** srcs, size_t* sizes, size_t count,
                               hipMemcpyAttributes* attrs, size_t* attrsIdxs, size_t numAttrs,
                               size_t* failIdx, hipStream_t stream);
}
