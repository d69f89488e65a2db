// What each CUDA runtime call of the submit path costs the CPU (one GPU, no kvcore).
//
// Every call kind is timed 64 times in a row on a stream whose work is held back by a
// sleeping kernel queued first (as in an engine's queue, where nothing has completed yet),
// then again on an idle stream; printed: the median microseconds per call of each.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o probe scripts/probe_runtime_calls.cu && ./probe

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "probe_check.h"

__global__ void sleep_ms(int ms) {
    for (int i = 0; i < ms; ++i) {
        for (int j = 0; j < 1000; ++j) __nanosleep(1000);
    }
}

__global__ void empty_kernel() {}

struct Big {  // a parameter block of the size of the library's CopyParams
    char bytes[256];
};

__global__ void __launch_bounds__(256, 4) param_kernel(const Big p) {
    if (p.bytes[threadIdx.x] == 127 && blockIdx.x == 100000) asm volatile("trap;");
}

// the inline copies' launch: CopyParams beside InlineIndices (3.8 KiB in all), against the
// same kernel with a small index block: what the parameter bytes alone cost the CPU
template <int N>
struct Indices {
    int32_t v[N];
    uint32_t page_shift;
};

template <int N>
__global__ void __launch_bounds__(256, 4) inline_kernel(const Big p,
                                                        const __grid_constant__ Indices<N> inl) {
    if (p.bytes[threadIdx.x] == 127 && inl.v[threadIdx.x % N] == blockIdx.x) asm volatile("trap;");
}

static double median_us(std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main() {
    CK(cudaSetDevice(0));
    cudaStream_t s, side;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    const size_t kBytes = size_t(64) << 20;
    char *dev = nullptr, *host = nullptr;
    CK(cudaMalloc(&dev, kBytes));
    CK(cudaHostAlloc(&host, kBytes, cudaHostAllocDefault));
    uint32_t* flag = nullptr;
    CK(cudaHostAlloc(&flag, 4096, cudaHostAllocDefault));
    flag[0] = 7;
    uint32_t* counters = nullptr;
    CK(cudaMalloc(&counters, 4096));
    cudaEvent_t ev;
    CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    CK(cudaEventRecord(ev, side));

    void* wait_sym = nullptr;
    cudaDriverEntryPointQueryResult found;
    CK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &wait_sym, 12000,
                                        cudaEnableDefault, &found));
    using WaitFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
    const WaitFn wait_value = reinterpret_cast<WaitFn>(wait_sym);

    const size_t kRun = size_t(1) << 20;
    auto batch = [&](int n, size_t run) {
        std::vector<void*> d(n);
        std::vector<const void*> src(n);
        std::vector<size_t> sz(n, run);
        for (int i = 0; i < n; ++i) {
            d[i] = host + 2 * i * run;
            src[i] = dev + 2 * i * run;
        }
        cudaMemcpyAttributes attr = {};
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        size_t idx = 0;
        CK(cudaMemcpyBatchAsync(d.data(), src.data(), sz.data(), n, &attr, &idx, 1, s));
    };
    Big big = {};
    struct Case {
        const char* name;
        std::function<void()> call;
    };
    std::vector<Case> cases = {
        {"empty kernel <<<1,32>>>", [&] { empty_kernel<<<1, 32, 0, s>>>(); }},
        {"256 B param kernel, 528 blocks, cudaLaunchKernelEx + PDL",
         [&] {
             cudaLaunchConfig_t cfg = {};
             cfg.gridDim = dim3(528);
             cfg.blockDim = dim3(256);
             cfg.stream = s;
             cudaLaunchAttribute attr[1] = {};
             attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
             attr[0].val.programmaticStreamSerializationAllowed = 1;
             cfg.attrs = attr;
             cfg.numAttrs = 1;
             CK(cudaLaunchKernelEx(&cfg, param_kernel, big));
         }},
        {"256 B + 3.8 KiB (960 indices) param kernel, 528 blocks",
         [&] { inline_kernel<960><<<528, 256, 0, s>>>(big, Indices<960>{}); }},
        {"256 B + 68 B (16 indices) param kernel, 528 blocks",
         [&] { inline_kernel<16><<<528, 256, 0, s>>>(big, Indices<16>{}); }},
        {"cudaMemcpyAsync D2H 1 MiB",
         [&] { CK(cudaMemcpyAsync(host, dev, kRun, cudaMemcpyDeviceToHost, s)); }},
        {"cudaMemcpyAsync H2D 1 MiB",
         [&] { CK(cudaMemcpyAsync(dev, host, kRun, cudaMemcpyHostToDevice, s)); }},
        // does a copy's CPU cost grow with its bytes? (a one-page MHA write-back copies two
        // runs of 4 MiB, an MLA one a run of 2.25 MiB; h100-2026-12-05c)
        {"cudaMemcpyAsync D2H 64 KiB",
         [&] { CK(cudaMemcpyAsync(host, dev, kRun / 16, cudaMemcpyDeviceToHost, s)); }},
        {"cudaMemcpyAsync D2H 2 MiB",
         [&] { CK(cudaMemcpyAsync(host, dev, 2 * kRun, cudaMemcpyDeviceToHost, s)); }},
        {"cudaMemcpyAsync D2H 8 MiB",
         [&] { CK(cudaMemcpyAsync(host, dev, 8 * kRun, cudaMemcpyDeviceToHost, s)); }},
        {"cudaMemcpyAsync D2H 32 MiB",
         [&] { CK(cudaMemcpyAsync(host, dev, 32 * kRun, cudaMemcpyDeviceToHost, s)); }},
        {"cudaMemcpyBatchAsync D2H, 1 run of 8 MiB", [&] { batch(1, 8 * kRun); }},
        {"cudaMemcpyBatchAsync D2H, 2 runs of 4 MiB", [&] { batch(2, 4 * kRun); }},
        {"cudaMemcpyBatchAsync D2H, 1 run of 2.25 MiB", [&] { batch(1, 9 * kRun / 4); }},
        {"cudaMemcpyBatchAsync D2H, 1 run", [&] { batch(1, kRun); }},
        {"cudaMemcpyBatchAsync D2H, 4 runs", [&] { batch(4, kRun); }},
        {"cudaMemcpyBatchAsync D2H, 16 runs", [&] { batch(16, kRun); }},
        {"cudaMemsetAsync 132 B", [&] { CK(cudaMemsetAsync(counters, 0, 132, s)); }},
        {"cudaEventRecord", [&] { CK(cudaEventRecord(ev, s)); }},
        {"cudaStreamWaitEvent", [&] { CK(cudaStreamWaitEvent(s, ev, 0)); }},
        {"cudaEventRecord + cudaStreamWaitEvent(side)",
         [&] {
             CK(cudaEventRecord(ev, s));
             CK(cudaStreamWaitEvent(side, ev, 0));
         }},
        {"cuStreamWaitValue32 (pinned flag)",
         [&] {
             if (wait_value(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag),
                            7, CU_STREAM_WAIT_VALUE_EQ) != CUDA_SUCCESS) std::exit(1);
         }},
        {"cudaStreamIsCapturing",
         [&] {
             cudaStreamCaptureStatus st;
             CK(cudaStreamIsCapturing(s, &st));
         }},
        {"cudaGetDevice + cudaSetDevice (same)",
         [&] {
             int d = 0;
             CK(cudaGetDevice(&d));
             CK(cudaSetDevice(d));
         }},
        {"cudaPointerGetAttributes (device)",
         [&] {
             cudaPointerAttributes a;
             CK(cudaPointerGetAttributes(&a, dev));
         }},
    };
    std::printf("%-58s %10s %10s\n", "call", "busy us", "idle us");
    for (Case& c : cases) {
        double med[2];
        for (int busy = 1; busy >= 0; --busy) {
            CK(cudaDeviceSynchronize());
            if (busy) sleep_ms<<<1, 1, 0, s>>>(20);
            std::vector<double> t;
            for (int i = 0; i < 64; ++i) {
                const auto t0 = std::chrono::steady_clock::now();
                c.call();
                const auto t1 = std::chrono::steady_clock::now();
                t.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
            }
            med[busy] = median_us(t);
            CK(cudaDeviceSynchronize());
        }
        std::printf("%-58s %10.2f %10.2f\n", c.name, med[1], med[0]);
    }
    CK(cudaGetLastError());
    return 0;
}
