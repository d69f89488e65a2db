// A per-layer load from page_first by the SMs and the copy engine at once (no kvcore).
//
// The SM kernels that read pinned host memory stop at 0.89-0.92 of the copy engine's rate
// (h200-2026-12-04e, h200-2026-12-05c); the copy engine alone moves page_first's per-layer
// pieces (2 KiB rows, one per token, 64 KiB apart) at 0.45 (h200-2026-12-05c, probe_2d). Does
// the link carry more when both read at once: the SMs the first layers, the copy engine the
// last ones as 2D copies? Each case moves every layer of 16 pages (32 layers, K and V, 8 x
// 128 bf16: 128 MiB), timed with events around both streams, median of 7 after one warm-up,
// as a ratio to one contiguous copy of the same bytes.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o probe scripts/probe_hybrid_load.cu && ./probe

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "probe_check.h"
#include "probe_timing.h"

constexpr int kLayers = 32, kTokens = 16 * 64, kRow = 2048;  // bytes of one layer of a token
constexpr int kThreads = 256, kUnroll = 4;

// Copies layers [0, layers) of every token, K and V: host (kv, token, layer, row) to device
// (layer, kv, token, row); one 16-byte vector per thread per step, kUnroll loads in flight.
__global__ void __launch_bounds__(kThreads) sm_copy(const int4* __restrict__ host,
                                                    int4* __restrict__ dev, int layers) {
    constexpr int kVec = kRow / 16;
    const int64_t per_layer = int64_t(2) * kTokens * kVec;  // vectors of one layer
    const int64_t total = per_layer * layers;
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    for (int64_t base = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; base < total;
         base += stride * kUnroll) {
        int4 v[kUnroll];
        int64_t dst[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t i = base + u * stride;
            dst[u] = -1;
            if (i < total) {
                const int64_t layer = i / per_layer, rest = i % per_layer;
                const int64_t kv = rest / (int64_t(kTokens) * kVec);
                const int64_t tok = (rest / kVec) % kTokens, e = rest % kVec;
                v[u] = host[((kv * kTokens + tok) * kLayers + layer) * kVec + e];
                dst[u] = i;
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            if (dst[u] >= 0) dev[dst[u]] = v[u];
        }
    }
}

int main() {
    CK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const size_t bytes = size_t(2) * kTokens * kLayers * kRow;
    char *host = nullptr, *dev = nullptr;
    CK(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
    CK(cudaMalloc(&dev, bytes));
    for (size_t i = 0; i < bytes; i += 4096) host[i] = char(i >> 12);
    cudaStream_t s, ce;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&ce, cudaStreamNonBlocking));
    cudaEvent_t fork, join;
    CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
    std::printf("%s, %d SMs\n\n", prop.name, prop.multiProcessorCount);

    auto timed = [&](auto&& fn) { return event_median_ms(s, fn); };
    const double ceiling =
        timed([&] { CK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s)); });
    std::printf("| SM layers | copy-engine layers | blocks per SM | ms | ceiling ms | ratio |\n");
    std::printf("|---|---|---|---|---|---|\n");
    for (int blocks_per_sm : {2, 4}) {
        for (int sm_layers : {32, 28, 24, 20, 16, 0}) {
            const int grid = prop.multiProcessorCount * blocks_per_sm;
            const double ms = timed([&] {
                const int ce_layers = kLayers - sm_layers;
                if (ce_layers > 0) {
                    CK(cudaEventRecord(fork, s));
                    CK(cudaStreamWaitEvent(ce, fork, 0));
                    for (int layer = sm_layers; layer < kLayers; ++layer) {
                        for (int kv = 0; kv < 2; ++kv) {
                            char* d = dev + ((size_t(layer) * 2 + kv) * kTokens) * kRow;
                            const char* h = host + (size_t(kv) * kTokens * kLayers + layer) * kRow;
                            CK(cudaMemcpy2DAsync(d, kRow, h, size_t(kLayers) * kRow, kRow,
                                                 kTokens, cudaMemcpyHostToDevice, ce));
                        }
                    }
                    CK(cudaEventRecord(join, ce));
                }
                if (sm_layers > 0) {
                    sm_copy<<<grid, kThreads, 0, s>>>(reinterpret_cast<const int4*>(host),
                                                      reinterpret_cast<int4*>(dev), sm_layers);
                    CK(cudaGetLastError());
                }
                if (ce_layers > 0) CK(cudaStreamWaitEvent(s, join, 0));
            });
            std::printf("| %d | %d | %d | %.3f | %.3f | %.3f |\n", sm_layers, kLayers - sm_layers,
                        blocks_per_sm, ms, ceiling, ceiling / ms);
        }
    }
    CK(cudaFreeHost(host));
    CK(cudaFree(dev));
    return 0;
}
