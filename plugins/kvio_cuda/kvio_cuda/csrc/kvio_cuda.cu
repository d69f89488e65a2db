// kvio_cuda: NVIDIA kernels behind the kvcore native transfer ABI (docs/native-abi.md).
//
// These entry points move KV-cache bytes between the device pool (one tensor per layer and
// per K/V) and a host buffer described by the strides of a kvio_layout:
//
//   kvio_transfer_direct    one generic strided copy kernel, either direction, any layout,
//                           any layer range; the host side is touched directly by the SMs.
//   kvio_write_back_staged  device gather into a staging buffer laid out as the host page
//                           image, then one (batched) DMA copy per run of host pages.
//   kvio_load_all_staged    (optional) the reverse: DMA of whole host pages into staging,
//                           then a device scatter into the pool.
//   kvio_transfer_direct_chained  (optional) the same, for the second and later layers of
//                           one per-layer load: may read the host before the previous layer's
//                           kernel has finished (see copy_body).
//   kvio_load_layer_dma     (optional) one layer by the copy engine, runs of consecutive slots.
//   kvio_load_layers_signaled  (optional) a per-layer load of every layer in one grid, layer
//                           after layer, each group of layers raising their ready flags;
//                           kvio_wait_layer_signal makes a stream wait for one flag;
//                           kvio_signaled_layer_group says how many layers land together.
//   kvio_transfer_direct_inline  (optional) kvio_transfer_direct with host indices read
//                           from CPU memory during the call and carried in the launch: up
//                           to KVIO_INLINE_INDEX_TOKENS tokens, or KVIO_INLINE_INDEX_PAGES
//                           whole pages.
//   kvio_load_layers_signaled_inline  (optional) the same for the signaled load (no upload,
//                           no event).
//   kvio_copy_to_device     (optional) one asynchronous copy of pinned host bytes to the
//                           device (the index ring's upload, without torch's dispatch).
//   kvio_write_back_staged_async / _after  (optional) the staged write-back as a job: issued
//                           by a library thread, or by the caller with its host copy
//                           overlapping the next write-back's gather.
//
// The geometry comes from Python (kvcore.layout); the kernels never derive it. Everything
// here returns a cudaError_t as int (0 = success) and checks every runtime call.

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

// The ABI's structs and prototypes come from kvcore's kvio_abi.h (built with
// -I kvcore.native_abi.INCLUDE_DIR). KVIO_API carries extern "C" here, so a definition below
// that does not match its prototype fails to compile instead of exporting a C++ overload.
#define KVIO_API extern "C" __attribute__((visibility("default")))
#include "kvio_abi.h"

#define KVIO_CHECK(expr)                          \
    do {                                          \
        const cudaError_t kvio_err_ = (expr);     \
        if (kvio_err_ != cudaSuccess) {           \
            return kvio_err_;                     \
        }                                         \
    } while (0)

// Tuning knobs, for experiments only (KVIO_CUDA_TUNE in build.py sets them; the defaults
// are what ships and what the CI's SASS checks see).
#ifndef KVIO_UNROLL
#define KVIO_UNROLL 4
#endif
#ifndef KVIO_BLOCKS_PER_SM
#define KVIO_BLOCKS_PER_SM 4
#endif
// Copies per batched memcpy call, 0: all copies of a call in one. An experiment knob: on the
// H200 one batch of 64 copies cost the CPU 33 us, one of 128 about 120 us
// (docs/benchmarks/h200-2026-12-03/README.md).
#ifndef KVIO_DMA_BATCH
#define KVIO_DMA_BATCH 0
#endif
#ifndef KVIO_PIPELINE_CHUNKS
#define KVIO_PIPELINE_CHUNKS 2
#endif
static_assert(KVIO_PIPELINE_CHUNKS >= 2 && KVIO_PIPELINE_CHUNKS <= 64,
              "KVIO_PIPELINE_CHUNKS must be in [2, 64]");
static_assert(KVIO_UNROLL >= 1 && KVIO_UNROLL <= 16, "KVIO_UNROLL must be in [1, 16]");
static_assert(KVIO_DMA_BATCH >= 0, "KVIO_DMA_BATCH must be >= 0");
static_assert(KVIO_BLOCKS_PER_SM >= 1 && KVIO_BLOCKS_PER_SM <= 8,
              "KVIO_BLOCKS_PER_SM must be in [1, 8]");

namespace {

constexpr int kAbiVersion = KVIO_ABI_VERSION;
constexpr int kThreads = 256;      // threads per block
constexpr int kUnroll = KVIO_UNROLL;  // vectors in flight per thread (loads before stores)
constexpr int kBlocksPerSm = KVIO_BLOCKS_PER_SM;  // default 4: 1024 threads, <= 64 regs each
constexpr int kMaxDevices = 256;
constexpr int64_t kTile = int64_t(kThreads) * kUnroll;  // vectors per block per iteration
// A staged transfer that fits into the staging buffer is split into chunks (so the device
// relayout of one chunk overlaps the DMA of the next) only above this size.
constexpr int64_t kPipelineMinBytes = int64_t(16) << 20;
constexpr int64_t kPipelineChunks = KVIO_PIPELINE_CHUNKS;  // aimed for (staging allows)

enum Direction : int { kDeviceToHost = 0, kHostToDevice = 1 };

// ---------------------------------------------------------------------------------------
// Kernel parameters
// ---------------------------------------------------------------------------------------

// One copy "unit" is one chunk (chunk_bytes contiguous on both sides) of one
// (kv, token, layer, chunk) tuple. The work is the flat array
//     [kv][d0][d1][d2][vec]
// where (d0, d1, d2) is a permutation of (token, layer, chunk) chosen at launch so that the
// dimension with the smallest host stride is innermost: consecutive threads then touch
// consecutive host addresses (the PCIe side is the one that matters).
struct CopyParams {
    const uint64_t* ptrs[2];  // per-layer device base pointers of K and V (V unused for MLA)
    char* host;               // host_base (or a staging buffer, seen as a host image)
    int64_t kv_stride;
    int64_t layer_stride;
    int64_t page_stride;
    int64_t token_stride;
    int64_t chunk_stride;
    int64_t page_size;
    int64_t chunk_bytes;
    int64_t elem_bytes;       // device bytes per token and layer = num_chunks * chunk_bytes
    const void* host_idx;     // nullptr: identity (host token = t), used for staging
    const void* dev_idx;
    // ABI v2 bounds: a vector whose host index is outside [0, host_tokens) or whose device
    // index is outside [0, device_tokens) is skipped and reported (see locate). The identity
    // host index of a staging image is always in range: host_tokens is INT64_MAX there.
    int64_t host_tokens;
    int64_t device_tokens;
    kvio_report* report;
    uint64_t epoch;
    uint64_t total;           // number of vectors
    uint64_t nvec;            // vectors per chunk
    uint64_t size[3];         // sizes of d0, d1, d2
    int32_t host_idx_64;
    int32_t dev_idx_64;
    int32_t layer_begin;
    int32_t page_shift;       // log2(page_size) when a power of two, else -1
    int32_t pos_token;        // which of d0/d1/d2 is the token, layer, chunk dimension
    int32_t pos_layer;
    int32_t pos_chunk;
};

// ---------------------------------------------------------------------------------------
// Memory access primitives. Host-side accesses are streaming (no L1 allocation on loads,
// evict-first on stores); device-side loads skip L1 too (each byte is read once); device
// stores are plain so freshly loaded KV stays in L2 for the attention that follows.
// ---------------------------------------------------------------------------------------

template <int VEC>
struct Vec;

template <>
struct Vec<16> {
    uint32_t x, y, z, w;
    __device__ __forceinline__ void load(const char* p) {
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(x), "=r"(y), "=r"(z), "=r"(w)
                     : "l"(p));
    }
    __device__ __forceinline__ void store_streaming(char* p) const {
        asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(x), "r"(y),
                     "r"(z), "r"(w)
                     : "memory");
    }
    __device__ __forceinline__ void store(char* p) const {
        asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(x), "r"(y),
                     "r"(z), "r"(w)
                     : "memory");
    }
};

template <>
struct Vec<8> {
    uint32_t x, y;
    __device__ __forceinline__ void load(const char* p) {
        asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
                     : "=r"(x), "=r"(y)
                     : "l"(p));
    }
    __device__ __forceinline__ void store_streaming(char* p) const {
        asm volatile("st.global.cs.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(x), "r"(y) : "memory");
    }
    __device__ __forceinline__ void store(char* p) const {
        asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(x), "r"(y) : "memory");
    }
};

template <>
struct Vec<4> {
    uint32_t x;
    __device__ __forceinline__ void load(const char* p) {
        asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(x) : "l"(p));
    }
    __device__ __forceinline__ void store_streaming(char* p) const {
        asm volatile("st.global.cs.u32 [%0], %1;" ::"l"(p), "r"(x) : "memory");
    }
    __device__ __forceinline__ void store(char* p) const {
        asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(x) : "memory");
    }
};

template <>
struct Vec<2> {
    uint16_t x;
    __device__ __forceinline__ void load(const char* p) {
        asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(x) : "l"(p));
    }
    __device__ __forceinline__ void store_streaming(char* p) const {
        asm volatile("st.global.cs.u16 [%0], %1;" ::"l"(p), "h"(x) : "memory");
    }
    __device__ __forceinline__ void store(char* p) const {
        asm volatile("st.global.u16 [%0], %1;" ::"l"(p), "h"(x) : "memory");
    }
};

template <>
struct Vec<1> {
    uint16_t x;  // PTX has no 8-bit registers; .u8 loads zero-extend, stores truncate
    __device__ __forceinline__ void load(const char* p) {
        asm volatile("ld.global.nc.L1::no_allocate.u8 %0, [%1];" : "=h"(x) : "l"(p));
    }
    __device__ __forceinline__ void store_streaming(char* p) const {
        asm volatile("st.global.cs.u8 [%0], %1;" ::"l"(p), "h"(x) : "memory");
    }
    __device__ __forceinline__ void store(char* p) const {
        asm volatile("st.global.u8 [%0], %1;" ::"l"(p), "h"(x) : "memory");
    }
};

// Stores into the destination with the hint of its side: streaming for the host.
template <int DIR, int VEC>
__device__ __forceinline__ void store_dst(char* p, const Vec<VEC>& v) {
    if (DIR == kDeviceToHost) {
        v.store_streaming(p);
    } else {
        v.store(p);
    }
}

__device__ __forceinline__ int64_t load_index(const void* idx, int32_t is64, uint64_t t) {
    if (is64) {
        return static_cast<int64_t>(__ldg(static_cast<const long long*>(idx) + t));
    }
    return static_cast<int64_t>(__ldg(static_cast<const int*>(idx) + t));
}

template <typename IdxT>
__device__ __forceinline__ IdxT pick(int32_t pos, IdxT i0, IdxT i1, IdxT i2) {
    return pos == 0 ? i0 : (pos == 1 ? i1 : i2);
}

// An out-of-range index seen by one thread: which side(s) and one bad value of each, kept in
// registers until the thread's stores (report_bad), so an EARLY kernel stores nothing
// before its dependency wait.
struct BadIndex {
    int64_t host_value;
    int64_t device_value;
    uint32_t sides;  // bit 0: host, bit 1: device
};

// One plain system-scope store into the report (pinned host memory): relaxed, not an atomic
// read-modify-write (host memory need not support PCIe atomics).
__device__ __forceinline__ void report_store(uint64_t* field, uint64_t value) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(field), "l"(value) : "memory");
}

// Records the bad values one thread saw: value first, then epoch, per side. Racing threads
// all store some bad value and the same epoch.
__device__ __forceinline__ void report_bad(const CopyParams& p, const BadIndex& bad) {
    if (bad.sides & 1u) {
        report_store(reinterpret_cast<uint64_t*>(&p.report->host_value),
                     static_cast<uint64_t>(bad.host_value));
        report_store(&p.report->host_epoch, p.epoch);
    }
    if (bad.sides & 2u) {
        report_store(reinterpret_cast<uint64_t*>(&p.report->device_value),
                     static_cast<uint64_t>(bad.device_value));
        report_store(&p.report->device_epoch, p.epoch);
    }
}

// Host token indices carried in the launch itself (kvio_transfer_direct_inline,
// kvio_load_layers_signaled_inline): the kernel reads them from its parameter space, so
// nothing uploads them and nothing waits for an upload. Token t's host index is
// v[t >> page_shift] + (t & (2^page_shift - 1)): page_shift 0 carries one index per token
// (at most KVIO_INLINE_INDEX_TOKENS), page_shift log2(page_size) one per whole page (its first
// token's index; at most KVIO_INLINE_INDEX_PAGES pages). Values fit int32: read_inline checked
// each token against host_tokens on the CPU. With the other kernel arguments they stay within
// the 4 KiB every architecture accepts.
struct InlineIndices {
    int32_t v[KVIO_INLINE_INDEX_TOKENS];
    uint32_t page_shift;
};
static_assert(KVIO_INLINE_INDEX_PAGES == KVIO_INLINE_INDEX_TOKENS,
              "InlineIndices::v holds either");

// Host and device addresses of flat vector g (g < p.total); the flat work's layers start at
// layer_begin. False, with the bad value(s) noted in `bad`, when an index is out of its
// bounds: the vector is then skipped (nothing else is read for it, nothing is stored).
// INL: the host indices are `inl` (a __grid_constant__ argument).
template <int VEC, typename IdxT, bool INL = false>
__device__ __forceinline__ bool locate(const CopyParams& p, IdxT g, int64_t layer_begin,
                                       char*& host, char*& dev, BadIndex& bad,
                                       const InlineIndices* inl = nullptr) {
    const IdxT nvec = static_cast<IdxT>(p.nvec);
    const IdxT s0 = static_cast<IdxT>(p.size[0]);
    const IdxT s1 = static_cast<IdxT>(p.size[1]);
    const IdxT s2 = static_cast<IdxT>(p.size[2]);
    IdxT u = g / nvec;
    const IdxT v = g - u * nvec;
    const IdxT i2 = u % s2;
    u /= s2;
    const IdxT i1 = u % s1;
    u /= s1;
    const IdxT i0 = u % s0;
    const IdxT kv = u / s0;
    const IdxT t = pick(p.pos_token, i0, i1, i2);
    const IdxT l = pick(p.pos_layer, i0, i1, i2);
    const IdxT c = pick(p.pos_chunk, i0, i1, i2);

    int64_t h;
    if constexpr (INL) {
        const uint32_t shift = inl->page_shift;
        h = static_cast<int64_t>(inl->v[t >> shift]) + (t & ((IdxT(1) << shift) - 1));
    } else {
        h = p.host_idx ? load_index(p.host_idx, p.host_idx_64, t) : static_cast<int64_t>(t);
    }
    const int64_t d = load_index(p.dev_idx, p.dev_idx_64, t);
    // One unsigned compare per side also catches negative values.
    const bool host_ok = static_cast<uint64_t>(h) < static_cast<uint64_t>(p.host_tokens);
    const bool dev_ok = static_cast<uint64_t>(d) < static_cast<uint64_t>(p.device_tokens);
    if (!(host_ok && dev_ok)) {
        if (!host_ok) {
            bad.sides |= 1u;
            bad.host_value = h;
        }
        if (!dev_ok) {
            bad.sides |= 2u;
            bad.device_value = d;
        }
        return false;
    }
    int64_t page, in_page;
    if (p.page_shift >= 0) {
        page = h >> p.page_shift;
        in_page = h & (p.page_size - 1);
    } else {
        page = h / p.page_size;
        in_page = h - page * p.page_size;
    }
    const int64_t layer = layer_begin + static_cast<int64_t>(l);
    const int64_t vec_off = static_cast<int64_t>(v) * VEC;
    const int64_t chunk = static_cast<int64_t>(c);

    host = p.host + static_cast<int64_t>(kv) * p.kv_stride + layer * p.layer_stride +
           page * p.page_stride + in_page * p.token_stride + chunk * p.chunk_stride + vec_off;
    const uint64_t* table = kv ? p.ptrs[1] : p.ptrs[0];
    char* base = reinterpret_cast<char*>(static_cast<uintptr_t>(__ldg(
        reinterpret_cast<const unsigned long long*>(table) + layer)));
    dev = base + d * p.elem_bytes + chunk * p.chunk_bytes + vec_off;
    return true;
}

// Programmatic dependent launch (Hopper and newer, see launch_copy): wait for the preceding
// kernel of the stream to complete and flush, then let the next launch of the stream get
// scheduled while this grid drains. Triggering only after the wait is what makes an EARLY
// kernel behind this one sound (see copy_body). Both are no-ops for a plain launch.
__device__ __forceinline__ void dependency_wait_then_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// One tile of a copy: kTile consecutive flat vectors from `base`, thread x handling vectors
// x, x + kThreads, ... so that every load/store instruction of a warp covers 32 consecutive
// vectors. All loads of a thread are issued (load) before its stores (store) to keep
// kUnroll * VEC bytes per thread in flight.
//
// Host strides and host_base are folded into VEC at launch; the device layer pointers are
// only known here, so a vector whose addresses are not VEC-aligned is copied byte by byte
// (correct for any pointer, fast only when aligned).
template <int DIR, int VEC, typename IdxT, bool INL = false>
struct Tile {
    const char* src[kUnroll];
    char* dst[kUnroll];
    int state[kUnroll];  // 0: past the end or a bad index, 1: aligned vector, 2: misaligned
    Vec<VEC> val[kUnroll];
    BadIndex bad;

    __device__ __forceinline__ void load(const CopyParams& p, IdxT base, IdxT total,
                                         int64_t layer_begin,
                                         const InlineIndices* inl = nullptr) {
        bad.sides = 0;
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            const IdxT g = base + static_cast<IdxT>(k * kThreads) + static_cast<IdxT>(threadIdx.x);
            state[k] = 0;
            src[k] = nullptr;
            dst[k] = nullptr;
            char* host;
            char* dev;
            if (g < total && locate<VEC, IdxT, INL>(p, g, layer_begin, host, dev, bad, inl)) {
                src[k] = DIR == kDeviceToHost ? dev : host;
                dst[k] = DIR == kDeviceToHost ? host : dev;
                const uintptr_t bits =
                    reinterpret_cast<uintptr_t>(host) | reinterpret_cast<uintptr_t>(dev);
                state[k] = (bits & (VEC - 1)) == 0 ? 1 : 2;
            }
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            if (state[k] == 1) {
                val[k].load(src[k]);
            }
        }
    }

    // Stores the loaded vectors, then reports any bad index this thread saw (after the
    // dependency wait in every kernel).
    __device__ __forceinline__ void store(const CopyParams& p) const {
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            if (state[k] == 1) {
                store_dst<DIR, VEC>(dst[k], val[k]);
            } else if (VEC > 1 && state[k] == 2) {
#pragma unroll 1
                for (int b = 0; b < VEC; ++b) {
                    Vec<1> one;
                    one.load(src[k] + b);
                    store_dst<DIR, 1>(dst[k] + b, one);
                }
            }
        }
        if (bad.sides != 0) {
            report_bad(p, bad);
        }
    }
};

// The copy kernel body: each block walks tiles of the flat work (grid-stride).
//
// EARLY (the chained per-layer load, kvio_transfer_direct_chained): each block issues the
// loads of its first tile BEFORE the dependency wait and stores only after it. The caller
// guarantees the preceding kernel is an earlier layer of the same load, which writes neither
// the host buffer, the indices nor the layer tables read here; and since every copy kernel
// releases its dependents only after its own wait, everything before that kernel has
// completed once this grid runs. Otherwise every memory access follows the wait.
// INL: the host indices are `inl` (kvio_transfer_direct_inline), not p.host_idx.
template <int DIR, int VEC, typename IdxT, bool EARLY, bool INL = false>
__device__ __forceinline__ void copy_body(const CopyParams& p,
                                          const InlineIndices* inl = nullptr) {
    bool waited = !EARLY;
    if (!EARLY) {
        dependency_wait_then_release();
    }
    const IdxT total = static_cast<IdxT>(p.total);
    const IdxT tile = static_cast<IdxT>(kTile);
    for (IdxT base = static_cast<IdxT>(blockIdx.x) * tile; base < total;
         base += static_cast<IdxT>(gridDim.x) * tile) {
        Tile<DIR, VEC, IdxT, INL> t;
        t.load(p, base, total, p.layer_begin, inl);
        if (EARLY && !waited) {
            dependency_wait_then_release();
            waited = true;
        }
        t.store(p);
    }
    if (EARLY && !waited) {  // a block without a tile still orders its dependents
        dependency_wait_then_release();
    }
}

__device__ __forceinline__ void fence_acq_rel_gpu() {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

// Signals of one signaled load: the layers land in groups of `group` consecutive layers (one
// wave of the grid, signaled_geometry); per group a count of the warps' tile parts that landed
// (zero at the launch; the warp that completes the group zeroes it again), and per layer a
// ready flag that is set to `epoch` once every layer of its group is in the pool.
struct Signals {
    uint32_t* counters;
    uint32_t* flags;
    uint32_t epoch;
    uint32_t group;
};

// The signaled per-layer load (kvio_load_layers_signaled): every layer in one grid, layer
// after layer. p describes ONE layer (its flat work is p.total vectors, layer_begin 0), so a
// tile never spans two layers. Tiles go to blocks in order (grid-stride), so the layers land
// in order, a wave of the grid at a time, without the launch gaps of one kernel per layer.
// Each warp counts its part of a tile in its group's counter once its stores are fenced (no
// block barrier: the warps of a block run on independently, as in copy_body); the warp whose
// count completes a group raises the flags of the group's layers, one lane per flag, with
// system-scope release, so a stream waiting on a flag (cuStreamWaitValue32) sees the data of
// the whole group. The warp that completes a group never waits for another one: raising the
// flags in layer order instead (one cursor over the layers) cost 3% of the rate, at every size
// (h200-2026-12-05b).
// INL: the host indices are `inl` (kvio_load_layers_signaled_inline), not p.host_idx.
template <int VEC, typename IdxT, bool INL = false>
__device__ __forceinline__ void signaled_body(const CopyParams& p, int32_t num_layers,
                                              Signals sig,
                                              const InlineIndices* inl = nullptr) {
    constexpr uint32_t kWarps = kThreads / 32;
    const IdxT per_layer = static_cast<IdxT>(p.total);
    const uint64_t tiles_per_layer = (p.total + kTile - 1) / kTile;
    const uint64_t tiles = tiles_per_layer * static_cast<uint64_t>(num_layers);
    const uint32_t counts_per_layer = static_cast<uint32_t>(tiles_per_layer) * kWarps;
    const uint32_t lane = threadIdx.x & 31;
    for (uint64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
        const uint64_t layer = t / tiles_per_layer;
        const IdxT base = static_cast<IdxT>((t - layer * tiles_per_layer) * kTile);
        Tile<kHostToDevice, VEC, IdxT, INL> tile;
        tile.load(p, base, per_layer, static_cast<int64_t>(layer), inl);
        tile.store(p);
        fence_acq_rel_gpu();  // this thread's stores before the warp's count
        __syncwarp();
        const uint32_t group = static_cast<uint32_t>(layer) / sig.group;
        const uint32_t first = group * sig.group;
        const uint32_t layers = min(sig.group, static_cast<uint32_t>(num_layers) - first);
        uint32_t completed = 0;
        if (lane == 0 && atomicAdd(sig.counters + group, 1u) + 1 == layers * counts_per_layer) {
            fence_acq_rel_gpu();  // every other warp's stores (seen through its count) first
            atomicExch(sig.counters + group, 0u);  // the last count: zero for the next load
            completed = 1;
        }
        if (__shfl_sync(0xffffffffu, completed, 0) != 0) {
            __syncwarp();  // lane 0's fence before every lane's flag
            for (uint32_t l = lane; l < layers; l += 32) {
                asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(sig.flags + first + l),
                             "r"(sig.epoch)
                             : "memory");
            }
        }
    }
}

}  // namespace

// Named instantiations (extern "C" so the SASS, profilers and tests show readable names).
// d2h: device -> host (write-back, and the staging gather); h2d: host -> device (load).
// vN: vector bytes; i32/i64: width of the flat work index.
// The 64-bit variants (flat work of 2^31 vectors and more) get twice the registers: with the
// v2 bounds checks they spill in 64 on sm_80 (as the signaled ones do everywhere).
constexpr int kWideBlocksPerSm = kBlocksPerSm > 1 ? kBlocksPerSm / 2 : 1;
template <typename IdxT>
constexpr int blocks_per_sm() { return sizeof(IdxT) == 8 ? kWideBlocksPerSm : kBlocksPerSm; }

#define KVIO_COPY_KERNEL_EX(NAME, DIR, VEC, IDXT, EARLY)                              \
    extern "C" __global__ void __launch_bounds__(kThreads, blocks_per_sm<IDXT>())     \
        NAME(const CopyParams p) {                                                    \
        copy_body<DIR, VEC, IDXT, EARLY>(p);                                          \
    }
#define KVIO_COPY_KERNEL(NAME, DIR, VEC, IDXT) KVIO_COPY_KERNEL_EX(NAME, DIR, VEC, IDXT, false)

KVIO_COPY_KERNEL(kvio_copy_d2h_v16_i32, kDeviceToHost, 16, uint32_t)
KVIO_COPY_KERNEL(kvio_copy_d2h_v16_i64, kDeviceToHost, 16, uint64_t)
KVIO_COPY_KERNEL(kvio_copy_d2h_v8_i32, kDeviceToHost, 8, uint32_t)
KVIO_COPY_KERNEL(kvio_copy_d2h_v8_i64, kDeviceToHost, 8, uint64_t)
KVIO_COPY_KERNEL(kvio_copy_d2h_v4_i32, kDeviceToHost, 4, uint32_t)
KVIO_COPY_KERNEL(kvio_copy_d2h_v4_i64, kDeviceToHost, 4, uint64_t)
KVIO_COPY_KERNEL(kvio_copy_d2h_v2_i32, kDeviceToHost, 2, uint32_t)
KVIO_COPY_KERNEL(kvio_copy_d2h_v2_i64, kDeviceToHost, 2, uint64_t)
KVIO_COPY_KERNEL(kvio_copy_d2h_v1_i32, kDeviceToHost, 1, uint32_t)
KVIO_COPY_KERNEL(kvio_copy_d2h_v1_i64, kDeviceToHost, 1, uint64_t)
KVIO_COPY_KERNEL(kvio_copy_h2d_v16_i32, kHostToDevice, 16, uint32_t)
KVIO_COPY_KERNEL(kvio_copy_h2d_v16_i64, kHostToDevice, 16, uint64_t)
KVIO_COPY_KERNEL(kvio_copy_h2d_v8_i32, kHostToDevice, 8, uint32_t)
KVIO_COPY_KERNEL(kvio_copy_h2d_v8_i64, kHostToDevice, 8, uint64_t)
KVIO_COPY_KERNEL(kvio_copy_h2d_v4_i32, kHostToDevice, 4, uint32_t)
KVIO_COPY_KERNEL(kvio_copy_h2d_v4_i64, kHostToDevice, 4, uint64_t)
KVIO_COPY_KERNEL(kvio_copy_h2d_v2_i32, kHostToDevice, 2, uint32_t)
KVIO_COPY_KERNEL(kvio_copy_h2d_v2_i64, kHostToDevice, 2, uint64_t)
KVIO_COPY_KERNEL(kvio_copy_h2d_v1_i32, kHostToDevice, 1, uint32_t)
KVIO_COPY_KERNEL(kvio_copy_h2d_v1_i64, kHostToDevice, 1, uint64_t)
// early: the chained per-layer load's 16-byte kernels (host reads before the dependency wait)
KVIO_COPY_KERNEL_EX(kvio_copy_h2d_v16_i32_early, kHostToDevice, 16, uint32_t, true)
KVIO_COPY_KERNEL_EX(kvio_copy_h2d_v16_i64_early, kHostToDevice, 16, uint64_t, true)

// inline: the direct copies with the host indices in the launch (InlineIndices), either
// direction; 32-bit flat indices only (the caller keeps its inline transfers under 2^31)
#define KVIO_COPY_INLINE_KERNEL(NAME, DIR, VEC)                                       \
    extern "C" __global__ void __launch_bounds__(kThreads, kBlocksPerSm)              \
        NAME(const CopyParams p, const __grid_constant__ InlineIndices inl) {         \
        copy_body<DIR, VEC, uint32_t, false, true>(p, &inl);                          \
    }
KVIO_COPY_INLINE_KERNEL(kvio_copy_inline_d2h_v16_i32, kDeviceToHost, 16)
KVIO_COPY_INLINE_KERNEL(kvio_copy_inline_d2h_v8_i32, kDeviceToHost, 8)
KVIO_COPY_INLINE_KERNEL(kvio_copy_inline_d2h_v4_i32, kDeviceToHost, 4)
KVIO_COPY_INLINE_KERNEL(kvio_copy_inline_d2h_v2_i32, kDeviceToHost, 2)
KVIO_COPY_INLINE_KERNEL(kvio_copy_inline_d2h_v1_i32, kDeviceToHost, 1)
KVIO_COPY_INLINE_KERNEL(kvio_copy_inline_h2d_v16_i32, kHostToDevice, 16)
KVIO_COPY_INLINE_KERNEL(kvio_copy_inline_h2d_v8_i32, kHostToDevice, 8)
KVIO_COPY_INLINE_KERNEL(kvio_copy_inline_h2d_v4_i32, kHostToDevice, 4)
KVIO_COPY_INLINE_KERNEL(kvio_copy_inline_h2d_v2_i32, kHostToDevice, 2)
KVIO_COPY_INLINE_KERNEL(kvio_copy_inline_h2d_v1_i32, kHostToDevice, 1)

// signaled: the per-layer load of every layer in one grid, with per-layer ready flags. The
// 64-bit variants (layers of 2^31 vectors and more) get twice the registers: with 64 they
// spill.
#define KVIO_SIGNALED_KERNEL(NAME, VEC, IDXT, BLOCKS_PER_SM)                          \
    extern "C" __global__ void __launch_bounds__(kThreads, BLOCKS_PER_SM)             \
        NAME(const CopyParams p, int32_t num_layers, Signals sig) {                   \
        signaled_body<VEC, IDXT>(p, num_layers, sig);                                 \
    }
KVIO_SIGNALED_KERNEL(kvio_signaled_h2d_v16_i32, 16, uint32_t, kBlocksPerSm)
KVIO_SIGNALED_KERNEL(kvio_signaled_h2d_v16_i64, 16, uint64_t, kWideBlocksPerSm)
KVIO_SIGNALED_KERNEL(kvio_signaled_h2d_v8_i32, 8, uint32_t, kBlocksPerSm)
KVIO_SIGNALED_KERNEL(kvio_signaled_h2d_v8_i64, 8, uint64_t, kWideBlocksPerSm)
KVIO_SIGNALED_KERNEL(kvio_signaled_h2d_v4_i32, 4, uint32_t, kBlocksPerSm)
KVIO_SIGNALED_KERNEL(kvio_signaled_h2d_v4_i64, 4, uint64_t, kWideBlocksPerSm)
KVIO_SIGNALED_KERNEL(kvio_signaled_h2d_v2_i32, 2, uint32_t, kBlocksPerSm)
KVIO_SIGNALED_KERNEL(kvio_signaled_h2d_v2_i64, 2, uint64_t, kWideBlocksPerSm)
KVIO_SIGNALED_KERNEL(kvio_signaled_h2d_v1_i32, 1, uint32_t, kBlocksPerSm)
KVIO_SIGNALED_KERNEL(kvio_signaled_h2d_v1_i64, 1, uint64_t, kWideBlocksPerSm)
// signaled_inline: the same with the host indices in the launch (InlineIndices); 32-bit
// flat indices only, as the inline copies.
#define KVIO_SIGNALED_INLINE_KERNEL(NAME, VEC)                                        \
    extern "C" __global__ void __launch_bounds__(kThreads, kBlocksPerSm)              \
        NAME(const CopyParams p, int32_t num_layers, Signals sig,                     \
             const __grid_constant__ InlineIndices inl) {                             \
        signaled_body<VEC, uint32_t, true>(p, num_layers, sig, &inl);                 \
    }
KVIO_SIGNALED_INLINE_KERNEL(kvio_signaled_inline_h2d_v16_i32, 16)
KVIO_SIGNALED_INLINE_KERNEL(kvio_signaled_inline_h2d_v8_i32, 8)
KVIO_SIGNALED_INLINE_KERNEL(kvio_signaled_inline_h2d_v4_i32, 4)
KVIO_SIGNALED_INLINE_KERNEL(kvio_signaled_inline_h2d_v2_i32, 2)
KVIO_SIGNALED_INLINE_KERNEL(kvio_signaled_inline_h2d_v1_i32, 1)
// sets flags[0, n) to epoch (a signaled load with no tokens: every layer is ready at once)
extern "C" __global__ void kvio_set_flags(uint32_t* flags, int32_t n, uint32_t epoch) {
    for (int32_t i = static_cast<int32_t>(threadIdx.x); i < n; i += blockDim.x) {
        asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flags + i), "r"(epoch)
                     : "memory");
    }
}

namespace {

using CopyKernel = void (*)(const CopyParams);

// [direction][log2(VEC)][flat index is 64-bit]
const CopyKernel kCopyKernels[2][5][2] = {
    {{kvio_copy_d2h_v1_i32, kvio_copy_d2h_v1_i64},
     {kvio_copy_d2h_v2_i32, kvio_copy_d2h_v2_i64},
     {kvio_copy_d2h_v4_i32, kvio_copy_d2h_v4_i64},
     {kvio_copy_d2h_v8_i32, kvio_copy_d2h_v8_i64},
     {kvio_copy_d2h_v16_i32, kvio_copy_d2h_v16_i64}},
    {{kvio_copy_h2d_v1_i32, kvio_copy_h2d_v1_i64},
     {kvio_copy_h2d_v2_i32, kvio_copy_h2d_v2_i64},
     {kvio_copy_h2d_v4_i32, kvio_copy_h2d_v4_i64},
     {kvio_copy_h2d_v8_i32, kvio_copy_h2d_v8_i64},
     {kvio_copy_h2d_v16_i32, kvio_copy_h2d_v16_i64}},
};

// [flat index is 64-bit]
const CopyKernel kEarlyLoadKernels[2] = {kvio_copy_h2d_v16_i32_early,
                                         kvio_copy_h2d_v16_i64_early};

using SignaledKernel = void (*)(const CopyParams, int32_t, Signals);

// [log2(VEC)][flat index of one layer is 64-bit]
const SignaledKernel kSignaledKernels[5][2] = {
    {kvio_signaled_h2d_v1_i32, kvio_signaled_h2d_v1_i64},
    {kvio_signaled_h2d_v2_i32, kvio_signaled_h2d_v2_i64},
    {kvio_signaled_h2d_v4_i32, kvio_signaled_h2d_v4_i64},
    {kvio_signaled_h2d_v8_i32, kvio_signaled_h2d_v8_i64},
    {kvio_signaled_h2d_v16_i32, kvio_signaled_h2d_v16_i64},
};

using CopyInlineKernel = void (*)(const CopyParams, const InlineIndices);

// [direction][log2(VEC)]
const CopyInlineKernel kCopyInlineKernels[2][5] = {
    {kvio_copy_inline_d2h_v1_i32, kvio_copy_inline_d2h_v2_i32, kvio_copy_inline_d2h_v4_i32,
     kvio_copy_inline_d2h_v8_i32, kvio_copy_inline_d2h_v16_i32},
    {kvio_copy_inline_h2d_v1_i32, kvio_copy_inline_h2d_v2_i32, kvio_copy_inline_h2d_v4_i32,
     kvio_copy_inline_h2d_v8_i32, kvio_copy_inline_h2d_v16_i32},
};

using SignaledInlineKernel = void (*)(const CopyParams, int32_t, Signals,
                                      const InlineIndices);

// [log2(VEC)]
const SignaledInlineKernel kSignaledInlineKernels[5] = {
    kvio_signaled_inline_h2d_v1_i32, kvio_signaled_inline_h2d_v2_i32,
    kvio_signaled_inline_h2d_v4_i32, kvio_signaled_inline_h2d_v8_i32,
    kvio_signaled_inline_h2d_v16_i32,
};
// every argument of a launch, laid out in order with the alignment of each (the limit older
// drivers and architectures accept)
static_assert(sizeof(CopyParams) + 2 * sizeof(uint64_t) + sizeof(Signals) +
                      sizeof(InlineIndices) <= 4096,
              "the inline signaled kernel's arguments must fit 4 KiB");

// ---------------------------------------------------------------------------------------
// Host helpers
// ---------------------------------------------------------------------------------------

bool is_legacy_stream(cudaStream_t s) { return s == nullptr || s == cudaStreamLegacy; }

// Whether `stream` is being captured into a graph (the legacy NULL stream never is).
cudaError_t is_capturing(cudaStream_t stream, bool* out) {
    *out = false;
    if (!is_legacy_stream(stream)) {
        cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
        KVIO_CHECK(cudaStreamIsCapturing(stream, &status));
        *out = status != cudaStreamCaptureStatusNone;
    }
    return cudaSuccess;
}

// Makes the device of `stream` current for the scope (kernels and streams must be launched
// and created on their own device; a caller's background thread may have another current
// device) and restores the caller's device afterwards.
class DeviceGuard {
  public:
    DeviceGuard() = default;
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;
    ~DeviceGuard() {
        if (changed_) {
            (void)cudaSetDevice(previous_);
        }
    }

    cudaError_t enter(cudaStream_t stream) {
        KVIO_CHECK(cudaGetDevice(&previous_));
        device_ = previous_;
#if CUDART_VERSION >= 12080
        if (!is_legacy_stream(stream) && stream != cudaStreamPerThread) {
            int stream_device = -1;
            if (cudaStreamGetDevice(stream, &stream_device) == cudaSuccess) {
                device_ = stream_device;
            } else {
                // Older driver or a capture mode that refuses the query: the current device
                // is the best answer; do not leave the (non-sticky) error behind.
                (void)cudaGetLastError();
            }
        }
#else
        (void)stream;
#endif
        if (device_ != previous_) {
            KVIO_CHECK(cudaSetDevice(device_));
            changed_ = true;
        }
        return cudaSuccess;
    }

    int device() const { return device_; }

  private:
    int previous_ = 0;
    int device_ = 0;
    bool changed_ = false;
};

std::mutex g_mutex;

struct DeviceInfo {
    int sms = 0;           // 0: not queried yet
    bool pdl = false;      // programmatic dependent launch (compute capability >= 9.0)
};
DeviceInfo g_device_info[kMaxDevices];
cudaStream_t g_side_stream[kMaxDevices] = {};
cudaStream_t g_dma_stream[kMaxDevices] = {};

// KVIO_CUDA_PDL=0 turns programmatic dependent launch off (for A/B measurements).
bool pdl_enabled_by_env() {
    static const bool enabled = [] {
        const char* v = std::getenv("KVIO_CUDA_PDL");
        return v == nullptr || std::strcmp(v, "0") != 0;
    }();
    return enabled;
}

cudaError_t device_info(int device, DeviceInfo* out) {
    if (device < 0 || device >= kMaxDevices) {
        return cudaErrorInvalidDevice;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    DeviceInfo& info = g_device_info[device];
    if (info.sms == 0) {
        int sms = 0, major = 0;
        KVIO_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
        KVIO_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        info.pdl = major >= 9;
        info.sms = sms > 0 ? sms : 1;
    }
    *out = info;
    return cudaSuccess;
}

// The stream of `device` in `streams`, created on first use (the device must be current)
// under the mutex and kept for the life of the process.
cudaError_t lazy_stream(cudaStream_t (&streams)[kMaxDevices], int device, cudaStream_t* out) {
    if (device < 0 || device >= kMaxDevices) {
        return cudaErrorInvalidDevice;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    if (streams[device] == nullptr) {
        cudaStream_t s = nullptr;
        KVIO_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        streams[device] = s;
    }
    *out = streams[device];
    return cudaSuccess;
}

// The internal copy stream of a device (the staged pipeline's side stream).
cudaError_t side_stream(int device, cudaStream_t* out) {
    return lazy_stream(g_side_stream, device, out);
}

// The internal stream of a device for per-layer DMA loads issued on the legacy default
// stream (kvio_load_layer_dma). Separate from the staged pipeline's side stream, so a staged
// transfer in flight on another stream never delays a per-layer load.
cudaError_t dma_stream(int device, cudaStream_t* out) {
    return lazy_stream(g_dma_stream, device, out);
}

// -------- cudaMemcpyBatchAsync, resolved at run time from the cudart we are linked to ------

#if CUDART_VERSION >= 13000
// CUDA 13.0: the failIdx arguments are gone.
typedef cudaError_t (*BatchFn)(void* const*, const void* const*, const size_t*, size_t,
                               cudaMemcpyAttributes*, size_t*, size_t, cudaStream_t);
typedef cudaError_t (*Batch3DFn)(size_t, cudaMemcpy3DBatchOp*, unsigned long long,
                                 cudaStream_t);
#define KVIO_HAVE_BATCH 1
#elif CUDART_VERSION >= 12080
// CUDA 12.8 / 12.9: ..., size_t numAttrs, size_t* failIdx, cudaStream_t stream.
typedef cudaError_t (*BatchFn)(void* const*, const void* const*, const size_t*, size_t,
                               cudaMemcpyAttributes*, size_t*, size_t, size_t*, cudaStream_t);
typedef cudaError_t (*Batch3DFn)(size_t, cudaMemcpy3DBatchOp*, size_t*, unsigned long long,
                                 cudaStream_t);
#define KVIO_HAVE_BATCH 1
#else
#define KVIO_HAVE_BATCH 0
#endif

#if KVIO_HAVE_BATCH
std::once_flag g_batch_once;
BatchFn g_batch_fn = nullptr;
Batch3DFn g_batch3d_fn = nullptr;
bool g_batch_disabled = false;  // set when the driver refuses it; guarded by g_mutex

// Only the libcudart this library was linked against is searched: its SONAME carries the
// major version the signatures above were chosen for. dladdr on one of its functions finds
// that exact library even when it was loaded RTLD_LOCAL (ctypes, torch wheels).
void* cudart_symbol(const char* name) {
    void* sym = nullptr;
    Dl_info info = {};
    if (dladdr(reinterpret_cast<void*>(&cudaGetErrorString), &info) != 0 &&
        info.dli_fname != nullptr) {
        void* handle = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
        if (handle != nullptr) {
            sym = dlsym(handle, name);
            dlclose(handle);  // drops only the reference taken by RTLD_NOLOAD
        }
    }
    if (sym == nullptr) {
        const char* soname = CUDART_VERSION >= 13000 ? "libcudart.so.13" : "libcudart.so.12";
        void* handle = dlopen(soname, RTLD_NOW | RTLD_NOLOAD);
        if (handle != nullptr) {
            sym = dlsym(handle, name);
            dlclose(handle);
        }
    }
    return sym;
}

void resolve_batch() {
    int driver = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess || driver < 12080) {
        (void)cudaGetLastError();
        return;  // the driver has no cuMemcpyBatchAsync behind the runtime's entry point
    }
    g_batch_fn = reinterpret_cast<BatchFn>(cudart_symbol("cudaMemcpyBatchAsync"));
    g_batch3d_fn = reinterpret_cast<Batch3DFn>(cudart_symbol("cudaMemcpy3DBatchAsync"));
}

BatchFn batch_fn() {
    std::call_once(g_batch_once, resolve_batch);
    std::lock_guard<std::mutex> lock(g_mutex);
    return g_batch_disabled ? nullptr : g_batch_fn;
}

Batch3DFn batch3d_fn() {
    std::call_once(g_batch_once, resolve_batch);
    std::lock_guard<std::mutex> lock(g_mutex);
    return g_batch_disabled ? nullptr : g_batch3d_fn;
}

void disable_batch() {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_batch_disabled = true;
}

// The runtime has the batched entry points but the driver refuses them.
bool batch_refused(cudaError_t err) {
    return err == cudaErrorNotSupported || err == cudaErrorCallRequiresNewerDriver;
}
#endif

// -------- cuStreamWaitValue32, resolved at run time through the runtime's driver entry points

// CUresult cuStreamWaitValue32(CUstream, CUdeviceptr, cuuint32_t, unsigned int)
typedef int (*WaitValue32Fn)(cudaStream_t, unsigned long long, unsigned int, unsigned int);
constexpr unsigned kWaitValueGeq = 0;  // CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - v) >= 0
std::once_flag g_wait_once;
WaitValue32Fn g_wait_fn = nullptr;

void resolve_wait() {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000,
                                                             cudaEnableDefault, &found);
#else
    const cudaError_t err =
        cudaGetDriverEntryPoint("cuStreamWaitValue32", &fn, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        return;
    }
    g_wait_fn = reinterpret_cast<WaitValue32Fn>(fn);
}

WaitValue32Fn wait_fn() {
    std::call_once(g_wait_once, resolve_wait);
    return g_wait_fn;
}

// Largest power of two <= 16 dividing x (x == 0 divides everything).
int vector_width(uint64_t x) {
    int vec = 16;
    while (vec > 1 && (x & static_cast<uint64_t>(vec - 1)) != 0) {
        vec >>= 1;
    }
    return vec;
}

int log2_exact(int64_t x) {  // log2(x) when x is a power of two, else -1
    if (x <= 0 || (x & (x - 1)) != 0) {
        return -1;
    }
    int s = 0;
    while ((int64_t(1) << s) != x) {
        ++s;
    }
    return s;
}

bool layout_ok(const kvio_layout& L) {
    return L.page_size > 0 && L.chunk_bytes > 0 && L.num_chunks > 0 && L.kv_stride >= 0 &&
           L.layer_stride >= 0 && L.page_stride >= 0 && L.token_stride >= 0 &&
           L.chunk_stride >= 0;
}

// a * b into *out; false on overflow past 2^62 (far beyond any real transfer).
bool mul_ok(uint64_t a, uint64_t b, uint64_t* out) {
    const uint64_t limit = uint64_t(1) << 62;
    if (a != 0 && b > limit / a) {
        return false;
    }
    *out = a * b;
    return true;
}

// Fills the work decomposition of p (vector width, dimension order, flat size) and returns
// the vector width in *vec. layer_count, n_tokens > 0; p.total == 0 when there is no work.
cudaError_t plan_copy(CopyParams& p, int num_kv, int64_t n_tokens, int32_t layer_count,
                      int64_t num_chunks, int* vec_out) {
    // Vector width from every host-known quantity that offsets an address.
    uint64_t bits = static_cast<uint64_t>(p.chunk_bytes) |
                    static_cast<uint64_t>(p.token_stride) |
                    static_cast<uint64_t>(p.page_stride) |
                    static_cast<uint64_t>(p.layer_stride) |
                    static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p.host));
    if (num_kv > 1) bits |= static_cast<uint64_t>(p.kv_stride);
    if (num_chunks > 1) bits |= static_cast<uint64_t>(p.chunk_stride);
    const int vec = vector_width(bits);
    p.nvec = static_cast<uint64_t>(p.chunk_bytes / vec);
    p.page_shift = log2_exact(p.page_size);

    // Order (token, layer, chunk) by host stride, largest outermost (stable; ties keep
    // token > layer > chunk). Dimensions of size 1 go outermost: they do not matter.
    struct Dim {
        int64_t stride;
        uint64_t size;
        int id;  // 0 token, 1 layer, 2 chunk
    };
    Dim dims[3] = {{p.token_stride, static_cast<uint64_t>(n_tokens), 0},
                   {p.layer_stride, static_cast<uint64_t>(layer_count), 1},
                   {p.chunk_stride, static_cast<uint64_t>(num_chunks), 2}};
    auto outer_first = [](const Dim& a, const Dim& b) {  // true when a must precede b
        const bool a1 = a.size == 1, b1 = b.size == 1;
        if (a1 != b1) return a1;
        return a.stride > b.stride;
    };
    for (int i = 1; i < 3; ++i) {  // insertion sort, stable
        for (int j = i; j > 0 && outer_first(dims[j], dims[j - 1]); --j) {
            const Dim tmp = dims[j];
            dims[j] = dims[j - 1];
            dims[j - 1] = tmp;
        }
    }
    for (int i = 0; i < 3; ++i) {
        p.size[i] = dims[i].size;
        if (dims[i].id == 0) p.pos_token = i;
        if (dims[i].id == 1) p.pos_layer = i;
        if (dims[i].id == 2) p.pos_chunk = i;
    }

    uint64_t total = static_cast<uint64_t>(num_kv);
    if (!mul_ok(total, p.size[0], &total) || !mul_ok(total, p.size[1], &total) ||
        !mul_ok(total, p.size[2], &total) || !mul_ok(total, p.nvec, &total)) {
        return cudaErrorInvalidValue;
    }
    p.total = total;
    *vec_out = vec;
    return cudaSuccess;
}

// 32-bit flat indices while base + tile + grid stride cannot wrap.
bool needs_wide_index(uint64_t total) { return total > (uint64_t(1) << 31); }

// Blocks of a grid over `tiles` tiles: one per tile, at most kBlocksPerSm per SM.
unsigned grid_size(const DeviceInfo& info, uint64_t tiles) {
    const uint64_t max_blocks = static_cast<uint64_t>(info.sms) * kBlocksPerSm;
    return static_cast<unsigned>(tiles < max_blocks ? tiles : max_blocks);
}

// Plans and launches the copy kernel on `stream` (whose device must be current).
// layer_count, n_tokens > 0. `chained`: the caller's guarantee of
// kvio_transfer_direct_chained, which lets a 16-byte load use its EARLY kernel.
// inl: the host indices travel in the launch (the inline kernels; never the early ones).
cudaError_t launch_copy(int direction, CopyParams p, int num_kv, int64_t n_tokens,
                        int32_t layer_count, int64_t num_chunks, int device, bool chained,
                        cudaStream_t stream, const InlineIndices* inl = nullptr) {
    int vec = 0;
    KVIO_CHECK(plan_copy(p, num_kv, n_tokens, layer_count, num_chunks, &vec));
    if (p.total == 0) {
        return cudaSuccess;
    }
    const bool wide = needs_wide_index(p.total);
    if (inl != nullptr && wide) {  // (the inline kernels index 32-bit: the caller's limit)
        return cudaErrorInvalidValue;
    }
    DeviceInfo info;
    KVIO_CHECK(device_info(device, &info));
    const unsigned grid = grid_size(info, (p.total + kTile - 1) / kTile);
    const int vec_log2 = log2_exact(vec);
    const bool early = chained && direction == kHostToDevice && vec == 16 && inl == nullptr;
    const CopyKernel kernel = early ? kEarlyLoadKernels[wide ? 1 : 0]
                                    : kCopyKernels[direction][vec_log2][wide ? 1 : 0];

    // Programmatic dependent launch lets this grid be scheduled while the previous kernel of
    // the stream drains (the kernel waits for it before any memory access, see copy_body):
    // it hides the launch gap between the back-to-back per-layer loads. Only on Hopper and
    // newer, on real (non-legacy) streams, and not under graph capture (older runtimes do
    // not capture programmatic edges).
    bool pdl = info.pdl && pdl_enabled_by_env() && !is_legacy_stream(stream);
    if (pdl) {
        bool capturing = false;
        KVIO_CHECK(is_capturing(stream, &capturing));
        pdl = !capturing;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1] = {};
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    if (inl != nullptr) {
        KVIO_CHECK(cudaLaunchKernelEx(&cfg, kCopyInlineKernels[direction][vec_log2], p, *inl));
    } else {
        KVIO_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
    }
    return cudaGetLastError();
}

// The n host indices at `idx` (CPU memory, int64 or int32) into `out`, read here on the CPU:
// one per token where n <= KVIO_INLINE_INDEX_TOKENS, else one per page where they are whole
// pages of page_size (a power of two; each page's indices count up by one from a multiple of
// it) and there are at most KVIO_INLINE_INDEX_PAGES. Anything else, or an index outside
// [0, bounds.host_tokens), is refused before anything is enqueued; the caller's memory is
// free once the call returns.
cudaError_t read_inline(const void* idx, int is64, int64_t n, int64_t page_size,
                        const kvio_bounds& bounds, InlineIndices* out) {
    const int64_t limit = bounds.host_tokens < INT32_MAX ? bounds.host_tokens : INT32_MAX;
    auto at = [&](int64_t i) -> int64_t {
        return is64 ? static_cast<const int64_t*>(idx)[i] : static_cast<const int32_t*>(idx)[i];
    };
    if (n <= KVIO_INLINE_INDEX_TOKENS) {
        for (int64_t i = 0; i < n; ++i) {
            const int64_t h = at(i);
            if (static_cast<uint64_t>(h) >= static_cast<uint64_t>(limit)) {
                return cudaErrorInvalidValue;
            }
            out->v[i] = static_cast<int32_t>(h);
        }
        out->page_shift = 0;
        return cudaSuccess;
    }
    const int64_t P = page_size;
    if (P < 2 || (P & (P - 1)) != 0 || n % P != 0 || n / P > KVIO_INLINE_INDEX_PAGES) {
        return cudaErrorInvalidValue;
    }
    for (int64_t page = 0; page < n / P; ++page) {
        const int64_t h0 = at(page * P);
        // (a page's last token is its largest: one compare bounds the page)
        if (h0 < 0 || h0 % P != 0 || h0 > limit - P) {
            return cudaErrorInvalidValue;
        }
        for (int64_t j = 1; j < P; ++j) {
            if (at(page * P + j) != h0 + j) {
                return cudaErrorInvalidValue;
            }
        }
        out->v[page] = static_cast<int32_t>(h0);
    }
    out->page_shift = static_cast<uint32_t>(log2_exact(P));
    return cudaSuccess;
}

// Whether `b` is usable: v2 callers always pass bounds with a report.
bool bounds_ok(const kvio_bounds* b) {
    return b != nullptr && b->report != nullptr && b->host_tokens >= 0 && b->device_tokens >= 0;
}

// Whether the n CPU-resident indices all lie in [0, tokens) (one unsigned compare each).
bool cpu_indices_in_range(const int64_t* idx, int64_t n, int64_t tokens) {
    for (int64_t i = 0; i < n; ++i) {
        if (static_cast<uint64_t>(idx[i]) >= static_cast<uint64_t>(tokens)) {
            return false;
        }
    }
    return true;
}

// The copy of a staging image: its identity host index is always in range, the device
// indices are checked against the bounds.
CopyParams base_params(const uint64_t* k_ptrs, const uint64_t* v_ptrs, void* host,
                       const kvio_layout& L, const kvio_bounds& bounds) {
    CopyParams p = {};
    p.host_tokens = INT64_MAX;
    p.device_tokens = bounds.device_tokens;
    p.report = bounds.report;
    p.epoch = bounds.epoch;
    p.ptrs[0] = k_ptrs;
    p.ptrs[1] = v_ptrs;
    p.host = static_cast<char*>(host);
    p.kv_stride = L.kv_stride;
    p.layer_stride = L.layer_stride;
    p.page_stride = L.page_stride;
    p.token_stride = L.token_stride;
    p.chunk_stride = L.chunk_stride;
    p.page_size = L.page_size;
    p.chunk_bytes = L.chunk_bytes;
    p.elem_bytes = L.chunk_bytes * L.num_chunks;
    return p;
}

// base_params with device-readable token indices (the direct and signaled kernels).
CopyParams indexed_params(const uint64_t* k_ptrs, const uint64_t* v_ptrs, void* host,
                          const kvio_layout& L, const void* host_idx, int host_idx_64,
                          const void* dev_idx, int dev_idx_64, const kvio_bounds& bounds) {
    CopyParams p = base_params(k_ptrs, v_ptrs, host, L, bounds);
    p.host_tokens = bounds.host_tokens;
    p.host_idx = host_idx;
    p.host_idx_64 = host_idx_64 ? 1 : 0;
    p.dev_idx = dev_idx;
    p.dev_idx_64 = dev_idx_64 ? 1 : 0;
    return p;
}

// True when, for every page, the bytes of all (token, layer, chunk) of one K/V form exactly
// the run [0, page_bytes) of that page (page_first, page_first_direct, page_head); with
// num_kv 2, of all (kv, token, layer, chunk): the page's K and V together form the run
// [0, 2 * page_bytes) (MHA page_unified, whose K and V alternate inside the page).
bool page_is_contiguous(const kvio_layout& L, int32_t num_layers, int64_t page_bytes,
                        int num_kv = 1) {
    struct Dim {
        int64_t stride;
        int64_t size;
    };
    Dim dims[4] = {{L.token_stride, L.page_size},
                   {L.layer_stride, num_layers},
                   {L.chunk_stride, L.num_chunks},
                   {L.kv_stride, num_kv}};
    for (int i = 1; i < 4; ++i) {  // ascending stride
        for (int j = i; j > 0 && dims[j].stride < dims[j - 1].stride; --j) {
            const Dim tmp = dims[j];
            dims[j] = dims[j - 1];
            dims[j - 1] = tmp;
        }
    }
    int64_t expected = L.chunk_bytes;
    for (int i = 0; i < 4; ++i) {
        if (dims[i].size == 1) continue;
        if (dims[i].stride != expected) return false;
        expected *= dims[i].size;
    }
    return expected == page_bytes * num_kv;
}

// Enqueues the 1D copies dsts[i] <- srcs[i] of sizes[i] bytes: cudaMemcpyBatchAsync calls of
// up to KVIO_DMA_BATCH copies (all in one by default) when `batched` and the runtime has it
// (never on the legacy NULL stream, which it refuses), else one cudaMemcpyAsync each. A driver
// that refuses the batched call turns it off for good.
cudaError_t copy_runs(const std::vector<void*>& dsts, const std::vector<const void*>& srcs,
                      const std::vector<size_t>& sizes, cudaMemcpyKind kind, bool batched,
                      cudaStream_t stream) {
    size_t done = 0;  // copies enqueued so far
#if KVIO_HAVE_BATCH
    BatchFn fn = batched && !is_legacy_stream(stream) ? batch_fn() : nullptr;
    const size_t per_batch = KVIO_DMA_BATCH > 0 ? size_t(KVIO_DMA_BATCH) : sizes.size();
    while (fn != nullptr && done < sizes.size()) {
        const size_t n = sizes.size() - done < per_batch ? sizes.size() - done : per_batch;
        cudaMemcpyAttributes attr = {};
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        size_t attr_idx = 0;
        void* const* d = const_cast<void* const*>(dsts.data()) + done;
#if CUDART_VERSION >= 13000
        const cudaError_t err =
            fn(d, srcs.data() + done, sizes.data() + done, n, &attr, &attr_idx, 1, stream);
#else
        size_t fail_idx = 0;
        const cudaError_t err = fn(d, srcs.data() + done, sizes.data() + done, n, &attr,
                                   &attr_idx, 1, &fail_idx, stream);
#endif
        if (batch_refused(err)) {  // the rest one by one
            (void)cudaGetLastError();
            disable_batch();
            break;
        }
        KVIO_CHECK(err);
        done += n;
    }
#else
    (void)batched;
#endif
    for (size_t i = done; i < sizes.size(); ++i) {
        KVIO_CHECK(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], kind, stream));
    }
    return cudaSuccess;
}

// Issues the DMA copies of one staged chunk, pages [p0, p0 + cp), between their images in
// `buf` ([kv][page] runs of page_bytes; whole pages: [page] runs of num_kv * page_bytes, K
// and V inside) and their host pages: to the host for a write-back, from it for a load.
// Runs contiguous on both sides are merged. Page i's first host token is
// host_idx_cpu[i * host_step]: every token's index (host_step = page size) or only each
// page's first (1).
cudaError_t issue_copies(int direction, char* buf, int64_t p0, int64_t cp, int num_kv,
                         int64_t page_bytes, char* host_base, const kvio_layout& L,
                         const int64_t* host_idx_cpu, int64_t host_step, bool batched,
                         cudaStream_t stream, bool whole = false) {
    if (whole) {  // one run of the whole page (K and V) per page
        page_bytes *= num_kv;
        num_kv = 1;
    }
    const bool to_host = direction == kDeviceToHost;
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<size_t> sizes;
    dsts.reserve(static_cast<size_t>(cp * num_kv));
    srcs.reserve(static_cast<size_t>(cp * num_kv));
    sizes.reserve(static_cast<size_t>(cp * num_kv));
    for (int kv = 0; kv < num_kv; ++kv) {
        for (int64_t s = 0; s < cp; ++s) {
            const int64_t h0 = host_idx_cpu[(p0 + s) * host_step];
            char* host = host_base + kv * L.kv_stride + (h0 / L.page_size) * L.page_stride;
            char* stage = buf + (kv * cp + s) * page_bytes;
            char* dst = to_host ? host : stage;
            const char* src = to_host ? stage : host;
            if (!sizes.empty() &&
                static_cast<char*>(dsts.back()) + sizes.back() == dst &&
                static_cast<const char*>(srcs.back()) + sizes.back() == src) {
                sizes.back() += static_cast<size_t>(page_bytes);
            } else {
                dsts.push_back(dst);
                srcs.push_back(src);
                sizes.push_back(static_cast<size_t>(page_bytes));
            }
        }
    }
    return copy_runs(dsts, srcs, sizes,
                     to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, batched,
                     stream);
}

// N events per device for the calling thread, made on first use (events belong to the device
// current when they are created; an event create and destroy per call cost microseconds of CPU)
// and destroyed when the thread ends. Reusing them across calls is safe: a wait captures the
// event's state when it is enqueued, so re-recording it later never changes an earlier wait.
template <int N>
struct ThreadEvents {
    cudaEvent_t events[kMaxDevices][N] = {};
    ThreadEvents() = default;
    ThreadEvents(const ThreadEvents&) = delete;
    ThreadEvents& operator=(const ThreadEvents&) = delete;
    ~ThreadEvents() {
        for (auto& device : events) {
            for (cudaEvent_t& e : device) {
                if (e != nullptr) (void)cudaEventDestroy(e);
            }
        }
    }
};

// This thread's N events of `device` (ThreadEvents<N>), created where missing.
template <int N>
cudaError_t thread_events(int device, cudaEvent_t** out) {
    if (device < 0 || device >= kMaxDevices) {
        return cudaErrorInvalidDevice;
    }
    thread_local ThreadEvents<N> cache;
    for (cudaEvent_t& e : cache.events[device]) {
        if (e == nullptr) {
            KVIO_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        }
    }
    *out = cache.events[device];
    return cudaSuccess;
}

// Events of one pipelined staged transfer. Chunk i uses staging half i % 2 in two steps: a
// fill (the gather of a write-back, on the caller's stream; the DMA of a load, on the side
// stream), then a drain on the other stream (the DMA of a write-back; the scatter of a
// load). The events are this thread's (thread_events). If the call stops early after
// side-stream work was enqueued, the destructor still makes the caller's stream wait for that
// work so the staging buffer is never reused under a running copy.
class Pipeline {
  public:
    Pipeline(cudaStream_t caller, cudaStream_t side, bool fill_on_side)
        : caller_(caller),
          side_(side),
          fill_(fill_on_side ? side : caller),
          drain_(fill_on_side ? caller : side) {}
    Pipeline(const Pipeline&) = delete;
    Pipeline& operator=(const Pipeline&) = delete;
    ~Pipeline() {
        if (side_pending_) {
            cudaEvent_t e = nullptr;
            if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess) {
                if (cudaEventRecord(e, side_) == cudaSuccess) {
                    (void)cudaStreamWaitEvent(caller_, e, 0);
                }
                (void)cudaEventDestroy(e);
            }
        }
    }

    // Takes this thread's three events of `device` (thread_events). A fill on the side stream
    // first waits for everything the caller enqueued before this call (which may still be
    // writing the host pages it reads).
    cudaError_t init(int device) {
        cudaEvent_t* e = nullptr;
        KVIO_CHECK(thread_events<3>(device, &e));
        filled_ = e[0];
        drained_[0] = e[1];
        drained_[1] = e[2];
        if (fill_ == side_) {
            KVIO_CHECK(cudaEventRecord(filled_, caller_));
            side_pending_ = true;
            KVIO_CHECK(cudaStreamWaitEvent(side_, filled_, 0));
        }
        return cudaSuccess;
    }

    // Before filling half b: wait for the drain that last used it (two chunks ago).
    cudaError_t before_fill(int b) {
        if (drained_recorded_[b]) {
            KVIO_CHECK(cudaStreamWaitEvent(fill_, drained_[b], 0));
        }
        return cudaSuccess;
    }

    // After a fill: the draining stream waits for it.
    cudaError_t after_fill() {
        KVIO_CHECK(cudaEventRecord(filled_, fill_));
        side_pending_ = true;  // from here on the side stream may hold work of this call
        KVIO_CHECK(cudaStreamWaitEvent(drain_, filled_, 0));
        return cudaSuccess;
    }

    cudaError_t after_drain(int b) {
        KVIO_CHECK(cudaEventRecord(drained_[b], drain_));
        drained_recorded_[b] = true;
        last_ = b;
        return cudaSuccess;
    }

    // The caller's stream waits for the last drain where that ran on the side stream (which
    // runs in order); a drain on the caller's stream has already followed every fill.
    cudaError_t join() {
        if (drain_ == side_ && last_ >= 0) {
            KVIO_CHECK(cudaStreamWaitEvent(caller_, drained_[last_], 0));
        }
        side_pending_ = false;
        return cudaSuccess;
    }

  private:
    cudaStream_t caller_;
    cudaStream_t side_;
    cudaStream_t fill_;
    cudaStream_t drain_;
    cudaEvent_t filled_ = nullptr;
    cudaEvent_t drained_[2] = {nullptr, nullptr};
    bool drained_recorded_[2] = {false, false};
    bool side_pending_ = false;
    int last_ = -1;
};

}  // namespace

// ---------------------------------------------------------------------------------------
// The C ABI
// ---------------------------------------------------------------------------------------

KVIO_API int kvio_abi_version(void) { return kAbiVersion; }

KVIO_API const char* kvio_error_string(int code) {
    return cudaGetErrorString(static_cast<cudaError_t>(code));
}

KVIO_API int kvio_has_batched_memcpy(void) {
#if KVIO_HAVE_BATCH
    return batch_fn() != nullptr ? 1 : 0;
#else
    return 0;
#endif
}

namespace {

// The checks of a direct transfer, made before anything is enqueued: *nothing set where it
// moves no byte (a success). INLINE_HOST: host_idx is CPU memory, read here into `inl`.
cudaError_t check_direct(int direction, const uint64_t* k_ptrs, int32_t layer_begin,
                         int32_t layer_count, void* host_base, const kvio_layout& layout,
                         const void* host_idx, int host_idx_64, const void* dev_idx,
                         int64_t n_tokens, const kvio_bounds* bounds, bool inline_host,
                         InlineIndices* inl, bool* nothing) {
    if ((direction != kDeviceToHost && direction != kHostToDevice) || k_ptrs == nullptr ||
        host_base == nullptr || layer_begin < 0 || layer_count < 0 || n_tokens < 0 ||
        !layout_ok(layout) || !bounds_ok(bounds)) {
        return cudaErrorInvalidValue;
    }
    *nothing = n_tokens == 0 || layer_count == 0;
    if (*nothing) {
        return cudaSuccess;
    }
    if (host_idx == nullptr || dev_idx == nullptr) {
        return cudaErrorInvalidValue;
    }
    return inline_host
               ? read_inline(host_idx, host_idx_64, n_tokens, layout.page_size, *bounds, inl)
               : cudaSuccess;
}

// A checked direct transfer's launch on `s` (its device entered by `guard`).
cudaError_t launch_direct(int direction, const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                          int32_t layer_begin, int32_t layer_count, void* host_base,
                          const kvio_layout& layout, const void* host_idx, int host_idx_64,
                          const void* dev_idx, int dev_idx_64, int64_t n_tokens, bool chained,
                          cudaStream_t s, const DeviceGuard& guard, const kvio_bounds& bounds,
                          const InlineIndices* inl) {
    CopyParams p = indexed_params(k_ptrs, v_ptrs, host_base, layout,
                                  inl != nullptr ? nullptr : host_idx, host_idx_64, dev_idx,
                                  dev_idx_64, bounds);
    p.layer_begin = layer_begin;
    const int num_kv = v_ptrs != nullptr ? 2 : 1;
    return launch_copy(direction, p, num_kv, n_tokens, layer_count, layout.num_chunks,
                       guard.device(), chained, s, inl);
}

cudaError_t transfer_direct(int direction, const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                            int32_t layer_begin, int32_t layer_count, void* host_base,
                            const kvio_layout& layout, const void* host_idx, int host_idx_64,
                            const void* dev_idx, int dev_idx_64, int64_t n_tokens,
                            bool chained, void* stream, const kvio_bounds* bounds,
                            bool inline_host = false) {
    InlineIndices inl;
    bool nothing = false;
    KVIO_CHECK(check_direct(direction, k_ptrs, layer_begin, layer_count, host_base, layout,
                            host_idx, host_idx_64, dev_idx, n_tokens, bounds, inline_host, &inl,
                            &nothing));
    if (nothing) {
        return cudaSuccess;
    }
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    DeviceGuard guard;
    KVIO_CHECK(guard.enter(s));
    return launch_direct(direction, k_ptrs, v_ptrs, layer_begin, layer_count, host_base, layout,
                         host_idx, host_idx_64, dev_idx, dev_idx_64, n_tokens, chained, s, guard,
                         *bounds, inline_host ? &inl : nullptr);
}

// The launch of a signaled load: vector width, tiles per layer, grid (plans `p`) and how many
// consecutive layers land together: the first wave of the grid moves that many (its blocks
// take the tiles in order), and so does each later wave (1 to num_layers).
struct SignaledGeometry {
    int vec = 0;
    uint64_t tiles_per_layer = 0;
    unsigned grid = 0;
    uint32_t group = 1;
};

cudaError_t signaled_geometry(CopyParams& p, int num_kv, int64_t n_tokens, int32_t num_layers,
                              int64_t num_chunks, int device, SignaledGeometry* out) {
    KVIO_CHECK(plan_copy(p, num_kv, n_tokens, 1, num_chunks, &out->vec));
    out->tiles_per_layer = (p.total + kTile - 1) / kTile;
    uint64_t tiles = 0;
    if (out->tiles_per_layer == 0 ||
        !mul_ok(out->tiles_per_layer, static_cast<uint64_t>(num_layers), &tiles) ||
        out->tiles_per_layer > UINT32_MAX / (kThreads / 32)) {  // 32-bit counts of warps
        return cudaErrorInvalidValue;
    }
    DeviceInfo info;
    KVIO_CHECK(device_info(device, &info));
    out->grid = grid_size(info, tiles);
    const uint64_t per_wave = out->grid / out->tiles_per_layer;
    const uint64_t layers = static_cast<uint64_t>(num_layers);
    out->group = static_cast<uint32_t>(per_wave < 1 ? 1 : per_wave < layers ? per_wave : layers);
    return cudaSuccess;
}

// The arguments of a signaled load, checked before anything is enqueued
// (cudaErrorInvalidValue for any it cannot carry out).
cudaError_t check_signaled(const uint64_t* k_ptrs, int32_t num_layers, void* host_base,
                           const kvio_layout& layout, const void* host_idx,
                           const void* dev_idx, int64_t n_tokens, uint32_t* counters,
                           uint32_t* flags, const kvio_bounds* bounds) {
    if (k_ptrs == nullptr || host_base == nullptr || num_layers <= 0 || n_tokens < 0 ||
        counters == nullptr || flags == nullptr || !layout_ok(layout) || !bounds_ok(bounds)) {
        return cudaErrorInvalidValue;
    }
    if (n_tokens > 0 && (host_idx == nullptr || dev_idx == nullptr)) {
        return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

// The signaled per-layer load: all layers in one grid, layer by layer (signaled_body), on
// `stream`. counters (device, num_layers: one per group) are zero at the launch and left zero
// (a memset per launch cost the caller a runtime call); flags[l] (num_layers) becomes `epoch`
// once every layer of l's group (signaled_geometry) has landed.
// inline_host: host_idx is CPU memory, copied into the launch (InlineIndices) during the call.
cudaError_t load_layers_signaled(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                 int32_t num_layers, void* host_base,
                                 const kvio_layout& layout, const void* host_idx,
                                 int host_idx_64, const void* dev_idx, int dev_idx_64,
                                 int64_t n_tokens, uint32_t* counters, uint32_t* flags,
                                 uint32_t epoch, void* stream, const kvio_bounds* bounds,
                                 bool inline_host = false) {
    KVIO_CHECK(check_signaled(k_ptrs, num_layers, host_base, layout, host_idx, dev_idx,
                              n_tokens, counters, flags, bounds));
    InlineIndices inl;
    if (inline_host) {
        KVIO_CHECK(
            read_inline(host_idx, host_idx_64, n_tokens, layout.page_size, *bounds, &inl));
    }
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    DeviceGuard guard;
    KVIO_CHECK(guard.enter(s));
    if (n_tokens == 0) {  // nothing to move: the layers are ready once the stream gets here
        kvio_set_flags<<<1, kThreads, 0, s>>>(flags, num_layers, epoch);
        return cudaGetLastError();
    }
    // A tile with skipped vectors is still counted (every warp counts its part of every tile),
    // so every layer's flag is published even when indices are out of range.
    CopyParams p = indexed_params(k_ptrs, v_ptrs, host_base, layout,
                                  inline_host ? nullptr : host_idx, host_idx_64, dev_idx,
                                  dev_idx_64, *bounds);
    SignaledGeometry g;
    KVIO_CHECK(signaled_geometry(p, v_ptrs != nullptr ? 2 : 1, n_tokens, num_layers,
                                 layout.num_chunks, guard.device(), &g));
    const Signals sig = {counters, flags, epoch, g.group};
    if (inline_host) {
        if (needs_wide_index(p.total)) {  // (32-bit inline kernels: the caller's limit)
            return cudaErrorInvalidValue;
        }
        kSignaledInlineKernels[log2_exact(g.vec)]<<<g.grid, kThreads, 0, s>>>(p, num_layers,
                                                                            sig, inl);
        return cudaGetLastError();
    }
    const SignaledKernel kernel = kSignaledKernels[log2_exact(g.vec)][needs_wide_index(p.total)];
    kernel<<<g.grid, kThreads, 0, s>>>(p, num_layers, sig);
    return cudaGetLastError();
}

// How many consecutive layers of a signaled load land together (SignaledGeometry::group): the
// flags of a group go up at once.
cudaError_t signaled_layer_group(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                 int32_t num_layers, void* host_base, const kvio_layout& layout,
                                 int64_t n_tokens, void* stream, int32_t* group) {
    if (group == nullptr || k_ptrs == nullptr || host_base == nullptr || num_layers <= 0 ||
        n_tokens <= 0 || !layout_ok(layout)) {
        return cudaErrorInvalidValue;
    }
    DeviceGuard guard;
    KVIO_CHECK(guard.enter(static_cast<cudaStream_t>(stream)));
    const kvio_bounds unused = {};
    CopyParams p = base_params(k_ptrs, v_ptrs, host_base, layout, unused);
    SignaledGeometry g;
    KVIO_CHECK(signaled_geometry(p, v_ptrs != nullptr ? 2 : 1, n_tokens, num_layers,
                                 layout.num_chunks, guard.device(), &g));
    *group = static_cast<int32_t>(g.group);
    return cudaSuccess;
}

// The staged transfer of all layers of whole pages, either direction. Write-back: a device
// gather of the pages into `staging` laid out as the host page images, then DMA copies of
// the images to the host pages. Load: the reverse, DMA of the host pages into staging, then
// a device scatter into the pool. Transfers beyond the staging buffer (or large enough to
// gain from it) go in chunks whose device relayout overlaps the DMA of the next chunk.
// The arguments of a staged transfer, checked on the CPU before anything is enqueued
// (transfer_staged and its asynchronous form share them): cudaErrorInvalidValue for any
// it cannot carry out.
cudaError_t check_staged(int direction, const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                         int32_t num_layers, void* host_base, const kvio_layout& layout,
                         const int64_t* host_idx_cpu, const void* dev_idx, int64_t n_tokens,
                         void* staging, int64_t staging_bytes, const kvio_bounds* bounds) {
    if ((direction != kDeviceToHost && direction != kHostToDevice) || k_ptrs == nullptr ||
        host_base == nullptr || num_layers <= 0 || n_tokens < 0 || !layout_ok(layout) ||
        !bounds_ok(bounds)) {
        return cudaErrorInvalidValue;
    }
    if (n_tokens == 0) {
        return cudaSuccess;
    }
    const int64_t P = layout.page_size;
    const int num_kv = v_ptrs != nullptr ? 2 : 1;
    const int64_t page_bytes =
        int64_t(num_layers) * P * layout.chunk_bytes * layout.num_chunks;
    if (host_idx_cpu == nullptr || dev_idx == nullptr || staging == nullptr ||
        staging_bytes <= 0 || n_tokens % P != 0) {
        return cudaErrorInvalidValue;
    }
    if (!page_is_contiguous(layout, num_layers, page_bytes) &&
        !(num_kv == 2 && layout.page_stride == 2 * page_bytes &&
          page_is_contiguous(layout, num_layers, page_bytes, num_kv))) {
        return cudaErrorInvalidValue;
    }
    for (int64_t i = 0; i < n_tokens / P; ++i) {  // whole pages (validated again in Python)
        const int64_t h0 = host_idx_cpu[i * P];
        if (h0 < 0 || h0 % P != 0) {
            return cudaErrorInvalidValue;
        }
    }
    // The host copy addresses are computed from CPU indices: refuse an out-of-range one
    // before anything is enqueued (the device indices are checked by the kernels).
    if (!cpu_indices_in_range(host_idx_cpu, n_tokens, bounds->host_tokens) ||
        staging_bytes < page_bytes) {
        return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

// What a staging buffer's users share across calls: the host copies of overlapped
// write-backs (kvio_write_back_staged_after) run on a copy stream of the buffer's own, so
// the next write-back's gather (on the caller's stream, into the other half) overlaps the
// previous one's copy. Every other staged transfer through the buffer first waits for the
// last of those copies. Calls through one buffer are issued one at a time (`mutex`): the
// library's thread and a caller may both issue through it, and a pipelined transfer's copies
// run on a side stream, so a gather enqueued on the buffer's stream in the middle of a
// pipeline's issue could overwrite a half whose copy is still reading it. A buffer serves one
// stream, as the staging buffers kvcore hands out do.
struct StagingState {
    std::mutex mutex;
    int device = -1;               // of the copy stream and events (made on first overlap)
    cudaStream_t copy = nullptr;
    cudaEvent_t filled = nullptr;  // the gather of the latest overlapped write-back
    cudaEvent_t drained[2] = {nullptr, nullptr};  // the latest host copy out of each half
    bool recorded[2] = {false, false};
    int next = 0;   // the half the next overlapped write-back gathers into
    int last = -1;  // the half of the latest overlapped copy (-1: none yet)

    cudaError_t ensure(int dev) {
        if (copy != nullptr && dev == device) {
            return cudaSuccess;
        }
        if (copy != nullptr) {
            // The address was freed on `device` and handed out again on `dev`: let the old
            // copies finish (their buffer is gone) and start over on this device.
            forget();
            for (cudaEvent_t e : {filled, drained[0], drained[1]}) (void)cudaEventDestroy(e);
            (void)cudaStreamDestroy(copy);
            (void)cudaGetLastError();  // nothing above may fail this call
            copy = nullptr;
            filled = drained[0] = drained[1] = nullptr;
        }
        KVIO_CHECK(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming));
        KVIO_CHECK(cudaEventCreateWithFlags(&drained[0], cudaEventDisableTiming));
        KVIO_CHECK(cudaEventCreateWithFlags(&drained[1], cudaEventDisableTiming));
        KVIO_CHECK(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
        device = dev;
        return cudaSuccess;
    }

    // After a failure that left a copy on the copy stream untracked: wait for every copy
    // there on the host (an error path only), so nothing needs tracking any more.
    void forget() {
        (void)cudaStreamSynchronize(copy);
        (void)cudaGetLastError();
        recorded[0] = recorded[1] = false;
        last = -1;
    }
};

// The state of the staging buffer at `staging`, made on first use and kept for the life of
// the process (a buffer freed and another allocated at its address inherits waits for
// copies long finished, which cost nothing; one on another device, see ensure).
StagingState& staging_state(void* staging) {
    static std::mutex map_mutex;
    static auto* states = new std::vector<std::pair<void*, std::unique_ptr<StagingState>>>();
    std::lock_guard<std::mutex> lock(map_mutex);
    for (auto& entry : *states) {
        if (entry.first == staging) return *entry.second;
    }
    states->emplace_back(staging, std::make_unique<StagingState>());
    return *states->back().second;
}

cudaError_t staged_locked(int direction, const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                          int32_t num_layers, void* host_base, const kvio_layout& layout,
                          const int64_t* host_idx_cpu, int64_t host_step, const void* dev_idx,
                          int dev_idx_64, int64_t n_tokens, void* staging,
                          int64_t staging_bytes, int use_batched, void* stream,
                          const kvio_bounds* bounds, StagingState& state,
                          cudaEvent_t overlap_done, bool* overlapped);

// A staged transfer (checked here). With `overlap_done`, a write-back that fits half the
// staging buffer and is not pipelined is overlapped (see StagingState): its host copy runs
// on the buffer's copy stream, `overlap_done` is recorded there after it and *overlapped is
// set; anything else runs on `stream` in stream order, as without it.
cudaError_t transfer_staged(int direction, const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                            int32_t num_layers, void* host_base, const kvio_layout& layout,
                            const int64_t* host_idx_cpu, const void* dev_idx, int dev_idx_64,
                            int64_t n_tokens, void* staging, int64_t staging_bytes,
                            int use_batched, void* stream, const kvio_bounds* bounds,
                            cudaEvent_t overlap_done = nullptr, bool* overlapped = nullptr) {
    KVIO_CHECK(check_staged(direction, k_ptrs, v_ptrs, num_layers, host_base, layout,
                            host_idx_cpu, dev_idx, n_tokens, staging, staging_bytes, bounds));
    if (n_tokens == 0) {
        return cudaSuccess;
    }
    StagingState& state = staging_state(staging);
    std::lock_guard<std::mutex> lock(state.mutex);
    return staged_locked(direction, k_ptrs, v_ptrs, num_layers, host_base, layout,
                         host_idx_cpu, layout.page_size, dev_idx, dev_idx_64, n_tokens,
                         staging, staging_bytes, use_batched, stream, bounds, state,
                         overlap_done, overlapped);
}

// transfer_staged of arguments check_staged passed already (n_tokens > 0), with only each
// page's first host token: `host_starts` (n_tokens / page size of them).
cudaError_t transfer_staged_checked(int direction, const uint64_t* k_ptrs,
                                    const uint64_t* v_ptrs, int32_t num_layers,
                                    void* host_base, const kvio_layout& layout,
                                    const int64_t* host_starts, const void* dev_idx,
                                    int dev_idx_64, int64_t n_tokens, void* staging,
                                    int64_t staging_bytes, int use_batched, void* stream,
                                    const kvio_bounds* bounds) {
    StagingState& state = staging_state(staging);
    std::lock_guard<std::mutex> lock(state.mutex);
    return staged_locked(direction, k_ptrs, v_ptrs, num_layers, host_base, layout, host_starts,
                         1, dev_idx, dev_idx_64, n_tokens, staging, staging_bytes, use_batched,
                         stream, bounds, state, nullptr, nullptr);
}

cudaError_t staged_locked(int direction, const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                          int32_t num_layers, void* host_base, const kvio_layout& layout,
                          const int64_t* host_idx_cpu, int64_t host_step, const void* dev_idx,
                          int dev_idx_64, int64_t n_tokens, void* staging,
                          int64_t staging_bytes, int use_batched, void* stream,
                          const kvio_bounds* bounds, StagingState& state,
                          cudaEvent_t overlap_done, bool* overlapped) {
    const int64_t P = layout.page_size;
    const int num_kv = v_ptrs != nullptr ? 2 : 1;
    const int64_t elem_bytes = layout.chunk_bytes * layout.num_chunks;
    const int64_t page_bytes = int64_t(num_layers) * P * elem_bytes;
    // Pages of K (or V) that are runs, else whole pages (K and V together) that are: staged
    // and copied whole (the staging image is then [page][host page], K and V inside).
    const bool whole = !page_is_contiguous(layout, num_layers, page_bytes);
    const int64_t num_pages = n_tokens / P;
    const int64_t slot_bytes = num_kv * page_bytes;  // one page of K (and V) in staging
    const int64_t capacity = staging_bytes / slot_bytes;
    if (num_kv == 2 && capacity < 2 && !whole) {
        // A page of K and V together does not fit twice, so the relayout of one page could
        // not overlap the copy of another (or does not fit at all): stage all of K, then all
        // of V, each pipelined where its own pages fit twice.
        KVIO_CHECK(staged_locked(direction, k_ptrs, nullptr, num_layers, host_base, layout,
                                 host_idx_cpu, host_step, dev_idx, dev_idx_64, n_tokens,
                                 staging, staging_bytes, use_batched, stream, bounds, state,
                                 nullptr, nullptr));
        return staged_locked(direction, v_ptrs, nullptr, num_layers,
                             static_cast<char*>(host_base) + layout.kv_stride, layout,
                             host_idx_cpu, host_step, dev_idx, dev_idx_64, n_tokens, staging,
                             staging_bytes, use_batched, stream, bounds, state, nullptr, nullptr);
    }
    if (capacity < 1) {
        return cudaErrorInvalidValue;  // the staging buffer cannot hold a single page
    }

    cudaStream_t s = static_cast<cudaStream_t>(stream);
    DeviceGuard guard;
    KVIO_CHECK(guard.enter(s));

    // A captured stream stays on one stream (no side-stream fork, no batched API).
    bool capturing = false;
    KVIO_CHECK(is_capturing(s, &capturing));
    const bool batched = use_batched != 0 && !capturing;
    const bool pipelined =
        !capturing && capacity >= 2 && num_pages >= 2 &&
        (num_pages > capacity || num_pages * slot_bytes >= kPipelineMinBytes);

    int64_t chunk_pages;  // pages per chunk
    int64_t half_bytes = 0;
    if (pipelined) {
        const int64_t half = capacity / 2;
        const int64_t even = (num_pages + kPipelineChunks - 1) / kPipelineChunks;
        chunk_pages = even < half ? even : half;
        half_bytes = half * slot_bytes;
    } else {
        chunk_pages = num_pages < capacity ? num_pages : capacity;
    }

    const size_t idx_bytes = dev_idx_64 ? sizeof(int64_t) : sizeof(int32_t);
    // The device side of chunk [p0, p0 + cp) on the caller's stream: the staging chunk seen
    // as a host buffer ([kv][page][page image], identity indices) gathered or scattered.
    auto relayout = [&](char* buf, int64_t p0, int64_t cp) -> cudaError_t {
        kvio_layout st = layout;
        st.kv_stride = whole ? layout.kv_stride : cp * page_bytes;
        st.page_stride = whole ? slot_bytes : page_bytes;
        CopyParams p = base_params(k_ptrs, v_ptrs, buf, st, *bounds);
        p.host_idx = nullptr;
        p.dev_idx = static_cast<const char*>(dev_idx) + static_cast<size_t>(p0 * P) * idx_bytes;
        p.dev_idx_64 = dev_idx_64 ? 1 : 0;
        p.layer_begin = 0;
        return launch_copy(direction, p, num_kv, cp * P, num_layers, layout.num_chunks,
                           guard.device(), false, s);
    };
    const bool to_host = direction == kDeviceToHost;
    char* host = static_cast<char*>(host_base);
    char* stage = static_cast<char*>(staging);
    auto dma = [&](char* buf, int64_t p0, int64_t cp, cudaStream_t on) -> cudaError_t {
        return issue_copies(direction, buf, p0, cp, num_kv, page_bytes, host, layout,
                            host_idx_cpu, host_step, batched, on, whole);
    };

    const int64_t half_staging = (staging_bytes / 2) & ~int64_t(255);
    if (overlap_done != nullptr && to_host && !capturing && !pipelined &&
        num_pages * slot_bytes <= half_staging) {
        // Overlapped (see StagingState): gather into the half the previous write-back did
        // not use, once the copy that last read it is done; copy on the buffer's stream.
        KVIO_CHECK(state.ensure(guard.device()));
        const int b = state.next;
        char* buf = stage + b * half_staging;
        if (state.recorded[b]) {
            KVIO_CHECK(cudaStreamWaitEvent(s, state.drained[b], 0));
        }
        KVIO_CHECK(relayout(buf, 0, num_pages));
        KVIO_CHECK(cudaEventRecord(state.filled, s));
        KVIO_CHECK(cudaStreamWaitEvent(state.copy, state.filled, 0));
        cudaError_t err = dma(buf, 0, num_pages, state.copy);
        // recorded after a failed copy call too: a part of it may be enqueued, and whoever
        // uses the half next must wait for that part
        const cudaError_t drained = cudaEventRecord(state.drained[b], state.copy);
        if (drained != cudaSuccess) {
            state.forget();
            return err != cudaSuccess ? err : drained;
        }
        state.recorded[b] = true;
        state.last = b;
        state.next = 1 - b;
        if (err == cudaSuccess) {
            err = cudaEventRecord(overlap_done, state.copy);
        }
        if (err != cudaSuccess) {
            // the caller's stream covers what was enqueued (a failed write-back drains it
            // before releasing the host slots)
            (void)cudaStreamWaitEvent(s, state.drained[b], 0);
            return err;
        }
        *overlapped = true;
        return cudaSuccess;
    }
    if (state.last >= 0 && !capturing) {  // nothing below may touch it under an overlapped copy
        KVIO_CHECK(cudaStreamWaitEvent(s, state.drained[state.last], 0));
        // `s`, the buffer's one stream, now follows every copy made so far (the copy stream
        // runs in order): no later transfer on it needs to wait for those again
        state.last = -1;
        state.recorded[0] = state.recorded[1] = false;
    }

    if (!pipelined) {
        // Everything on the caller's stream, chunk after chunk (stream order makes reusing
        // the single buffer safe).
        for (int64_t p0 = 0; p0 < num_pages; p0 += chunk_pages) {
            const int64_t cp = num_pages - p0 < chunk_pages ? num_pages - p0 : chunk_pages;
            KVIO_CHECK(to_host ? relayout(stage, p0, cp) : dma(stage, p0, cp, s));
            KVIO_CHECK(to_host ? dma(stage, p0, cp, s) : relayout(stage, p0, cp));
        }
        return cudaSuccess;
    }

    // Two halves of staging; chunk i uses half i % 2 (see Pipeline). The relayout runs on the
    // caller's stream, the DMA on the device's side stream; the caller's stream finally
    // waits for the last step, so for the caller the whole call is stream ordered and the
    // staging buffer is free again once its stream passes this point.
    cudaStream_t side = nullptr;
    KVIO_CHECK(side_stream(guard.device(), &side));
    Pipeline pipe(s, side, /*fill_on_side=*/!to_host);
    KVIO_CHECK(pipe.init(guard.device()));
    int64_t chunk = 0;
    for (int64_t p0 = 0; p0 < num_pages; p0 += chunk_pages, ++chunk) {
        const int64_t cp = num_pages - p0 < chunk_pages ? num_pages - p0 : chunk_pages;
        const int b = static_cast<int>(chunk & 1);
        char* buf = stage + b * half_bytes;
        KVIO_CHECK(pipe.before_fill(b));
        KVIO_CHECK(to_host ? relayout(buf, p0, cp) : dma(buf, p0, cp, side));
        KVIO_CHECK(pipe.after_fill());
        KVIO_CHECK(to_host ? dma(buf, p0, cp, side) : relayout(buf, p0, cp));
        KVIO_CHECK(pipe.after_drain(b));
    }
    return pipe.join();
}

// Whether a batched submission of the per-layer DMA (1D runs when `flat`, else 2D) would be
// used: the runtime exports the entry point and the driver has not refused it.
bool batch_available(bool flat) {
#if KVIO_HAVE_BATCH
    return flat ? batch_fn() != nullptr : batch3d_fn() != nullptr;
#else
    (void)flat;
    return false;
#endif
}

// Runs work of a call made on the legacy default stream `caller` on the device's internal DMA
// stream: begin() makes that stream wait for everything enqueued on `caller` so far, join()
// makes `caller` wait for what was enqueued on it in between. If the call stops early after
// begin(), the destructor still joins, so `caller` never runs ahead of that work.
class LegacyFork {
  public:
    explicit LegacyFork(cudaStream_t caller) : caller_(caller) {}
    LegacyFork(const LegacyFork&) = delete;
    LegacyFork& operator=(const LegacyFork&) = delete;
    ~LegacyFork() {
        if (forked_) {
            (void)join();
        }
    }

    cudaError_t begin(int device, cudaStream_t* out) {
        KVIO_CHECK(dma_stream(device, &side_));
        cudaEvent_t* e = nullptr;
        KVIO_CHECK(thread_events<1>(device, &e));  // re-recorded by join and the next call
        event_ = e[0];
        KVIO_CHECK(cudaEventRecord(event_, caller_));
        KVIO_CHECK(cudaStreamWaitEvent(side_, event_, 0));
        forked_ = true;
        *out = side_;
        return cudaSuccess;
    }

    cudaError_t join() {
        forked_ = false;
        KVIO_CHECK(cudaEventRecord(event_, side_));
        return cudaStreamWaitEvent(caller_, event_, 0);
    }

  private:
    cudaStream_t caller_;
    cudaStream_t side_ = nullptr;
    cudaEvent_t event_ = nullptr;
    bool forked_ = false;
};

// Per-layer load through the copy engine: no SM reads pinned memory. Consecutive tokens
// whose host and device slots both advance by one form a run. Where the host keeps one
// layer's tokens back to back (layer_first, page_first_direct) a run is one contiguous copy;
// where it interleaves layers (page_first) a run is one 2D copy of `rows` elements, host rows
// token_stride bytes apart. All runs of the call go to the runtime in one batch when it has
// the batched entry points, else one copy call each.
cudaError_t load_layer_dma(char* k_dst, char* v_dst, int32_t layer, void* host_base,
                           const kvio_layout& L, const int64_t* host_idx_cpu,
                           const int64_t* dev_idx_cpu, int64_t n_tokens, int use_batched,
                           void* stream, const kvio_bounds* bounds) {
    if (k_dst == nullptr || host_base == nullptr || layer < 0 || n_tokens < 0 ||
        !layout_ok(L) || (L.num_chunks > 1 && L.chunk_stride != L.chunk_bytes) ||
        !bounds_ok(bounds)) {
        return cudaErrorInvalidValue;  // the last: an element must be contiguous on the host
    }
    if (n_tokens == 0) {
        return cudaSuccess;
    }
    if (host_idx_cpu == nullptr || dev_idx_cpu == nullptr) {
        return cudaErrorInvalidValue;
    }
    const int64_t P = L.page_size;
    const int64_t elem = L.chunk_bytes * L.num_chunks;
    const bool flat = L.token_stride == elem;
    const bool pages_abut = L.page_stride == P * L.token_stride;

    struct Run {
        int64_t h, d, rows;
    };
    thread_local std::vector<Run> runs;
    runs.clear();
    for (int64_t i = 0; i < n_tokens;) {
        const int64_t h0 = host_idx_cpu[i], d0 = dev_idx_cpu[i];
        if (h0 < 0 || d0 < 0) {
            return cudaErrorInvalidValue;
        }
        int64_t j = i + 1;
        while (j < n_tokens && host_idx_cpu[j] == host_idx_cpu[j - 1] + 1 &&
               dev_idx_cpu[j] == dev_idx_cpu[j - 1] + 1 && (pages_abut || host_idx_cpu[j] % P)) {
            ++j;
        }
        // Both indices are CPU-resident: refuse an out-of-range one before enqueueing anything
        // (defence in depth; Python checks them first). A run's last slots are its largest.
        if (j - i > bounds->host_tokens - h0 || j - i > bounds->device_tokens - d0) {
            return cudaErrorInvalidValue;
        }
        runs.push_back({h0, d0, j - i});
        i = j;
    }

    cudaStream_t s = static_cast<cudaStream_t>(stream);
    DeviceGuard guard;
    KVIO_CHECK(guard.enter(s));
    bool capturing = false;
    KVIO_CHECK(is_capturing(s, &capturing));

    // Enqueues every run on `on`, batched when `batched` (and the runtime has it).
    auto submit = [&](cudaStream_t on, bool batched) -> cudaError_t {
        const int num_kv = v_dst != nullptr ? 2 : 1;
        thread_local std::vector<void*> dsts;
        thread_local std::vector<const void*> srcs;
        thread_local std::vector<size_t> sizes;
        struct Rect {  // one 2D copy: `rows` rows of `elem` bytes, host rows `pitch` apart
            char* dst;
            const char* src;
            int64_t rows;
        };
        thread_local std::vector<Rect> rects;
        dsts.clear();
        srcs.clear();
        sizes.clear();
        rects.clear();
        const char* host = static_cast<const char*>(host_base);
        for (int kv = 0; kv < num_kv; ++kv) {
            char* dev = kv ? v_dst : k_dst;
            for (const Run& r : runs) {
                const char* src = host + kv * L.kv_stride + layer * L.layer_stride +
                                  (r.h / P) * L.page_stride + (r.h % P) * L.token_stride;
                char* dst = dev + r.d * elem;
                if (flat) {
                    dsts.push_back(dst);
                    srcs.push_back(src);
                    sizes.push_back(static_cast<size_t>(r.rows * elem));
                } else {
                    rects.push_back({dst, src, r.rows});
                }
            }
        }
        if (flat) {
            return copy_runs(dsts, srcs, sizes, cudaMemcpyHostToDevice, batched, on);
        }
        const size_t width = static_cast<size_t>(elem);
        const size_t pitch = static_cast<size_t>(L.token_stride);
#if KVIO_HAVE_BATCH
        if (Batch3DFn fn = batched ? batch3d_fn() : nullptr) {
            thread_local std::vector<cudaMemcpy3DBatchOp> ops;
            ops.assign(rects.size(), cudaMemcpy3DBatchOp{});
            for (size_t i = 0; i < rects.size(); ++i) {
                cudaMemcpy3DBatchOp& op = ops[i];
                op.src.type = cudaMemcpyOperandTypePointer;
                op.src.op.ptr.ptr = const_cast<char*>(rects[i].src);
                op.src.op.ptr.rowLength = pitch;
                op.dst.type = cudaMemcpyOperandTypePointer;
                op.dst.op.ptr.ptr = rects[i].dst;
                op.dst.op.ptr.rowLength = width;
                op.extent = make_cudaExtent(width, static_cast<size_t>(rects[i].rows), 1);
                op.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
            }
#if CUDART_VERSION >= 13000
            const cudaError_t err = fn(ops.size(), ops.data(), 0, on);
#else
            size_t fail_idx = 0;
            const cudaError_t err = fn(ops.size(), ops.data(), &fail_idx, 0, on);
#endif
            if (!batch_refused(err)) {
                return err;
            }
            (void)cudaGetLastError();
            disable_batch();
        }
#endif
        for (const Rect& r : rects) {
            KVIO_CHECK(cudaMemcpy2DAsync(r.dst, width, r.src, pitch, width,
                                         static_cast<size_t>(r.rows), cudaMemcpyHostToDevice,
                                         on));
        }
        return cudaSuccess;
    };

    const bool batched = use_batched != 0 && !capturing;
    if (!batched || !is_legacy_stream(s) || !batch_available(flat)) {
        // The batched memcpy refuses the legacy NULL stream: there, one copy per run.
        return submit(s, batched && !is_legacy_stream(s));
    }
    // The legacy default stream: run the batch on the device's internal DMA stream, ordered
    // by events (it starts after everything enqueued on `s` so far, and `s` waits for it), so
    // a caller on stream 0 gets the batched submission too.
    LegacyFork fork(s);
    cudaStream_t on = nullptr;
    KVIO_CHECK(fork.begin(guard.device(), &on));
    KVIO_CHECK(submit(on, true));
    return fork.join();
}

// One asynchronous copy of pinned host bytes to the device (kvio_copy_to_device).
cudaError_t copy_to_device(void* dst, const void* src, int64_t nbytes, cudaStream_t s) {
    if (dst == nullptr || src == nullptr || nbytes < 0) {
        return cudaErrorInvalidValue;
    }
    DeviceGuard guard;
    KVIO_CHECK(guard.enter(s));
    return cudaMemcpyAsync(dst, src, static_cast<size_t>(nbytes), cudaMemcpyHostToDevice, s);
}

// -------- asynchronous staged write-backs (kvio_write_back_staged_async) -----------------
//
// The caller's thread checks the arguments, copies the host indices and records where the
// transfer must start on the caller's stream; a library thread then issues the transfer
// exactly as kvio_write_back_staged would (its dozens of runtime calls for a large transfer
// never hold up the caller, nor does a full launch queue). One thread for the process: jobs
// are issued in the order they were handed over.

constexpr int kJobPending = KVIO_JOB_PENDING;  // kvio_job_status: not issued, or issued and still running

// What the job functions (kvio_job_status / _wait / _release) report on: a staged write-back
// handed to the thread (or issued by the caller while its stream is being captured).
struct Job {
    const uint64_t* k_ptrs;
    const uint64_t* v_ptrs;
    int32_t num_layers;
    void* host_base;
    kvio_layout layout;
    std::vector<int64_t> host_starts;  // each page's first host token (the thread's copy)
    const void* dev_idx;
    int dev_idx_64;
    void* staging;
    int64_t staging_bytes;
    int use_batched;
    cudaStream_t stream;
    kvio_bounds bounds;
    int device = 0;
    cudaEvent_t after = nullptr;  // recorded on the caller's stream (null: it is `stream`)
    cudaEvent_t done = nullptr;   // recorded on `stream` after everything the job enqueued
    bool done_recorded = false;   // set before `issued`; false: nothing to wait for on failure
    bool issued = false;          // guarded by JobQueue::mutex
    bool released = false;        // guarded by JobQueue::mutex
    cudaError_t error = cudaSuccess;
};

// Events of finished jobs, per device, for the next ones (creating two per job would cost
// the caller microseconds); under g_mutex.
std::vector<cudaEvent_t> g_job_events[kMaxDevices];

cudaError_t take_job_event(int device, cudaEvent_t* out) {
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        std::vector<cudaEvent_t>& pool = g_job_events[device];
        if (!pool.empty()) {
            *out = pool.back();
            pool.pop_back();
            return cudaSuccess;
        }
    }
    return cudaEventCreateWithFlags(out, cudaEventDisableTiming);
}

// A job's completion event and, where it follows another stream than its own, that stream's
// point now, recorded into its `after` event (the order point); both from the pool.
cudaError_t take_job_events(Job* job, cudaStream_t after) {
    KVIO_CHECK(take_job_event(job->device, &job->done));
    if (after != job->stream) {
        KVIO_CHECK(take_job_event(job->device, &job->after));
        KVIO_CHECK(cudaEventRecord(job->after, after));
    }
    return cudaSuccess;
}

void give_job_events(const Job* job) {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (cudaEvent_t e : {job->after, job->done}) {
        if (e != nullptr) g_job_events[job->device].push_back(e);
    }
}

// Issues a job's transfer on its stream, after its order point, then records its completion
// after whatever was enqueued (so a completion is never reported while a part of the
// transfer may still run). `host_idx`: the caller's token indices where the caller issues
// it, else null (the thread: the job's own page starts).
cudaError_t issue_staged_job(Job& job, const int64_t* host_idx, int64_t n_tokens) {
    cudaError_t err = cudaSetDevice(job.device);
    if (err == cudaSuccess && job.after != nullptr) {
        err = cudaStreamWaitEvent(job.stream, job.after, 0);
    }
    if (err == cudaSuccess) {
        err = host_idx != nullptr
                  ? transfer_staged(kDeviceToHost, job.k_ptrs, job.v_ptrs, job.num_layers,
                                    job.host_base, job.layout, host_idx, job.dev_idx,
                                    job.dev_idx_64, n_tokens, job.staging, job.staging_bytes,
                                    job.use_batched, job.stream, &job.bounds)
                  : transfer_staged_checked(kDeviceToHost, job.k_ptrs, job.v_ptrs,
                                            job.num_layers, job.host_base, job.layout,
                                            job.host_starts.data(), job.dev_idx,
                                            job.dev_idx_64, n_tokens, job.staging,
                                            job.staging_bytes, job.use_batched, job.stream,
                                            &job.bounds);
    }
    const cudaError_t recorded = cudaEventRecord(job.done, job.stream);
    job.done_recorded = recorded == cudaSuccess;
    if (err != cudaSuccess || recorded != cudaSuccess) {
        (void)cudaGetLastError();
    }
    return err != cudaSuccess ? err : recorded;
}

class JobQueue {
  public:
    void push(Job* job) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!started_) {
            std::thread(&JobQueue::serve, this).detach();  // lives as long as the process
            started_ = true;
        }
        jobs_.push_back(job);
        ++waiting_on(job->staging);
        ready_.notify_one();
    }

    // Blocks until `job` was issued (or failed to be).
    void wait_issued(Job* job) {
        std::unique_lock<std::mutex> lock(mutex);
        issued_.wait(lock, [job] { return job->issued; });
    }

    // Whether a job through the staging buffer at `staging` is waiting or being issued.
    bool active(const void* staging) {
        std::lock_guard<std::mutex> lock(mutex);
        return waiting_on(staging) > 0;
    }

    // Blocks until every job handed over so far was issued.
    void flush() {
        std::unique_lock<std::mutex> lock(mutex);
        issued_.wait(lock, [this] { return jobs_.empty() && !busy_; });
    }

    void release(Job* job) {
        bool free_now;
        {
            std::lock_guard<std::mutex> lock(mutex);
            job->released = true;
            free_now = job->issued;
        }
        if (free_now) destroy(job);  // else the thread does once it is issued
    }

    std::mutex mutex;

  private:
    static void destroy(Job* job) {
        give_job_events(job);
        delete job;
    }

    void serve() {
        for (;;) {
            Job* job;
            {
                std::unique_lock<std::mutex> lock(mutex);
                ready_.wait(lock, [this] { return !jobs_.empty(); });
                job = jobs_.front();
                jobs_.pop_front();
                busy_ = true;
            }
            const cudaError_t err = issue_staged_job(
                *job, nullptr,
                static_cast<int64_t>(job->host_starts.size()) * job->layout.page_size);
            bool free_now;
            {
                std::lock_guard<std::mutex> lock(mutex);
                job->error = err;
                job->issued = true;
                --waiting_on(job->staging);
                busy_ = false;
                free_now = job->released;
            }
            issued_.notify_all();
            if (free_now) destroy(job);
        }
    }

    // The count of jobs handed over and not yet issued through one staging buffer (a few
    // buffers per process: one per transfer stream); under `mutex`.
    int& waiting_on(const void* staging) {
        for (auto& entry : per_buffer_) {
            if (entry.first == staging) return entry.second;
        }
        per_buffer_.emplace_back(staging, 0);
        return per_buffer_.back().second;
    }

    std::deque<Job*> jobs_;
    std::vector<std::pair<const void*, int>> per_buffer_;
    std::condition_variable ready_;
    std::condition_variable issued_;
    bool started_ = false;
    bool busy_ = false;
};

// Never destroyed: the detached thread may still wait on it while the process exits.
JobQueue& job_queue() {
    static JobQueue* queue = new JobQueue;
    return *queue;
}

// A job that has already finished: nothing enqueued, no event, never on the thread (the
// answer to a call that moves nothing).
void* finished_job() {
    auto job = std::make_unique<Job>();
    job->issued = true;
    return job.release();
}

// What both staged write-back job forms do before anything else: check every argument (the
// same checks and errors as kvio_write_back_staged), and answer a call that moves nothing with
// a job that has already finished (no event, no thread) in *job_out; otherwise *job_out stays
// null and the caller issues the transfer.
cudaError_t begin_write_back_job(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                 int32_t num_layers, void* host_base, const kvio_layout& layout,
                                 const int64_t* host_idx_cpu, const void* dev_idx,
                                 int64_t n_tokens, void* staging, int64_t staging_bytes,
                                 const kvio_bounds* bounds, void** job_out) {
    if (job_out == nullptr) {
        return cudaErrorInvalidValue;
    }
    *job_out = nullptr;
    KVIO_CHECK(check_staged(kDeviceToHost, k_ptrs, v_ptrs, num_layers, host_base, layout,
                            host_idx_cpu, dev_idx, n_tokens, staging, staging_bytes, bounds));
    if (n_tokens == 0) {
        *job_out = finished_job();
    }
    return cudaSuccess;
}

cudaError_t write_back_staged_async(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                    int32_t num_layers, void* host_base,
                                    const kvio_layout& layout, const int64_t* host_idx_cpu,
                                    const void* dev_idx, int dev_idx_64, int64_t n_tokens,
                                    void* staging, int64_t staging_bytes, int use_batched,
                                    void* stream, void* after_stream, const kvio_bounds* bounds,
                                    void** job_out) {
    KVIO_CHECK(begin_write_back_job(k_ptrs, v_ptrs, num_layers, host_base, layout,
                                    host_idx_cpu, dev_idx, n_tokens, staging, staging_bytes,
                                    bounds, job_out));
    if (*job_out != nullptr) {
        return cudaSuccess;
    }
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    cudaStream_t after = static_cast<cudaStream_t>(after_stream);
    bool capturing = false;
    KVIO_CHECK(is_capturing(s, &capturing));
    if (!capturing && after != s) {
        KVIO_CHECK(is_capturing(after, &capturing));
    }
    DeviceGuard guard;
    KVIO_CHECK(guard.enter(s));
    auto job = std::make_unique<Job>();
    job->device = guard.device();
    job->k_ptrs = k_ptrs;
    job->v_ptrs = v_ptrs;
    job->num_layers = num_layers;
    job->host_base = host_base;
    job->layout = layout;
    job->dev_idx = dev_idx;
    job->dev_idx_64 = dev_idx_64;
    job->staging = staging;
    job->staging_bytes = staging_bytes;
    job->use_batched = use_batched;
    job->stream = s;
    job->bounds = *bounds;
    // Everything that can fail before the job is handed over; its events go back on failure.
    // A stream being captured is recorded on the capturing thread: the transfer is issued
    // here, and the job only reports its completion.
    auto prepare = [&]() -> cudaError_t {
        KVIO_CHECK(take_job_events(job.get(), after));
        return capturing ? issue_staged_job(*job, host_idx_cpu, n_tokens) : cudaSuccess;
    };
    const cudaError_t err = prepare();
    if (err != cudaSuccess) {
        give_job_events(job.get());
        return err;
    }
    if (capturing) {
        job->issued = true;  // never shared with the thread
        *job_out = job.release();
        return cudaSuccess;
    }
    // (the thread needs each page's first host token only, and check_staged passed them)
    const int64_t P = layout.page_size;
    job->host_starts.resize(static_cast<size_t>(n_tokens / P));
    for (size_t i = 0; i < job->host_starts.size(); ++i) {
        job->host_starts[i] = host_idx_cpu[static_cast<int64_t>(i) * P];
    }
    Job* raw = job.release();
    job_queue().push(raw);
    *job_out = raw;
    return cudaSuccess;
}

// A job the calling thread issues (never shared with the thread): `transfer(s, guard, done,
// &recorded)` enqueues the work on `stream` once it waits for `after_stream`'s point, then
// `done` is recorded after it (unless the transfer recorded it itself: recorded). Its events
// come from the pool and go back where anything fails; *job_out is set only on success.
template <typename Transfer>
cudaError_t issue_caller_job(void* stream, void* after_stream, void** job_out,
                             Transfer transfer) {
    auto job = std::make_unique<Job>();
    job->issued = true;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    DeviceGuard guard;
    KVIO_CHECK(guard.enter(s));
    job->device = guard.device();
    job->stream = s;
    auto issue = [&]() -> cudaError_t {
        KVIO_CHECK(take_job_events(job.get(), static_cast<cudaStream_t>(after_stream)));
        if (job->after != nullptr) {
            KVIO_CHECK(cudaStreamWaitEvent(s, job->after, 0));
        }
        bool recorded = false;
        KVIO_CHECK(transfer(s, guard, job->done, &recorded));
        return recorded ? cudaSuccess : cudaEventRecord(job->done, s);
    };
    const cudaError_t err = issue();
    if (err != cudaSuccess) {
        give_job_events(job.get());
        return err;
    }
    job->done_recorded = true;
    *job_out = job.release();
    return cudaSuccess;
}

// kvio_write_back_staged_after: the staged write-back issued by the calling thread after
// `after_stream`'s work so far, overlapped where it fits (transfer_staged); its completion is
// a job that never goes to the thread.
cudaError_t write_back_staged_after(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                    int32_t num_layers, void* host_base,
                                    const kvio_layout& layout, const int64_t* host_idx_cpu,
                                    const void* dev_idx, int dev_idx_64, int64_t n_tokens,
                                    void* staging, int64_t staging_bytes, int use_batched,
                                    void* stream, void* after_stream, const kvio_bounds* bounds,
                                    void** job_out) {
    KVIO_CHECK(begin_write_back_job(k_ptrs, v_ptrs, num_layers, host_base, layout,
                                    host_idx_cpu, dev_idx, n_tokens, staging, staging_bytes,
                                    bounds, job_out));
    if (*job_out != nullptr) {
        return cudaSuccess;
    }
    if (job_queue().active(staging)) {
        // The thread is issuing (or about to issue) a write-back through this staging buffer:
        // issued here, this one would wait for it (StagingState's mutex) for as long as that
        // takes, up to hundreds of microseconds. Behind it in the thread's queue it costs the
        // caller only the handover, and stays in order on the stream.
        return write_back_staged_async(k_ptrs, v_ptrs, num_layers, host_base, layout,
                                       host_idx_cpu, dev_idx, dev_idx_64, n_tokens, staging,
                                       staging_bytes, use_batched, stream, after_stream,
                                       bounds, job_out);
    }
    return issue_caller_job(
        stream, after_stream, job_out,
        [&](cudaStream_t, const DeviceGuard&, cudaEvent_t done, bool* recorded) {
            return transfer_staged(kDeviceToHost, k_ptrs, v_ptrs, num_layers, host_base, layout,
                                   host_idx_cpu, dev_idx, dev_idx_64, n_tokens, staging,
                                   staging_bytes, use_batched, stream, bounds, done, recorded);
        });
}

// kvio_transfer_direct_after: the direct kernel's transfer on `stream` after
// `after_stream`'s work so far, with a job for its completion (never shared with the
// thread). Checked before anything is recorded: a refused call hands out no job and
// enqueues nothing.
cudaError_t transfer_direct_after(int direction, const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                  int32_t layer_begin, int32_t layer_count, void* host_base,
                                  const kvio_layout& layout, const void* host_idx,
                                  int host_idx_64, const void* dev_idx, int dev_idx_64,
                                  int64_t n_tokens, int host_inline, void* stream,
                                  void* after_stream, const kvio_bounds* bounds,
                                  void** job_out) {
    if (job_out == nullptr) {
        return cudaErrorInvalidValue;
    }
    *job_out = nullptr;
    InlineIndices inl;
    bool nothing = false;
    KVIO_CHECK(check_direct(direction, k_ptrs, layer_begin, layer_count, host_base, layout,
                            host_idx, host_idx_64, dev_idx, n_tokens, bounds, host_inline != 0,
                            &inl, &nothing));
    if (nothing) {
        *job_out = finished_job();
        return cudaSuccess;
    }
    return issue_caller_job(
        stream, after_stream, job_out,
        [&](cudaStream_t s, const DeviceGuard& guard, cudaEvent_t, bool*) {
            return launch_direct(direction, k_ptrs, v_ptrs, layer_begin, layer_count,
                                 host_base, layout, host_idx, host_idx_64, dev_idx, dev_idx_64,
                                 n_tokens, false, s, guard, *bounds,
                                 host_inline != 0 ? &inl : nullptr);
        });
}

// The status of a job: kJobPending, cudaSuccess once everything it enqueued completed, or
// the error that failed it.
int job_status(Job* job, bool wait) {
    JobQueue& queue = job_queue();
    if (wait) {
        queue.wait_issued(job);
    } else {
        std::lock_guard<std::mutex> lock(queue.mutex);
        if (!job->issued) return kJobPending;
    }
    // A job that failed part way may have enqueued copies before the failure, and `done` was
    // recorded after them: its failure too is reported once they completed, since the caller
    // then releases the host slots and indices they use.
    const bool failed = job->error != cudaSuccess;
    if (failed && !job->done_recorded) return static_cast<int>(job->error);
    if (job->done == nullptr) return cudaSuccess;  // nothing was enqueued
    const cudaError_t err = wait ? cudaEventSynchronize(job->done) : cudaEventQuery(job->done);
    if (err == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return kJobPending;
    }
    if (err != cudaSuccess) (void)cudaGetLastError();
    return static_cast<int>(failed ? job->error : err);
}

// A failed runtime call also leaves its (non-sticky) code in the runtime's last-error slot,
// which the process may share with torch; the code is returned to the caller instead, so
// the slot is cleared rather than blamed later on an unrelated launch.
int finish(cudaError_t err) {
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
    }
    return static_cast<int>(err);
}

}  // namespace

KVIO_API int kvio_transfer_direct(int direction, const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                  int32_t layer_begin, int32_t layer_count, void* host_base,
                                  kvio_layout layout, const void* host_idx, int host_idx_64,
                                  const void* dev_idx, int dev_idx_64, int64_t n_tokens,
                                  void* stream, const kvio_bounds* bounds) {
    return finish(transfer_direct(direction, k_ptrs, v_ptrs, layer_begin, layer_count,
                                  host_base, layout, host_idx, host_idx_64, dev_idx, dev_idx_64,
                                  n_tokens, false, stream, bounds));
}

KVIO_API int kvio_transfer_direct_chained(int direction, const uint64_t* k_ptrs,
                                          const uint64_t* v_ptrs, int32_t layer_begin,
                                          int32_t layer_count, void* host_base,
                                          kvio_layout layout, const void* host_idx,
                                          int host_idx_64, const void* dev_idx, int dev_idx_64,
                                          int64_t n_tokens, void* stream,
                                          const kvio_bounds* bounds) {
    return finish(transfer_direct(direction, k_ptrs, v_ptrs, layer_begin, layer_count,
                                  host_base, layout, host_idx, host_idx_64, dev_idx, dev_idx_64,
                                  n_tokens, true, stream, bounds));
}

KVIO_API int kvio_transfer_direct_inline(int direction, const uint64_t* k_ptrs,
                                         const uint64_t* v_ptrs, int32_t layer_begin,
                                         int32_t layer_count, void* host_base,
                                         kvio_layout layout, const void* host_idx,
                                         int host_idx_64, const void* dev_idx, int dev_idx_64,
                                         int64_t n_tokens, void* stream,
                                         const kvio_bounds* bounds) {
    return finish(transfer_direct(direction, k_ptrs, v_ptrs, layer_begin, layer_count,
                                  host_base, layout, host_idx, host_idx_64, dev_idx, dev_idx_64,
                                  n_tokens, false, stream, bounds, true));
}

KVIO_API int kvio_write_back_staged(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                    int32_t num_layers, void* host_base, kvio_layout layout,
                                    const int64_t* host_idx_cpu, const void* dev_idx,
                                    int dev_idx_64, int64_t n_tokens, void* staging,
                                    int64_t staging_bytes, int use_batched, void* stream,
                                    const kvio_bounds* bounds) {
    return finish(transfer_staged(kDeviceToHost, k_ptrs, v_ptrs, num_layers, host_base,
                                  layout, host_idx_cpu, dev_idx, dev_idx_64, n_tokens, staging,
                                  staging_bytes, use_batched, stream, bounds));
}

KVIO_API int kvio_write_back_staged_async(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                          int32_t num_layers, void* host_base,
                                          kvio_layout layout, const int64_t* host_idx_cpu,
                                          const void* dev_idx, int dev_idx_64,
                                          int64_t n_tokens, void* staging,
                                          int64_t staging_bytes, int use_batched, void* stream,
                                          void* after_stream, const kvio_bounds* bounds,
                                          void** job) {
    return finish(write_back_staged_async(k_ptrs, v_ptrs, num_layers, host_base, layout,
                                          host_idx_cpu, dev_idx, dev_idx_64, n_tokens, staging,
                                          staging_bytes, use_batched, stream, after_stream,
                                          bounds, job));
}

KVIO_API int kvio_write_back_staged_after(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                          int32_t num_layers, void* host_base,
                                          kvio_layout layout, const int64_t* host_idx_cpu,
                                          const void* dev_idx, int dev_idx_64,
                                          int64_t n_tokens, void* staging,
                                          int64_t staging_bytes, int use_batched, void* stream,
                                          void* after_stream, const kvio_bounds* bounds,
                                          void** job) {
    return finish(write_back_staged_after(k_ptrs, v_ptrs, num_layers, host_base, layout,
                                          host_idx_cpu, dev_idx, dev_idx_64, n_tokens, staging,
                                          staging_bytes, use_batched, stream, after_stream,
                                          bounds, job));
}

KVIO_API int kvio_transfer_direct_after(int direction, const uint64_t* k_ptrs,
                                        const uint64_t* v_ptrs, int32_t layer_begin,
                                        int32_t layer_count, void* host_base, kvio_layout layout,
                                        const void* host_idx, int host_idx_64,
                                        const void* dev_idx, int dev_idx_64, int64_t n_tokens,
                                        int host_inline, void* stream, void* after_stream,
                                        const kvio_bounds* bounds, void** job) {
    return finish(transfer_direct_after(direction, k_ptrs, v_ptrs, layer_begin, layer_count,
                                        host_base, layout, host_idx, host_idx_64, dev_idx,
                                        dev_idx_64, n_tokens, host_inline, stream, after_stream,
                                        bounds, job));
}

KVIO_API int kvio_job_status(void* job) {
    return job == nullptr ? static_cast<int>(cudaErrorInvalidValue)
                          : job_status(static_cast<Job*>(job), false);
}

KVIO_API int kvio_job_wait(void* job) {
    return job == nullptr ? static_cast<int>(cudaErrorInvalidValue)
                          : job_status(static_cast<Job*>(job), true);
}

KVIO_API void kvio_job_release(void* job) {
    if (job != nullptr) job_queue().release(static_cast<Job*>(job));
}

KVIO_API void kvio_jobs_flush(void) { job_queue().flush(); }

KVIO_API int kvio_load_all_staged(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                  int32_t num_layers, void* host_base, kvio_layout layout,
                                  const int64_t* host_idx_cpu, const void* dev_idx,
                                  int dev_idx_64, int64_t n_tokens, void* staging,
                                  int64_t staging_bytes, int use_batched, void* stream,
                                  const kvio_bounds* bounds) {
    return finish(transfer_staged(kHostToDevice, k_ptrs, v_ptrs, num_layers, host_base,
                                  layout, host_idx_cpu, dev_idx, dev_idx_64, n_tokens, staging,
                                  staging_bytes, use_batched, stream, bounds));
}

KVIO_API int kvio_load_layer_dma(void* k_dst, void* v_dst, int32_t layer, void* host_base,
                                 kvio_layout layout, const int64_t* host_idx_cpu,
                                 const int64_t* dev_idx_cpu, int64_t n_tokens, int use_batched,
                                 void* stream, const kvio_bounds* bounds) {
    return finish(load_layer_dma(static_cast<char*>(k_dst), static_cast<char*>(v_dst), layer,
                                 host_base, layout, host_idx_cpu, dev_idx_cpu, n_tokens,
                                 use_batched, stream, bounds));
}

KVIO_API int kvio_has_layer_signals(void) { return wait_fn() != nullptr ? 1 : 0; }

KVIO_API int kvio_load_layers_signaled(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                       int32_t num_layers, void* host_base, kvio_layout layout,
                                       const void* host_idx, int host_idx_64,
                                       const void* dev_idx, int dev_idx_64, int64_t n_tokens,
                                       uint32_t* counters, uint32_t* flags, uint32_t epoch,
                                       void* stream, const kvio_bounds* bounds) {
    return finish(load_layers_signaled(k_ptrs, v_ptrs, num_layers, host_base, layout,
                                       host_idx, host_idx_64, dev_idx, dev_idx_64, n_tokens,
                                       counters, flags, epoch, stream, bounds));
}

KVIO_API int kvio_load_layers_signaled_inline(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                              int32_t num_layers, void* host_base,
                                              kvio_layout layout, const void* host_idx,
                                              int host_idx_64, const void* dev_idx,
                                              int dev_idx_64, int64_t n_tokens,
                                              uint32_t* counters, uint32_t* flags,
                                              uint32_t epoch, void* stream,
                                              const kvio_bounds* bounds) {
    return finish(load_layers_signaled(k_ptrs, v_ptrs, num_layers, host_base, layout,
                                       host_idx, host_idx_64, dev_idx, dev_idx_64, n_tokens,
                                       counters, flags, epoch, stream, bounds, true));
}

KVIO_API int kvio_wait_layer_signal(const uint32_t* flag, uint32_t epoch, void* stream) {
    if (flag == nullptr) {
        return cudaErrorInvalidValue;
    }
    const WaitValue32Fn fn = wait_fn();
    if (fn == nullptr) {
        return cudaErrorNotSupported;
    }
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    DeviceGuard guard;
    const cudaError_t entered = guard.enter(s);
    if (entered != cudaSuccess) {
        return finish(entered);
    }
    // CUresult and cudaError_t share their codes for everything this call can return
    return fn(s, static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(flag)), epoch,
              kWaitValueGeq);
}

KVIO_API int kvio_signaled_layer_group(const uint64_t* k_ptrs, const uint64_t* v_ptrs,
                                       int32_t num_layers, void* host_base, kvio_layout layout,
                                       int64_t n_tokens, void* stream, int32_t* group) {
    return finish(signaled_layer_group(k_ptrs, v_ptrs, num_layers, host_base, layout, n_tokens,
                                       stream, group));
}

KVIO_API int kvio_copy_to_device(void* dst, const void* src, int64_t nbytes, void* stream) {
    return finish(copy_to_device(dst, src, nbytes, static_cast<cudaStream_t>(stream)));
}
