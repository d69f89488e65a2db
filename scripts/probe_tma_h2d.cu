// Can the bulk copy engine of an SM (TMA, cp.async.bulk) read pinned host memory faster than
// plain vector loads? (one Hopper GPU; standalone, no kvcore)
//
// A per-layer KV load gathers, for every page, one layer's slice from a pinned host pool:
//   page_first host (token-major): 2 KiB pieces (8 heads x 128 bf16), one per token, 64 KiB apart
//   layer_first host: one 128 KiB slice per page (64 tokens x 2 KiB), contiguous
// into random pages of a device pool. For 1, 4, 16 and 64 pages (K and V, 32 layers, one launch
// per layer, back to back on one stream), each path is checked byte for byte and timed:
//
//   ceiling  one contiguous cudaMemcpyAsync of all layers' bytes
//   dma      (layer_first only) one cudaMemcpyBatchAsync per layer, one run per page slice
//   ld       ld.global.nc.v4 gather, UNROLL 16 B loads in flight per thread
//   tma      per warp, lane 0 runs a pipeline of STAGES bulk copies host->shared (mbarrier
//            completion), each followed by a bulk copy shared->device
//
// Prints one line per (path, layout, pages): us for all layers, ratio to the ceiling.
//   nvcc -O3 -std=c++17 -arch=sm_90a -o probe_tma scripts/probe_tma_h2d.cu && ./probe_tma

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "probe_check.h"

constexpr int P = 64, L = 32, E = 2048, POOL_PAGES = 128;

struct Pieces {  // one layer's copy: n pieces of `bytes`, addresses precomputed
    const uint64_t* src;
    const uint64_t* dst;
    int n;
    int bytes;
};

template <int UNROLL>
__global__ void __launch_bounds__(256) ld_gather(Pieces p) {
    const int vec_per = p.bytes / 16;
    const long long total = (long long)p.n * vec_per;
    for (long long base = (long long)blockIdx.x * 256 * UNROLL; base < total;
         base += (long long)gridDim.x * 256 * UNROLL) {
        uint4 v[UNROLL];
        char* dst[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            long long i = base + k * 256 + threadIdx.x;
            dst[k] = nullptr;
            if (i < total) {
                int piece = (int)(i / vec_per), off = (int)(i % vec_per) * 16;
                const char* s = reinterpret_cast<const char*>(p.src[piece]) + off;
                asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                             : "=r"(v[k].x), "=r"(v[k].y), "=r"(v[k].z), "=r"(v[k].w)
                             : "l"(s));
                dst[k] = reinterpret_cast<char*>(p.dst[piece]) + off;
            }
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k)
            if (dst[k]) *reinterpret_cast<uint4*>(dst[k]) = v[k];
    }
}

__device__ __forceinline__ uint32_t smem(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// each warp's lane 0: a ring of STAGES slots of CHUNK bytes; chunk c of the warp's share goes
// host->slot (mbarrier counts its bytes), then slot->device (bulk group); a slot is loaded again
// once the store that read it has read it
template <int STAGES, int CHUNK, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) tma_gather(Pieces p) {
    extern __shared__ __align__(128) unsigned char buf[];
    __shared__ __align__(8) uint64_t bars[WARPS][STAGES];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane != 0) return;
    unsigned char* ring = buf + (size_t)warp * STAGES * CHUNK;
    for (int s = 0; s < STAGES; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(&bars[warp][s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    const int per_piece = p.bytes / CHUNK;
    const long long total = (long long)p.n * per_piece;
    const long long worker = (long long)blockIdx.x * WARPS + warp;
    const long long workers = (long long)gridDim.x * WARPS;
    // this worker's chunks: worker, worker + workers, ...
    long long mine = total > worker ? (total - worker + workers - 1) / workers : 0;
    auto issue_load = [&](long long j) {
        long long c = worker + j * workers;
        int piece = (int)(c / per_piece), off = (int)(c % per_piece) * CHUNK;
        int s = (int)(j % STAGES);
        uint32_t bar = smem(&bars[warp][s]);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                     "r"(CHUNK)
                     : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];" ::"r"(smem(ring + s * CHUNK)),
            "l"(p.src[piece] + off), "r"(CHUNK), "r"(bar)
            : "memory");
    };
    for (long long j = 0; j < mine && j < STAGES; ++j) issue_load(j);
    for (long long j = 0; j < mine; ++j) {
        int s = (int)(j % STAGES);
        uint32_t parity = (uint32_t)((j / STAGES) & 1);
        uint32_t bar = smem(&bars[warp][s]);
        asm volatile(
            "{\n.reg .pred P1;\nWAIT_%=:\n"
            "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
            "@!P1 bra WAIT_%=;\n}" ::"r"(bar),
            "r"(parity)
            : "memory");
        long long c = worker + j * workers;
        int piece = (int)(c / per_piece), off = (int)(c % per_piece) * CHUNK;
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                         p.dst[piece] + off),
                     "r"(smem(ring + s * CHUNK)), "r"(CHUNK)
                     : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (j + STAGES < mine) {
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            issue_load(j + STAGES);
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct Path {
    const char* name;
    int kind;  // 0 ld, 1 tma, 2 dma
    int blocks_per_sm;
};

template <int STAGES, int CHUNK, int WARPS>
void launch_tma(const Pieces& p, int sms, int bps, cudaStream_t s) {
    size_t shm = (size_t)WARPS * STAGES * CHUNK;
    static bool set = false;
    if (!set) {
        CK(cudaFuncSetAttribute(tma_gather<STAGES, CHUNK, WARPS>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
        set = true;
    }
    tma_gather<STAGES, CHUNK, WARPS><<<sms * bps, WARPS * 32, shm, s>>>(p);
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const long long size = (long long)POOL_PAGES * P;  // tokens per pool
    const long long kv_bytes = size * L * E;           // host bytes per K or V
    unsigned char* host;
    CK(cudaHostAlloc(&host, 2 * kv_bytes, cudaHostAllocDefault));
    std::mt19937_64 rng(42);
    for (long long i = 0; i < 2 * kv_bytes / 8; ++i) reinterpret_cast<uint64_t*>(host)[i] = rng();
    unsigned char* dev;  // device pool: [kv][layer][token][E]
    CK(cudaMalloc(&dev, 2 * kv_bytes));
    unsigned char* ceil_dst;
    CK(cudaMalloc(&ceil_dst, 2 * kv_bytes));
    std::vector<unsigned char> check(2 * kv_bytes);
    std::printf("%-14s %-11s %5s %9s %10s %7s\n", "path", "layout", "pages", "MiB", "us", "ratio");
    for (int page_first = 1; page_first >= 0; --page_first) {
        for (int pages : {1, 4, 16, 64}) {
            std::vector<int> hp(POOL_PAGES), dp(POOL_PAGES);
            for (int i = 0; i < POOL_PAGES; ++i) hp[i] = dp[i] = i;
            std::shuffle(hp.begin(), hp.end(), rng);
            std::shuffle(dp.begin(), dp.end(), rng);
            // host address of (kv, token, layer)
            auto haddr = [&](int kv, long long tok, int layer) -> uint64_t {
                long long off = page_first ? (tok * L + layer) * (long long)E
                                           : ((long long)layer * size + tok) * E;
                return (uint64_t)(host + kv * kv_bytes + off);
            };
            auto daddr = [&](int kv, long long tok, int layer) -> uint64_t {
                return (uint64_t)(dev + kv * kv_bytes + ((long long)layer * size + tok) * E);
            };
            const int piece_bytes = page_first ? E : P * E;
            const int n = page_first ? 2 * pages * P : 2 * pages;
            std::vector<uint64_t> src((size_t)L * n), dst((size_t)L * n);
            for (int layer = 0; layer < L; ++layer) {
                int k = 0;
                for (int kv = 0; kv < 2; ++kv)
                    for (int pg = 0; pg < pages; ++pg)
                        for (int t = 0; t < (page_first ? P : 1); ++t, ++k) {
                            src[(size_t)layer * n + k] = haddr(kv, (long long)hp[pg] * P + t, layer);
                            dst[(size_t)layer * n + k] = daddr(kv, (long long)dp[pg] * P + t, layer);
                        }
            }
            uint64_t *d_src, *d_dst;
            CK(cudaMalloc(&d_src, src.size() * 8));
            CK(cudaMalloc(&d_dst, dst.size() * 8));
            CK(cudaMemcpy(d_src, src.data(), src.size() * 8, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(d_dst, dst.data(), dst.size() * 8, cudaMemcpyHostToDevice));
            const double bytes = (double)L * n * piece_bytes;
            auto time_it = [&](auto&& body) {
                cudaEvent_t a, b;
                CK(cudaEventCreate(&a));
                CK(cudaEventCreate(&b));
                body();  // warm-up
                float best = 1e30f;
                for (int r = 0; r < 7; ++r) {
                    CK(cudaEventRecord(a, s));
                    body();
                    CK(cudaEventRecord(b, s));
                    CK(cudaEventSynchronize(b));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, a, b));
                    best = std::min(best, ms);
                }
                CK(cudaGetLastError());
                CK(cudaEventDestroy(a));
                CK(cudaEventDestroy(b));
                return 1e3 * best;
            };
            double ceiling = time_it([&] {
                CK(cudaMemcpyAsync(ceil_dst, host, (size_t)bytes, cudaMemcpyHostToDevice, s));
            });
            std::printf("%-14s %-11s %5d %9.1f %10.1f %7.3f\n", "ceiling",
                        page_first ? "page_first" : "layer_first", pages, bytes / (1 << 20),
                        ceiling, 1.0);
            auto verify = [&](const char* name) {
                CK(cudaStreamSynchronize(s));
                CK(cudaMemcpy(check.data(), dev, 2 * kv_bytes, cudaMemcpyDeviceToHost));
                for (size_t i = 0; i < src.size(); ++i) {
                    size_t doff = dst[i] - (uint64_t)dev;
                    if (std::memcmp(check.data() + doff, reinterpret_cast<void*>(src[i]),
                                    piece_bytes)) {
                        std::printf("%s: MISMATCH at piece %zu\n", name, i);
                        return false;
                    }
                }
                return true;
            };
            auto run = [&](const char* name, auto&& layer_call) {
                CK(cudaMemset(dev, 0xA5, 2 * kv_bytes));
                for (int layer = 0; layer < L; ++layer) layer_call(layer);
                if (!verify(name)) return;
                double us = time_it([&] {
                    for (int layer = 0; layer < L; ++layer) layer_call(layer);
                });
                std::printf("%-14s %-11s %5d %9.1f %10.1f %7.3f\n", name,
                            page_first ? "page_first" : "layer_first", pages, bytes / (1 << 20),
                            us, ceiling / us);
            };
            auto pieces = [&](int layer) {
                return Pieces{d_src + (size_t)layer * n, d_dst + (size_t)layer * n, n, piece_bytes};
            };
            for (int bps : {2, 4})
                run(bps == 2 ? "ld_u8_b2" : "ld_u8_b4", [&](int layer) {
                    ld_gather<8><<<sms * bps, 256, 0, s>>>(pieces(layer));
                });
            run("ld_u16_b2", [&](int layer) { ld_gather<16><<<sms * 2, 256, 0, s>>>(pieces(layer)); });
            run("tma_s8_w4_b1", [&](int layer) { launch_tma<8, 2048, 4>(pieces(layer), sms, 1, s); });
            run("tma_s8_w4_b2", [&](int layer) { launch_tma<8, 2048, 4>(pieces(layer), sms, 2, s); });
            run("tma_s4_w8_b2", [&](int layer) { launch_tma<4, 2048, 8>(pieces(layer), sms, 2, s); });
            run("tma_s16_w2_b2", [&](int layer) { launch_tma<16, 2048, 2>(pieces(layer), sms, 2, s); });
            if (!page_first) {
                run("tma_s3_w4_b2_8k", [&](int layer) { launch_tma<3, 8192, 4>(pieces(layer), sms, 2, s); });
                run("tma_s6_w2_b2_8k", [&](int layer) { launch_tma<6, 8192, 2>(pieces(layer), sms, 2, s); });
                std::vector<void*> bs(n), bd(n);
                std::vector<size_t> bz(n, piece_bytes);
                cudaMemcpyAttributes attr{};
                attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
                attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
                run("dma_batch", [&](int layer) {
                    for (int i = 0; i < n; ++i) {
                        bs[i] = reinterpret_cast<void*>(src[(size_t)layer * n + i]);
                        bd[i] = reinterpret_cast<void*>(dst[(size_t)layer * n + i]);
                    }
                    size_t attr_idx = 0;
                    CK(cudaMemcpyBatchAsync(bd.data(), bs.data(), bz.data(), n, &attr, &attr_idx,
                                            1, s));
                });
            }
            CK(cudaFree(d_src));
            CK(cudaFree(d_dst));
        }
    }
    std::printf("done\n");
    return 0;
}
