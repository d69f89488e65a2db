// Host side of kvio_rocm: the C ABI of docs/native-abi.md on the HIP runtime.
//
// Built only on a ROCm machine (hipcc, or clang -x hip --offload-arch=<gfx> with ROCm's
// headers), see kvio_rocm/build.py. The kernels live in kvio_device.h, which needs no ROCm
// header. With -DKVIO_EMULATE this file is compiled as plain C++ against kvio_emul.h, a CPU
// stand-in for the handful of HIP calls used here, so the launcher logic (alignment and order
// choice, launch splitting, staging chunks, run merging, batched-memcpy lookup, error codes)
// is tested on machines without a GPU.
// The ABI's structs and prototypes: kvcore's kvio_abi.h (-I kvcore.native_abi.INCLUDE_DIR).
#include "kvio_abi.h"

#if defined(KVIO_EMULATE)
#include "kvio_emul.h"
#else
#include <hip/hip_runtime.h>
#endif

#include "kvio_device.h"

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>

#include <algorithm>
#include <mutex>
#include <type_traits>
#include <vector>

namespace {

// hipMemcpyBatchAsync, ROCm >= 7.1 (hip_runtime_api.h):
//   hipError_t hipMemcpyBatchAsync(void** dsts, void** srcs, size_t* sizes, size_t count,
//                                  hipMemcpyAttributes* attrs, size_t* attrsIdxs,
//                                  size_t numAttrs, size_t* failIdx, hipStream_t stream);
// Resolved at run time with dlsym so the library also loads on runtimes without it. attrs is
// declared void* here (a pointer either way) so older headers compile.
typedef hipError_t (*kvio_batch_fn)(void** dsts, void** srcs, size_t* sizes, size_t count,
                                    void* attrs, size_t* attrs_idxs, size_t num_attrs,
                                    size_t* fail_idx, hipStream_t stream);

#if !defined(KVIO_EMULATE) && defined(HIP_VERSION) && HIP_VERSION >= 70100000
// The headers we build against declare it: make sure our pointer type has the same shape.
static_assert(std::is_same<decltype(&::hipMemcpyBatchAsync),
                           hipError_t (*)(void**, void**, size_t*, size_t, hipMemcpyAttributes*,
                                          size_t*, size_t, size_t*, hipStream_t)>::value,
              "hipMemcpyBatchAsync changed signature; update kvio_batch_fn");
#endif

kvio_batch_fn resolve_batch() {
    static const kvio_batch_fn fn = []() -> kvio_batch_fn {
        // Look in the very runtime library this one is linked against (libamdhip64.so.N):
        // find its path from one of its functions, then dlsym in it. RTLD_NOLOAD: never load a
        // second copy.
        // If that fails, the usual sonames, again only if already loaded.
        void* lib = nullptr;
        Dl_info info;
        if (dladdr(reinterpret_cast<void*>(&hipMemcpyAsync), &info) && info.dli_fname)
            lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
        for (const char* name : {"libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"}) {
            if (lib) break;
            lib = dlopen(name, RTLD_LAZY | RTLD_NOLOAD);
        }
        if (!lib) return nullptr;
        void* sym = dlsym(lib, "hipMemcpyBatchAsync");
        dlclose(lib); // drops the reference NOLOAD took; the runtime stays loaded (we link it)
        return reinterpret_cast<kvio_batch_fn>(sym);
    }();
    return fn;
}

struct device_info {
    int cus = 0;
};

hipError_t get_device_info(device_info* out) {
    static std::mutex mu;
    static std::vector<device_info> cache;
    int dev = 0;
    hipError_t e = hipGetDevice(&dev);
    if (e != hipSuccess) return e;
    if (dev < 0) return hipErrorInvalidDevice;
    std::lock_guard<std::mutex> lock(mu);
    if ((size_t)dev >= cache.size()) cache.resize((size_t)dev + 1);
    if (cache[(size_t)dev].cus == 0) {
        int cus = 0;
        e = hipDeviceGetAttribute(&cus, hipDeviceAttributeMultiprocessorCount, dev);
        if (e != hipSuccess) return e;
        cache[(size_t)dev].cus = cus > 0 ? cus : 1;
    }
    *out = cache[(size_t)dev];
    return hipSuccess;
}

typedef void (*kvio_kernel_fn)(kvio_copy_params);

kvio_kernel_fn pick_kernel(int vec, int order) {
    const bool layer = order == KVIO_ORDER_LAYER_INNER;
    switch (vec) {
    case 16: return layer ? kvio_copy_v16_layer_inner : kvio_copy_v16_token_inner;
    case 8: return layer ? kvio_copy_v8_layer_inner : kvio_copy_v8_token_inner;
    default: return layer ? kvio_copy_v1_layer_inner : kvio_copy_v1_token_inner;
    }
}

bool aligned(uint64_t v, uint64_t a) { return v % a == 0; } // two's complement: fine for < 0

// Widest vector every byte address of the copy is aligned to: host (or staging) base, every
// host stride, chunk and element size. Device layer bases come from torch allocations
// (>= 256-B aligned) and device offsets are multiples of chunk_bytes and elem_bytes; kvcore
// checks the layer tensors' alignment against the capability before it calls. (A misaligned
// vector access is still correct on gfx9, only slower.)
int pick_vec(const kvio_layout& L, const void* host_base) {
    const uint64_t vals[] = {(uint64_t)(uintptr_t)host_base, (uint64_t)L.kv_stride,
                             (uint64_t)L.layer_stride,      (uint64_t)L.page_stride,
                             (uint64_t)L.token_stride,      (uint64_t)L.chunk_stride,
                             (uint64_t)L.chunk_bytes};
    for (int vec : {16, 8}) {
        bool ok = true;
        for (uint64_t v : vals) ok = ok && aligned(v, (uint64_t)vec);
        if (ok) return vec;
    }
    return 1;
}

uint64_t uabs(int64_t v) { return v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v; }

// Which segment dimension is innermost: layers when one layer's chunk is nearer on the host
// than the next token's (page_first, page_head), tokens otherwise (layer_first,
// page_first_direct).
int pick_order(const kvio_layout& L, int64_t layer_count) {
    if (layer_count > 1 && uabs(L.layer_stride) < uabs(L.token_stride))
        return KVIO_ORDER_LAYER_INNER;
    return KVIO_ORDER_TOKEN_INNER;
}

// Below 2^31 with room for a grid stride: all device index math is 32-bit. (The emulation
// build lowers it so tests cover the split.)
#ifndef KVIO_MAX_ITEMS_PER_LAUNCH
#define KVIO_MAX_ITEMS_PER_LAUNCH (1u << 30)
#endif
constexpr uint64_t kMaxItemsPerLaunch = KVIO_MAX_ITEMS_PER_LAUNCH;
static_assert(kMaxItemsPerLaunch <= (1u << 30), "device index math needs items < 2^30");

// Launch the copy kernel over n_tokens token pairs, split into launches of < 2^30 items.
// `p` carries everything but the per-launch fields. host_idx == nullptr: identity host index
// (the staging image), relative to each launch's first token.
hipError_t launch_copy(kvio_copy_params p, const void* host_idx, int host_idx_64,
                       const void* dev_idx, int dev_idx_64, int vec, int order, uint32_t n_kv,
                       uint32_t layer_count, uint32_t num_chunks, int64_t n_tokens,
                       hipStream_t stream) {
    if (n_tokens <= 0 || layer_count == 0) return hipSuccess;
    device_info info;
    hipError_t e = get_device_info(&info);
    if (e != hipSuccess) return e;
    const uint64_t vpc = (uint64_t)p.chunk_bytes / (uint64_t)vec;
    const uint64_t per_token = vpc * n_kv * layer_count * num_chunks;
    if (per_token == 0) return hipSuccess;
    if (per_token > kMaxItemsPerLaunch || vpc > 0x7fffffffull) return hipErrorInvalidValue;
    const int64_t tokens_per_launch = (int64_t)(kMaxItemsPerLaunch / per_token);
    const kvio_kernel_fn kernel = pick_kernel(vec, order);
    const uint64_t items_per_block_iter = (uint64_t)KVIO_UNROLL * KVIO_BLOCK_THREADS;
    const uint64_t max_blocks = (uint64_t)info.cus * 8;
    p.vpc = kvio_fastdiv_make((kvio_u32)vpc);
    p.host_idx_64 = host_idx_64 ? 1 : 0;
    p.dev_idx_64 = dev_idx_64 ? 1 : 0;
    const size_t hsz = host_idx_64 ? 8 : 4, dsz = dev_idx_64 ? 8 : 4;

    for (int64_t t0 = 0; t0 < n_tokens; t0 += tokens_per_launch) {
        const uint32_t nt = (uint32_t)std::min<int64_t>(tokens_per_launch, n_tokens - t0);
        p.host_idx = host_idx ? (kvio_u64)(uintptr_t)host_idx + (kvio_u64)t0 * hsz : 0;
        p.dev_idx = (kvio_u64)(uintptr_t)dev_idx + (kvio_u64)t0 * dsz;
        p.total = (kvio_u32)(per_token * nt);
        if (order == KVIO_ORDER_LAYER_INNER) {
            p.dim0 = kvio_fastdiv_make(layer_count);
            p.dim1 = kvio_fastdiv_make(nt);
            p.dim2 = kvio_fastdiv_make(num_chunks);
        } else {
            p.dim0 = kvio_fastdiv_make(nt);
            p.dim1 = kvio_fastdiv_make(num_chunks);
            p.dim2 = kvio_fastdiv_make(layer_count);
        }
        const uint64_t want = (p.total + items_per_block_iter - 1) / items_per_block_iter;
        p.num_blocks = (kvio_u32)std::max<uint64_t>(1, std::min(want, max_blocks));
        void* args[] = {&p};
        e = hipLaunchKernel(reinterpret_cast<const void*>(kernel), dim3(p.num_blocks),
                            dim3(KVIO_BLOCK_THREADS), args, 0, stream);
        if (e != hipSuccess) return e;
        e = hipGetLastError();
        if (e != hipSuccess) return e;
    }
    return hipSuccess;
}

bool layout_ok(const kvio_layout& L) {
    return L.page_size >= 1 && L.page_size <= 0x7fffffff && L.chunk_bytes >= 1 &&
           L.num_chunks >= 1 && L.num_chunks <= 0x7fffffff;
}

bool bounds_ok(const kvio_bounds* b) {
    return b != nullptr && b->report != nullptr && b->host_tokens >= 0 && b->device_tokens >= 0;
}

// Whether every one of the n CPU-resident host indices is in [0, host_tokens): the staged
// entries compute copy addresses from them on the host, so a bad one is refused before
// anything is enqueued.
bool host_indices_in_range(const int64_t* idx, int64_t n, int64_t host_tokens) {
    for (int64_t i = 0; i < n; ++i)
        if ((uint64_t)idx[i] >= (uint64_t)host_tokens) return false;
    return true;
}

kvio_copy_params base_params(const uint64_t* k_ptrs, const uint64_t* v_ptrs, void* host_base,
                             const kvio_layout& L, int32_t layer_begin, int direction,
                             const kvio_bounds& bounds) {
    kvio_copy_params p = {};
    p.host_tokens = bounds.host_tokens;
    p.device_tokens = bounds.device_tokens;
    p.report = (kvio_u64)(uintptr_t)bounds.report;
    p.epoch = bounds.epoch;
    p.k_ptrs = (kvio_u64)(uintptr_t)k_ptrs;
    p.v_ptrs = (kvio_u64)(uintptr_t)v_ptrs;
    p.host_base = (kvio_u64)(uintptr_t)host_base;
    p.kv_stride = L.kv_stride;
    p.layer_stride = L.layer_stride;
    p.page_stride = L.page_stride;
    p.token_stride = L.token_stride;
    p.chunk_stride = L.chunk_stride;
    p.chunk_bytes = L.chunk_bytes;
    p.elem_bytes = L.chunk_bytes * L.num_chunks;
    p.page = kvio_fastdiv_make((kvio_u32)L.page_size);
    p.layer_begin = layer_begin;
    p.direction = direction;
    return p;
}

// One host copy of a staged transfer: staging (device) -> host_base for a write-back, the
// other way for a load.
struct copy_run {
    char* dst;
    char* src;
    size_t bytes;
};

hipError_t issue_runs(std::vector<copy_run>& runs, kvio_batch_fn batch, hipMemcpyKind kind,
                      hipStream_t stream) {
    size_t start = 0;
    if (batch && !runs.empty()) {
        std::vector<void*> dsts(runs.size()), srcs(runs.size());
        std::vector<size_t> sizes(runs.size());
        for (size_t i = 0; i < runs.size(); ++i) {
            dsts[i] = runs[i].dst;
            srcs[i] = runs[i].src;
            sizes[i] = runs[i].bytes;
        }
        // No attributes (ROCm 7.1/7.2 reject numAttrs > 0); attrsIdxs still points at a 0.
        size_t attrs_idx = 0, fail = SIZE_MAX;
        const hipError_t e = batch(dsts.data(), srcs.data(), sizes.data(), runs.size(), nullptr,
                                   &attrs_idx, 0, &fail, stream);
        if (e == hipSuccess) return hipSuccess;
        if (e != hipErrorNotSupported) return e;
        // Not supported here: copy what the batch did not enqueue one by one.
        start = fail < runs.size() ? fail : 0;
    }
    for (size_t i = start; i < runs.size(); ++i) {
        const hipError_t e = hipMemcpyAsync(runs[i].dst, runs[i].src, runs[i].bytes, kind,
                                            stream);
        if (e != hipSuccess) return e;
    }
    return hipSuccess;
}

// The staged transfer of all layers of whole pages, chunk by chunk on the caller's stream.
// Write-back (direction 0): gather the chunk's pages into staging as the host page image, then
// copy each run of consecutive host pages out. Load (direction 1): copy the runs into staging,
// then scatter them into the pool. Stream order makes reusing the one buffer safe: the next
// chunk's first step is queued after this chunk's last.
hipError_t transfer_staged(int direction, const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                           int32_t num_layers, void* host_base, const kvio_layout& layout,
                           const int64_t* host_idx_cpu, const void* dev_idx, int dev_idx_64,
                           int64_t n_tokens, void* staging, int64_t staging_bytes,
                           int use_batched, void* stream, const kvio_bounds* bounds) {
    if ((direction != 0 && direction != 1) || n_tokens < 0 || num_layers < 0 ||
        !layout_ok(layout) || !bounds_ok(bounds))
        return hipErrorInvalidValue;
    const int64_t P = layout.page_size;
    if (n_tokens % P != 0) return hipErrorInvalidValue;
    if (n_tokens == 0 || num_layers == 0) return hipSuccess;
    if (!k_ptrs || !host_base || !host_idx_cpu || !dev_idx || !staging || staging_bytes <= 0)
        return hipErrorInvalidValue;
    const uint32_t n_kv = v_ptrs ? 2u : 1u;
    const int64_t elem = layout.chunk_bytes * layout.num_chunks;
    const int64_t page_bytes = (int64_t)num_layers * P * elem;
    // One page of K (or V) must be one contiguous run of page_bytes (page_first,
    // page_first_direct): its chunks tile [0, page_bytes) exactly. Or else the page's K and V
    // together one run of n_kv * page_bytes at page_stride (page_unified MHA, where they
    // alternate inside the page): then whole pages are staged and copied.
    if (layout.layer_stride < 0 || layout.token_stride < 0 || layout.chunk_stride < 0 ||
        layout.kv_stride < 0)
        return hipErrorInvalidValue;
    const int64_t span = layout.layer_stride * (num_layers - 1) + layout.token_stride * (P - 1) +
                         layout.chunk_stride * (layout.num_chunks - 1) + layout.chunk_bytes;
    const int64_t block_bytes = page_bytes * (int64_t)n_kv;
    const bool whole = span != page_bytes && n_kv == 2 &&
                       span + layout.kv_stride == block_bytes &&
                       layout.page_stride == block_bytes;
    if (span != page_bytes && !whole) return hipErrorInvalidValue;
    const int64_t pages_per_chunk = staging_bytes / block_bytes;
    if (pages_per_chunk < 1) return hipErrorInvalidValue;
    const int64_t n_pages = n_tokens / P;
    for (int64_t i = 0; i < n_pages; ++i)
        if (host_idx_cpu[i * P] < 0 || host_idx_cpu[i * P] % P != 0) return hipErrorInvalidValue;
    if (!host_indices_in_range(host_idx_cpu, n_tokens, bounds->host_tokens))
        return hipErrorInvalidValue;
    // The device side reads dev_idx on the device: the kernels check it against
    // device_tokens. The staging image's identity host index is always in range.
    kvio_bounds device_side = *bounds;
    device_side.host_tokens = INT64_MAX;

    const bool to_host = direction == 0;
    const hipMemcpyKind kind = to_host ? hipMemcpyDeviceToHost : hipMemcpyHostToDevice;
    const kvio_batch_fn batch = use_batched ? resolve_batch() : nullptr;
    const hipStream_t s = static_cast<hipStream_t>(stream);
    const size_t dsz = dev_idx_64 ? 8 : 4;
    char* const host = static_cast<char*>(host_base);
    char* const stage = static_cast<char*>(staging);
    std::vector<copy_run> runs;

    for (int64_t p0 = 0; p0 < n_pages; p0 += pages_per_chunk) {
        const int64_t np = std::min(pages_per_chunk, n_pages - p0);
        // The device side: staging as the host page image, [kv][page j][page_bytes] (whole
        // pages: [page j][the host page]), every offset inside a page exactly as on the host.
        // Same generic kernel, host side = staging with identity host indices (token t of
        // the chunk -> slot t).
        kvio_layout sl = layout;
        sl.page_stride = whole ? block_bytes : page_bytes;
        sl.kv_stride = whole ? layout.kv_stride : np * page_bytes;
        const kvio_copy_params p =
            base_params(k_ptrs, v_ptrs, staging, sl, 0, direction, device_side);
        const void* dev_chunk = static_cast<const char*>(dev_idx) + (size_t)(p0 * P) * dsz;
        auto relayout = [&]() {
            return launch_copy(p, nullptr, 1, dev_chunk, dev_idx_64, pick_vec(sl, staging),
                               pick_order(sl, num_layers), n_kv, (uint32_t)num_layers,
                               (uint32_t)layout.num_chunks, np * P, s);
        };
        // The host side: one copy per run of consecutive host pages (per K/V, or whole).
        runs.clear();
        const int64_t unit = whole ? block_bytes : page_bytes;
        for (uint32_t kv = 0; kv < (whole ? 1u : n_kv); ++kv) {
            for (int64_t j = 0; j < np; ++j) {
                const int64_t hp = host_idx_cpu[(p0 + j) * P] / P;
                char* h = host + kv * layout.kv_stride + hp * layout.page_stride;
                char* st = stage + kv * sl.kv_stride + j * unit;
                char* dst = to_host ? h : st;
                char* src = to_host ? st : h;
                if (!runs.empty() && runs.back().dst + runs.back().bytes == dst &&
                    runs.back().src + runs.back().bytes == src)
                    runs.back().bytes += (size_t)unit;
                else
                    runs.push_back(copy_run{dst, src, (size_t)unit});
            }
        }
        hipError_t e = to_host ? relayout() : issue_runs(runs, batch, kind, s);
        if (e != hipSuccess) return e;
        e = to_host ? issue_runs(runs, batch, kind, s) : relayout();
        if (e != hipSuccess) return e;
    }
    return hipSuccess;
}

} // namespace

extern "C" {

KVIO_API int kvio_abi_version(void) { return KVIO_ABI_VERSION; }

KVIO_API const char* kvio_error_string(int code) {
    return hipGetErrorString(static_cast<hipError_t>(code));
}

KVIO_API int kvio_has_batched_memcpy(void) { return resolve_batch() ? 1 : 0; }

KVIO_API int kvio_transfer_direct(int direction, const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                  int32_t layer_begin, int32_t layer_count, void* host_base,
                                  kvio_layout layout, const void* host_idx, int host_idx_64,
                                  const void* dev_idx, int dev_idx_64, int64_t n_tokens,
                                  void* stream, const kvio_bounds* bounds) {
    if ((direction != 0 && direction != 1) || n_tokens < 0 || layer_begin < 0 ||
        layer_count < 0 || !layout_ok(layout) || !bounds_ok(bounds))
        return hipErrorInvalidValue;
    if (n_tokens == 0 || layer_count == 0) return hipSuccess;
    if (!k_ptrs || !host_base || !host_idx || !dev_idx) return hipErrorInvalidValue;
    const int vec = pick_vec(layout, host_base);
    const int order = pick_order(layout, layer_count);
    const kvio_copy_params p = base_params(k_ptrs, v_ptrs, host_base, layout, layer_begin,
                                           direction, *bounds);
    return launch_copy(p, host_idx, host_idx_64, dev_idx, dev_idx_64, vec, order,
                       v_ptrs ? 2u : 1u, (uint32_t)layer_count, (uint32_t)layout.num_chunks,
                       n_tokens, static_cast<hipStream_t>(stream));
}

KVIO_API int kvio_write_back_staged(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                    int32_t num_layers, void* host_base, kvio_layout layout,
                                    const int64_t* host_idx_cpu, const void* dev_idx,
                                    int dev_idx_64, int64_t n_tokens, void* staging,
                                    int64_t staging_bytes, int use_batched, void* stream,
                                    const kvio_bounds* bounds) {
    return transfer_staged(0, k_ptrs, v_ptrs, num_layers, host_base, layout, host_idx_cpu,
                           dev_idx, dev_idx_64, n_tokens, staging, staging_bytes, use_batched,
                           stream, bounds);
}

KVIO_API int kvio_load_all_staged(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                  int32_t num_layers, void* host_base, kvio_layout layout,
                                  const int64_t* host_idx_cpu, const void* dev_idx,
                                  int dev_idx_64, int64_t n_tokens, void* staging,
                                  int64_t staging_bytes, int use_batched, void* stream,
                                  const kvio_bounds* bounds) {
    return transfer_staged(1, k_ptrs, v_ptrs, num_layers, host_base, layout, host_idx_cpu,
                           dev_idx, dev_idx_64, n_tokens, staging, staging_bytes, use_batched,
                           stream, bounds);
}

KVIO_API int kvio_copy_to_device(void* dst, const void* src, int64_t nbytes, void* stream) {
    if (!dst || !src || nbytes < 0) return hipErrorInvalidValue;
    if (nbytes == 0) return hipSuccess;
    return hipMemcpyAsync(dst, src, (size_t)nbytes, hipMemcpyHostToDevice,
                          static_cast<hipStream_t>(stream));
}

} // extern "C"
