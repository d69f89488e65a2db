// Can the copy engine carry a per-layer load from page_first in groups of layers? (one GPU)
//
// page_first keeps a token's layers together ((2, S, L, H, D) per page), so one layer of a page
// is P pieces of E bytes, L*E apart: SM reads of pinned memory move them at 0.89-0.91 of the
// copy engine's rate (h200-2026-12-04e), 2D copies of such rows at 0.18-0.45 (E = 512-2048 B,
// h200-2026-12-03). A load that lands G consecutive layers at a time could copy rows of G*E
// bytes instead (the group's slice of every token) into a staging buffer and scatter them on
// the device, where bytes move ~30x faster. This probe times only the copy-engine half, for
// G = 1 .. L, with the shapes of issue 21's rows (MHA 8 x 128 bf16: E = 2 KiB, L = 32, pages of
// P = 64 tokens, 4, 16 and 64 random pages out of 128), K only:
//
//   ceiling    one contiguous cudaMemcpyAsync of the same bytes
//   2d         one cudaMemcpy2DAsync per page and group (P rows of G*E bytes, pitch L*E)
//   3d_batch   one cudaMemcpy3DBatchAsync per group, an operation per page
//
// Prints one line per (pages, G, path): us per load of all layers, ratio to the ceiling, CPU us
// per load; the first group's landing time (what a consumer of layer 0 waits for) is
// 1/(L/G) of it. Every path's staging image is checked byte for byte first.
//   nvcc -O3 -std=c++17 -arch=sm_90a -o probe_2d scripts/probe_2d_rows.cu && ./probe_2d

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "probe_check.h"

constexpr int P = 64, POOL_PAGES = 128, L = 32, REPEAT = 7;
constexpr long long E = 2048, TOKEN = L * E, PAGE = P * TOKEN;

namespace {

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Enqueue the copies of every layer of `pages` (host page numbers) into staging, group by
// group: staging holds, per group, per page, P rows of G*E bytes.
void issue(const char* path, const char* host, char* staging, const std::vector<int>& pages,
           int G, cudaStream_t s) {
    const long long row = G * E, per_group = (long long)pages.size() * P * row;
    static std::vector<cudaMemcpy3DBatchOp> ops;
    for (int g = 0; g < L / G; ++g) {
        ops.clear();
        for (size_t i = 0; i < pages.size(); ++i) {
            const char* src = host + pages[i] * PAGE + g * row;
            char* dst = staging + g * per_group + (long long)i * P * row;
            if (!std::strcmp(path, "2d")) {
                CK(cudaMemcpy2DAsync(dst, row, src, TOKEN, row, P, cudaMemcpyHostToDevice, s));
                continue;
            }
            cudaMemcpy3DBatchOp op = {};
            op.src.type = cudaMemcpyOperandTypePointer;
            op.src.op.ptr.ptr = const_cast<char*>(src);
            op.src.op.ptr.rowLength = TOKEN;  // elements of 1 byte: the pitch
            op.src.op.ptr.layerHeight = P;
            op.dst.type = cudaMemcpyOperandTypePointer;
            op.dst.op.ptr.ptr = dst;
            op.dst.op.ptr.rowLength = row;
            op.dst.op.ptr.layerHeight = P;
            op.extent = make_cudaExtent(row, P, 1);
            op.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
            ops.push_back(op);
        }
        if (!ops.empty()) CK(cudaMemcpy3DBatchAsync(ops.size(), ops.data(), 0, s));
    }
}

// The staging image `path` leaves must hold every token's group slices in order.
bool check(const char* path, const char* host, char* staging, const std::vector<int>& pages,
           int G, cudaStream_t s) {
    const long long bytes = (long long)pages.size() * PAGE;
    CK(cudaMemsetAsync(staging, 0xA5, bytes, s));
    issue(path, host, staging, pages, G, s);
    std::vector<char> got(bytes);
    CK(cudaMemcpyAsync(got.data(), staging, bytes, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    const long long row = G * E, per_group = (long long)pages.size() * P * row;
    for (int g = 0; g < L / G; ++g)
        for (size_t i = 0; i < pages.size(); ++i)
            for (int t = 0; t < P; ++t) {
                const char* want = host + pages[i] * PAGE + t * TOKEN + g * row;
                const char* have = got.data() + g * per_group + ((long long)i * P + t) * row;
                if (std::memcmp(want, have, row) != 0) return false;
            }
    return true;
}

}  // namespace

int main() {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    char* host = nullptr;
    CK(cudaHostAlloc(&host, POOL_PAGES * PAGE, cudaHostAllocDefault));
    std::mt19937_64 rng(7);
    for (long long i = 0; i < POOL_PAGES * PAGE / 8; ++i) reinterpret_cast<uint64_t*>(host)[i] = rng();
    char* staging = nullptr;
    CK(cudaMalloc(&staging, 64 * PAGE));
    cudaEvent_t start, stop;
    CK(cudaEventCreate(&start));
    CK(cudaEventCreate(&stop));
    std::printf("%-6s %-3s %-9s %10s %7s %10s\n", "pages", "G", "path", "us/load", "ratio",
                "CPU us");
    for (int npages : {4, 16, 64}) {
        std::vector<int> all(POOL_PAGES);
        for (int i = 0; i < POOL_PAGES; ++i) all[i] = i;
        std::shuffle(all.begin(), all.end(), rng);
        const std::vector<int> pages(all.begin(), all.begin() + npages);
        const long long bytes = (long long)npages * PAGE;
        auto timed = [&](auto&& enqueue, double* cpu_us) {
            std::vector<double> gpu, cpu;
            for (int r = 0; r < REPEAT + 1; ++r) {
                CK(cudaStreamSynchronize(s));
                CK(cudaEventRecord(start, s));
                const auto c0 = std::chrono::steady_clock::now();
                for (int k = 0; k < 4; ++k) enqueue();  // four loads back to back
                const auto c1 = std::chrono::steady_clock::now();
                CK(cudaEventRecord(stop, s));
                CK(cudaEventSynchronize(stop));
                float ms = 0;
                CK(cudaEventElapsedTime(&ms, start, stop));
                if (r == 0) continue;  // warm-up
                gpu.push_back(1e3 * ms / 4);
                cpu.push_back(std::chrono::duration<double, std::micro>(c1 - c0).count() / 4);
            }
            if (cpu_us != nullptr) *cpu_us = median(cpu);
            return median(gpu);
        };
        double ceil_cpu = 0;
        const double ceiling = timed([&] {
            CK(cudaMemcpyAsync(staging, host, bytes, cudaMemcpyHostToDevice, s));
        }, &ceil_cpu);
        std::printf("%-6d %-3s %-9s %10.1f %7.3f %10.1f\n", npages, "-", "ceiling", ceiling,
                    1.0, ceil_cpu);
        for (int G : {1, 2, 4, 8, 16, 32}) {
            for (const char* path : {"2d", "3d_batch"}) {
                if (!check(path, host, staging, pages, G, s)) {
                    std::printf("%-6d %-3d %-9s MISMATCH\n", npages, G, path);
                    continue;
                }
                double cpu = 0;
                const double us = timed([&] { issue(path, host, staging, pages, G, s); }, &cpu);
                std::printf("%-6d %-3d %-9s %10.1f %7.3f %10.1f\n", npages, G, path, us,
                            ceiling / us, cpu);
            }
        }
    }
    CK(cudaFreeHost(host));
    CK(cudaFree(staging));
    return 0;
}
