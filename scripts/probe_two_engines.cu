// Per-layer loads through the copy engine, one stream against copies split over two or three
// streams (two or more copy engines) with a fork and a join per layer (no kvcore).
//
// The shape of kvio_load_layer_dma's rows that miss issue 21's 0.95 on the default stream: 32
// layers, K and V, 16 pages placed at random, each page slice 128 or 256 KiB, so one copy per
// page slice (32 per layer, 1024 per load). On one stream the copy engine reached 0.93-0.95 of
// one contiguous copy of the same bytes at 128 KiB (h200-2026-12-05c, h100-2026-12-05b): a
// per-copy cost of about 0.1-0.2 us. Split over streams, one engine's per-copy gaps may be
// filled by another's transfer. Each case is timed with events on the caller's stream, median
// of 7 after one warm-up; "queued" issues it behind a sleeping kernel (no head start).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o probe scripts/probe_two_engines.cu && ./probe

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "probe_check.h"
#include "probe_timing.h"

__global__ void sleep_us(int us) {
    for (int i = 0; i < us; ++i) __nanosleep(1000);
}

constexpr int kLayers = 32, kPages = 16, kPool = 64;

struct Load {
    std::vector<std::vector<void*>> dst;  // per layer: K runs, then V runs
    std::vector<std::vector<const void*>> src;
    size_t slice = 0;
};

static void batch(const std::vector<void*>& d, const std::vector<const void*>& s, size_t begin,
                  size_t end, size_t slice, cudaStream_t on) {
    if (begin >= end) return;
    std::vector<size_t> sizes(end - begin, slice);
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t idx = 0;
    CK(cudaMemcpyBatchAsync(const_cast<void**>(d.data()) + begin, s.data() + begin,
                            sizes.data(), end - begin, &attr, &idx, 1, on));
}

int main() {
    CK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    std::printf("%s, asyncEngineCount %d\n\n", prop.name, prop.asyncEngineCount);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaStream_t side[3];
    for (cudaStream_t& x : side) CK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
    std::vector<cudaEvent_t> fork(kLayers * 4), join(kLayers * 4);
    for (cudaEvent_t& e : fork) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    for (cudaEvent_t& e : join) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));

    std::printf("| slice KiB | case | ms | ceiling ms | ratio | CPU us per layer |\n");
    std::printf("|---|---|---|---|---|---|\n");
    for (size_t slice : {size_t(128) << 10, size_t(256) << 10}) {
        const size_t pool_bytes = size_t(kPool) * slice;  // one layer's K (or V) pool
        char *host = nullptr, *dev = nullptr;
        CK(cudaHostAlloc(&host, 2 * kLayers * pool_bytes, cudaHostAllocDefault));
        CK(cudaMalloc(&dev, 2 * kLayers * pool_bytes));
        std::memset(host, 0x5a, 2 * kLayers * pool_bytes);
        const size_t total = 2 * kLayers * kPages * slice;
        std::mt19937 rng(7);
        std::vector<int> hp(kPool), dp(kPool);
        for (int i = 0; i < kPool; ++i) hp[i] = dp[i] = i;
        std::shuffle(hp.begin(), hp.end(), rng);
        std::shuffle(dp.begin(), dp.end(), rng);
        Load load;
        load.slice = slice;
        load.dst.resize(kLayers);
        load.src.resize(kLayers);
        for (int l = 0; l < kLayers; ++l) {
            for (int kv = 0; kv < 2; ++kv) {
                for (int p = 0; p < kPages; ++p) {
                    const size_t base = (size_t(kv) * kLayers + l) * pool_bytes;
                    load.src[l].push_back(host + base + hp[p] * slice);
                    load.dst[l].push_back(dev + base + dp[p] * slice);
                }
            }
        }
        // `ways` streams per layer (1: the caller's alone), the layer's runs split in `ways`
        // contiguous parts (interleaved: run i on stream i % ways); `join` per layer, or once
        double cpu_us = 0;
        int spin_us = 0;           // CPU time spent after each layer's issue (Python's share)
        bool layer_events = false;  // an event recorded after each layer (for wait_layer)
        auto run = [&](int ways, bool interleave, bool per_layer_join) {
            const auto c0 = std::chrono::steady_clock::now();
            if (ways > 1 && !per_layer_join) {
                CK(cudaEventRecord(fork[0], s));
                for (int w = 1; w < ways; ++w) CK(cudaStreamWaitEvent(side[w - 1], fork[0], 0));
            }
            for (int l = 0; l < kLayers; ++l) {
                const size_t n = load.dst[l].size();
                if (ways == 1) {
                    batch(load.dst[l], load.src[l], 0, n, slice, s);
                    if (layer_events) CK(cudaEventRecord(fork[l], s));
                    const auto until = std::chrono::steady_clock::now() +
                                       std::chrono::microseconds(spin_us);
                    while (std::chrono::steady_clock::now() < until) {
                    }
                    continue;
                }
                if (per_layer_join) {
                    CK(cudaEventRecord(fork[l], s));
                    for (int w = 1; w < ways; ++w) CK(cudaStreamWaitEvent(side[w - 1], fork[l], 0));
                }
                for (int w = 0; w < ways; ++w) {
                    cudaStream_t on = w == 0 ? s : side[w - 1];
                    if (interleave) {
                        std::vector<void*> d;
                        std::vector<const void*> src;
                        for (size_t i = w; i < n; i += ways) {
                            d.push_back(load.dst[l][i]);
                            src.push_back(load.src[l][i]);
                        }
                        batch(d, src, 0, d.size(), slice, on);
                    } else {
                        batch(load.dst[l], load.src[l], n * w / ways, n * (w + 1) / ways, slice, on);
                    }
                }
                if (per_layer_join) {
                    for (int w = 1; w < ways; ++w) {
                        CK(cudaEventRecord(join[l * 4 + w], side[w - 1]));
                        CK(cudaStreamWaitEvent(s, join[l * 4 + w], 0));
                    }
                }
            }
            if (ways > 1 && !per_layer_join) {
                for (int w = 1; w < ways; ++w) {
                    CK(cudaEventRecord(join[w], side[w - 1]));
                    CK(cudaStreamWaitEvent(s, join[w], 0));
                }
            }
            cpu_us += std::chrono::duration<double, std::micro>(
                          std::chrono::steady_clock::now() - c0).count();
        };
        auto timed = [&](const std::function<void()>& fn, bool queued) {
            cpu_us = 0;
            return event_median_ms(s, fn, [&] {
                if (queued) sleep_us<<<1, 1, 0, s>>>(5000);
            });
        };
        const double ceiling =
            timed([&] { CK(cudaMemcpyAsync(dev, host, total, cudaMemcpyHostToDevice, s)); }, false);
        struct Case {
            const char* name;
            int ways;
            bool interleave, per_layer_join, queued;
            int spin_us = 0;
            bool layer_events = false;
        };
        const Case cases[] = {
            {"one stream", 1, false, true, false},
            {"one stream, queued", 1, false, true, true},
            {"one stream, an event after each layer", 1, false, true, false, 0, true},
            {"one stream, an event and 20 us of CPU after each layer", 1, false, true, false, 20,
             true},
            {"one stream, an event and 40 us of CPU after each layer", 1, false, true, false, 40,
             true},
            {"one stream, 40 us of CPU after each layer, queued", 1, false, true, true, 40, true},
            {"2 streams, halves, join per layer", 2, false, true, false},
            {"2 streams, halves, join per layer, queued", 2, false, true, true},
            {"2 streams, interleaved, join per layer", 2, true, true, false},
            {"3 streams, thirds, join per layer", 3, false, true, false},
            {"3 streams, thirds, join per layer, queued", 3, false, true, true},
            {"2 streams, halves, one join", 2, false, false, false},
        };
        for (const Case& c : cases) {
            spin_us = c.spin_us;
            layer_events = c.layer_events;
            const double ms = timed([&] { run(c.ways, c.interleave, c.per_layer_join); }, c.queued);
            std::printf("| %zu | %s | %.3f | %.3f | %.3f | %.2f |\n", slice >> 10, c.name, ms,
                        ceiling, ceiling / ms, cpu_us / 8 / kLayers);
        }
        CK(cudaFreeHost(host));
        CK(cudaFree(dev));
    }
    return 0;
}
