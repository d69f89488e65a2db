// Which host->device path can carry a per-layer KV load at the PCIe ceiling? (one GPU)
//
// Standalone (no kvcore): for the seed shapes' per-layer calls (64 pages of 64 tokens out of
// 128, random host and device pages), time one layer call after another for every layer,
// each path checked byte for byte first:
//
//   ceiling    one contiguous cudaMemcpyAsync of all layers' bytes
//   dma1d      layer_first host: one cudaMemcpyBatchAsync per layer of every page's
//              contiguous P*E bytes (per K/V)
//   dma2d      page_first host: one cudaMemcpy3DBatchAsync per layer of 2D copies
//              (P rows of E bytes, source pitch L*E) per page
//   zc         a zero-copy gather kernel reading pinned memory, plain launches
//   zc_pdl     the same with programmatic dependent launch, waiting before any access
//   zc_early   PDL, host loads of the first tile issued before griddepcontrol.wait
//   zc_early_ev  zc_early with an event recorded after every layer (as the controller does)
//
// Prints one line per (path, shape): us per layer call, ratio to the ceiling, CPU us per call.
//   nvcc -O3 -std=c++17 -arch=sm_90a -o probe scripts/probe_h2d_paths.cu && ./probe

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "probe_check.h"

constexpr int P = 64, POOL_PAGES = 128, PAGES = 64, THREADS = 256, UNROLL = 4;

struct Gather {
    const char* host;     // host base of this kv
    char* const* dev;     // device layer pointers of this kv (device array)
    const int* hpage;     // per page: host page
    const int* dpage;     // per page: device page
    long long tstride;    // host bytes between tokens
    long long pstride;    // host bytes between pages
    long long lstride;    // host bytes between layers
    long long kvstride;   // host bytes between K and V
    int num_kv, layer, elem;
    char* const* dev_v;
};

template <int MODE>  // 0 plain, 1 pdl wait first, 2 pdl early host reads
__global__ void __launch_bounds__(THREADS, 4) gather(Gather g) {
    if (MODE == 1) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    const unsigned nvec = g.elem / 16;
    const unsigned per_kv = PAGES * P * nvec;
    const unsigned total = per_kv * g.num_kv;
    bool first = true;
    for (unsigned base = blockIdx.x * THREADS * UNROLL; base < total;
         base += gridDim.x * THREADS * UNROLL) {
        uint4 v[UNROLL];
        char* dst[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            unsigned i = base + k * THREADS + threadIdx.x;
            dst[k] = nullptr;
            if (i < total) {
                unsigned kv = i / per_kv, r = i - kv * per_kv;
                unsigned vec = r % nvec, tok = r / nvec, page = tok / P, t = tok % P;
                const char* src = g.host + kv * g.kvstride + (long long)g.hpage[page] * g.pstride +
                                  t * g.tstride + g.layer * g.lstride + vec * 16;
                asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                             : "=r"(v[k].x), "=r"(v[k].y), "=r"(v[k].z), "=r"(v[k].w)
                             : "l"(src));
                char* const* tab = kv ? g.dev_v : g.dev;
                dst[k] = tab[g.layer] + ((long long)g.dpage[page] * P + t) * g.elem + vec * 16;
            }
        }
        if (MODE == 2 && first) {
            asm volatile("griddepcontrol.wait;" ::: "memory");
            asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
            first = false;
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            if (dst[k]) *reinterpret_cast<uint4*>(dst[k]) = v[k];
        }
    }
    if (MODE == 2 && first) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
}

__global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

struct Shape {
    int num_kv, L, E;
    bool page_first;
};

struct Result {
    double us_per_call, cpu_us;
};

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::vector<Shape> shapes;
    for (int pf = 1; pf >= 0; --pf)
        for (int kv : {1, 2})
            for (int E : {512, 1024, 2048, 4096}) shapes.push_back({kv, 16, E, pf == 1});
    shapes.push_back({1, 80, 512, true});
    shapes.push_back({1, 80, 512, false});
    std::mt19937 rng(1234);
    std::printf("%-10s %3s %3s %5s %-11s %9s %9s %7s %8s\n", "path", "kv", "L", "E", "layout",
                "MiB/call", "us/call", "ratio", "cpu_us");
    for (const Shape& sh : shapes) {
        const long long E = sh.E, L = sh.L;
        const long long size = (long long)POOL_PAGES * P;
        const long long kvbytes = size * L * E;  // host bytes per kv
        // page_first: [kv][token][layer][E]; layer_first: [kv][layer][token][E]
        const long long tstride = sh.page_first ? L * E : E;
        const long long lstride = sh.page_first ? E : size * E;
        const long long pstride = P * tstride;
        char* host = nullptr;
        CK(cudaHostAlloc((void**)&host, kvbytes * sh.num_kv, cudaHostAllocDefault));
        {
            std::vector<uint32_t> buf(1 << 20);
            for (long long off = 0; off < kvbytes * sh.num_kv; off += buf.size() * 4) {
                for (auto& x : buf) x = rng();
                std::memcpy(host + off, buf.data(),
                            std::min<long long>(buf.size() * 4, kvbytes * sh.num_kv - off));
            }
        }
        std::vector<char*> dev_layers[2];
        for (int kv = 0; kv < sh.num_kv; ++kv)
            for (int l = 0; l < L; ++l) {
                char* p;
                CK(cudaMalloc(&p, size * E));
                dev_layers[kv].push_back(p);
            }
        char** dtab[2] = {nullptr, nullptr};
        for (int kv = 0; kv < sh.num_kv; ++kv) {
            CK(cudaMalloc(&dtab[kv], L * sizeof(char*)));
            CK(cudaMemcpy(dtab[kv], dev_layers[kv].data(), L * sizeof(char*),
                          cudaMemcpyHostToDevice));
        }
        std::vector<int> perm(POOL_PAGES);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        std::vector<int> hp(perm.begin(), perm.begin() + PAGES);
        std::shuffle(perm.begin(), perm.end(), rng);
        std::vector<int> dp(perm.begin(), perm.begin() + PAGES);
        int *d_hp, *d_dp;
        CK(cudaMalloc(&d_hp, PAGES * 4));
        CK(cudaMalloc(&d_dp, PAGES * 4));
        CK(cudaMemcpy(d_hp, hp.data(), PAGES * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_dp, dp.data(), PAGES * 4, cudaMemcpyHostToDevice));
        const long long call_bytes = (long long)sh.num_kv * PAGES * P * E;
        char *csrc, *cdst;
        CK(cudaHostAlloc((void**)&csrc, call_bytes * L, cudaHostAllocDefault));
        CK(cudaMalloc(&cdst, call_bytes * L));

        cudaEvent_t layer_event;
        CK(cudaEventCreateWithFlags(&layer_event, cudaEventDisableTiming));
        auto layer_call = [&](const char* path, int l) {
            if (!std::strcmp(path, "ceiling")) return;
            if (!std::strcmp(path, "dma1d") || !std::strcmp(path, "dma2d")) {
                if (!std::strcmp(path, "dma1d") && sh.page_first) return;
                if (!std::strcmp(path, "dma2d") && !sh.page_first) return;
                const int n = sh.num_kv * PAGES;
                static std::vector<void*> dsts;
                static std::vector<const void*> srcs;
                static std::vector<size_t> sizes;
                static std::vector<cudaMemcpy3DBatchOp> ops;
                dsts.clear(); srcs.clear(); sizes.clear(); ops.clear();
                for (int kv = 0; kv < sh.num_kv; ++kv)
                    for (int i = 0; i < PAGES; ++i) {
                        const char* src = host + kv * kvbytes + hp[i] * pstride + l * lstride;
                        char* dst = dev_layers[kv][l] + (long long)dp[i] * P * E;
                        if (!sh.page_first) {
                            dsts.push_back(dst); srcs.push_back(src); sizes.push_back(P * E);
                        } else {
                            cudaMemcpy3DBatchOp op = {};
                            op.src.type = cudaMemcpyOperandTypePointer;
                            op.src.op.ptr.ptr = const_cast<char*>(src);
                            op.src.op.ptr.rowLength = tstride;
                            op.src.op.ptr.layerHeight = P;
                            op.dst.type = cudaMemcpyOperandTypePointer;
                            op.dst.op.ptr.ptr = dst;
                            op.dst.op.ptr.rowLength = E;
                            op.dst.op.ptr.layerHeight = P;
                            op.extent = make_cudaExtent(E, P, 1);
                            op.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
                            ops.push_back(op);
                        }
                    }
                if (!sh.page_first) {
                    cudaMemcpyAttributes attr = {};
                    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
                    size_t idx = 0;
                    CK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr,
                                            &idx, 1, s));
                } else {
                    CK(cudaMemcpy3DBatchAsync(n, ops.data(), 0, s));
                }
                return;
            }
            Gather g = {host, dtab[0], d_hp, d_dp, tstride, pstride, lstride, kvbytes,
                        sh.num_kv, l, (int)E, dtab[1]};
            const long long tiles = (call_bytes / 16 + THREADS * UNROLL - 1) / (THREADS * UNROLL);
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3((unsigned)std::min<long long>(tiles, sms * 4));
            cfg.blockDim = dim3(THREADS);
            cfg.stream = s;
            cudaLaunchAttribute attr[1] = {};
            attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            attr[0].val.programmaticStreamSerializationAllowed = 1;
            cfg.attrs = attr;
            int mode = !std::strcmp(path, "zc") ? 0 : (!std::strcmp(path, "zc_pdl") ? 1 : 2);
            if (!std::strcmp(path, "zc_early_ev")) CK(cudaEventRecord(layer_event, s));
            cfg.numAttrs = mode == 0 ? 0 : 1;
            if (mode == 0) CK(cudaLaunchKernelEx(&cfg, gather<0>, g));
            if (mode == 1) CK(cudaLaunchKernelEx(&cfg, gather<1>, g));
            if (mode == 2) CK(cudaLaunchKernelEx(&cfg, gather<2>, g));
        };
        for (const char* path :
             {"ceiling", "dma1d", "dma2d", "zc", "zc_pdl", "zc_early", "zc_early_ev"}) {
            if (!std::strcmp(path, "dma1d") && sh.page_first) continue;
            if (!std::strcmp(path, "dma2d") && !sh.page_first) continue;
            if (std::strcmp(path, "ceiling")) {  // check every layer byte for byte
                for (int kv = 0; kv < sh.num_kv; ++kv)
                    for (int l = 0; l < L; ++l) CK(cudaMemsetAsync(dev_layers[kv][l], 0xA5, size * E, s));
                for (int l = 0; l < L; ++l) layer_call(path, l);
                CK(cudaStreamSynchronize(s));
                CK(cudaGetLastError());
                std::vector<char> got(size * E);
                long long bad = 0;
                for (int kv = 0; kv < sh.num_kv; ++kv)
                    for (int l = 0; l < L; ++l) {
                        CK(cudaMemcpy(got.data(), dev_layers[kv][l], size * E, cudaMemcpyDeviceToHost));
                        for (int i = 0; i < PAGES; ++i)
                            for (int t = 0; t < P; ++t) {
                                const char* want = host + kv * kvbytes + hp[i] * pstride +
                                                   t * tstride + l * lstride;
                                if (std::memcmp(got.data() + ((long long)dp[i] * P + t) * E, want, E))
                                    ++bad;
                            }
                    }
                if (bad) {
                    std::printf("%-10s MISMATCH in %lld elements\n", path, bad);
                    continue;
                }
            }
            for (int queued = 0; queued < 2; ++queued) {
                std::vector<double> gpu, cpu;
                for (int rep = 0; rep < 9; ++rep) {
                    cudaEvent_t a, b;
                    CK(cudaEventCreate(&a));
                    CK(cudaEventCreate(&b));
                    if (queued) spin<<<1, 1, 0, s>>>(20000000);
                    CK(cudaEventRecord(a, s));
                    auto t0 = std::chrono::steady_clock::now();
                    if (!std::strcmp(path, "ceiling"))
                        CK(cudaMemcpyAsync(cdst, csrc, call_bytes * L, cudaMemcpyHostToDevice, s));
                    else
                        for (int l = 0; l < L; ++l) layer_call(path, l);
                    auto t1 = std::chrono::steady_clock::now();
                    CK(cudaEventRecord(b, s));
                    CK(cudaEventSynchronize(b));
                    float ms = 0;
                    CK(cudaEventElapsedTime(&ms, a, b));
                    gpu.push_back(ms * 1e3 / L);
                    cpu.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / L);
                    CK(cudaEventDestroy(a));
                    CK(cudaEventDestroy(b));
                }
                static double ceiling_us = 0;
                const double us = median(gpu);
                if (!std::strcmp(path, "ceiling") && queued == 0) ceiling_us = us;
                std::printf("%-10s %3d %3lld %5lld %-11s %9.2f %9.2f %7.3f %8.2f %s\n", path,
                            sh.num_kv, L, E, sh.page_first ? "page_first" : "layer_first",
                            call_bytes / 1048576.0, us, ceiling_us / us, median(cpu),
                            queued ? "queued" : "paced");
            }
        }
        std::fflush(stdout);
        CK(cudaEventDestroy(layer_event));
        for (int kv = 0; kv < sh.num_kv; ++kv) {
            for (char* p : dev_layers[kv]) CK(cudaFree(p));
            CK(cudaFree(dtab[kv]));
        }
        CK(cudaFree(d_hp));
        CK(cudaFree(d_dp));
        CK(cudaFree(cdst));
        CK(cudaFreeHost(csrc));
        CK(cudaFreeHost(host));
    }
    return 0;
}
