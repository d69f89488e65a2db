// Device code of kvio_rocm: the copy kernels of docs/native-abi.md.
//
// This file includes NO ROCm header. It compiles three ways:
//   * as HIP device code with plain clang, for codegen checks on a machine without ROCm:
//       clang -x hip --cuda-device-only -nogpulib -nogpuinc --offload-arch=gfx942 -O3 -S
//     (kvio_rocm/codegen.py does this and checks the assembly of every kernel);
//   * inside kvio_rocm.hip, compiled by hipcc / ROCm clang into the shared library;
//   * as plain C++ on the CPU with -DKVIO_EMULATE (tests run the same kernel bodies, thread by
//     thread, against the reference; see kvio_emul.h).
//
// Work decomposition (one generic kernel for every layout):
//   A "segment" is one chunk (chunk_bytes contiguous bytes on both sides) of one (token, layer,
//   kv, chunk). A work item is one VEC-byte vector of one segment; items are numbered
//       w = segment * vpc + v            (vpc = chunk_bytes / VEC vectors per chunk)
//   and segments are numbered with the dimension whose host stride is smallest innermost
//   (ORDER), so consecutive items are consecutive host addresses within a chunk and, for the
//   usual layouts, across chunks too. Each wave owns tiles of UNROLL*WAVE consecutive items;
//   lane i of the wave takes items tile + k*WAVE + i (k < UNROLL): consecutive lanes touch
//   consecutive host addresses, and every lane issues UNROLL loads before its first store.
//   All index math is 32-bit with precomputed reciprocals (kvio_index.h); the host splits a
//   launch so that an item count never exceeds 2^30.
//
// Alignment: the host picks VEC=16 only when the host base, every host stride and chunk_bytes
// are multiples of 16 (8 likewise). Device offsets are multiples of chunk_bytes; the layer
// base addresses live in device memory, so kvcore checks the layer tensors' alignment
// (capability element_alignment=16) before calling. gfx9 also executes a misaligned
// dwordx4 correctly, only slower.
#ifndef KVIO_ROCM_DEVICE_H
#define KVIO_ROCM_DEVICE_H

#include "kvio_index.h"

#if defined(KVIO_EMULATE)
// ---- CPU emulation: the kernel bodies run as ordinary functions, one work-item at a time.
#define KVIO_GLOBAL
#define KVIO_DEVICE static inline
#define KVIO_DEVICE_MEMBER inline
#define KVIO_KERNEL extern "C" KVIO_API_EMUL
#ifndef KVIO_API_EMUL
#define KVIO_API_EMUL
#endif
extern thread_local unsigned kvio_emul_workitem_x;
extern thread_local unsigned kvio_emul_workgroup_x;
#define KVIO_WORKITEM_ID_X() (kvio_emul_workitem_x)
#define KVIO_WORKGROUP_ID_X() (kvio_emul_workgroup_x)
#ifndef KVIO_WAVE
#define KVIO_WAVE 64 // emulate the wave64 CDNA GPUs
#endif
#else
// ---- HIP (device pass, host pass, or device-only codegen without ROCm headers).
#ifndef __global__
#define __global__ __attribute__((global))
#endif
#ifndef __device__
#define __device__ __attribute__((device))
#endif
// Address space 1 (global): host memory mapped into the GPU's address space and device memory
// are both reached with global_* instructions; without it the compiler would emit flat_*.
#define KVIO_GLOBAL __attribute__((address_space(1)))
#define KVIO_DEVICE static __device__ inline __attribute__((always_inline))
#define KVIO_DEVICE_MEMBER __device__ inline __attribute__((always_inline))
#define KVIO_KERNEL                                                                          \
    extern "C" __global__ __attribute__((amdgpu_flat_work_group_size(1, KVIO_BLOCK_THREADS)))
#define KVIO_WORKITEM_ID_X() (__builtin_amdgcn_workitem_id_x())
#define KVIO_WORKGROUP_ID_X() (__builtin_amdgcn_workgroup_id_x())
// Wavefront size of the target. Older clang predefines it; clang >= 22 dropped the macro, so
// the target family decides: GCN/CDNA (gfx9xx: MI100..MI355) run wave64 only. RDNA
// (gfx10-12) default to wave32 in HIP. The build may override with -DKVIO_WAVE=N. The value
// shapes the access pattern only: the mapping is a bijection for any true wave size.
#ifndef KVIO_WAVE
#if defined(__AMDGCN_WAVEFRONT_SIZE__)
#define KVIO_WAVE __AMDGCN_WAVEFRONT_SIZE__
#elif defined(__AMDGCN_WAVEFRONT_SIZE)
#define KVIO_WAVE __AMDGCN_WAVEFRONT_SIZE
#elif defined(__GFX9__)
#define KVIO_WAVE 64
#elif defined(__AMDGCN__)
#define KVIO_WAVE 32
#else
#define KVIO_WAVE 64 // host pass: kernels are not code-generated there
#endif
#endif
#endif

// Threads per workgroup. The host launches exactly this many (kvio_rocm.hip).
#define KVIO_BLOCK_THREADS 256
// 16-byte (or 8-byte) vectors each lane loads before it stores any of them.
#define KVIO_UNROLL 4

static_assert(KVIO_WAVE == 32 || KVIO_WAVE == 64, "wavefront size must be 32 or 64");
static_assert(KVIO_BLOCK_THREADS % KVIO_WAVE == 0, "a workgroup holds whole wavefronts");

// One 16-byte / 8-byte global access each: clang ext vectors, loaded and stored with ONE
// __builtin_nontemporal_load/store, which the AMDGPU backend emits as a single
// global_load_dwordx4 ... nt / global_store_dwordx4 ... nt (dwordx2 for 8 bytes).
typedef unsigned int kvio_u32x4 __attribute__((ext_vector_type(4)));
typedef unsigned int kvio_u32x2 __attribute__((ext_vector_type(2)));
static_assert(sizeof(kvio_u32x4) == 16, "u32x4 is 16 bytes");
static_assert(sizeof(kvio_u32x2) == 8, "u32x2 is 8 bytes");

template <int VEC> struct kvio_vec;
template <> struct kvio_vec<16> { typedef kvio_u32x4 type; };
template <> struct kvio_vec<8> { typedef kvio_u32x2 type; };
template <> struct kvio_vec<1> { typedef unsigned char type; };

// How the payload is moved: one non-temporal access of the whole vector each way. (A policy
// so that csrc/broken_scalar.hip can build the same kernel with a broken access and prove the
// codegen checker notices.)
template <int VEC> struct kvio_nt_access {
    typedef typename kvio_vec<VEC>::type vec_t;
    static KVIO_DEVICE_MEMBER vec_t load(kvio_u64 src) {
        return __builtin_nontemporal_load((const KVIO_GLOBAL vec_t*)src);
    }
    static KVIO_DEVICE_MEMBER void store(kvio_u64 dst, vec_t v) {
        __builtin_nontemporal_store(v, (KVIO_GLOBAL vec_t*)dst);
    }
};

// Segment orders: which dimension varies fastest after the vector within a chunk.
enum { KVIO_ORDER_TOKEN_INNER = 0, KVIO_ORDER_LAYER_INNER = 1 };

// Kernel argument (passed by value in the kernarg segment; read with scalar loads).
struct kvio_copy_params {
    kvio_u64 k_ptrs;    // device array of uint64 layer base addresses (K, or the MLA latent)
    kvio_u64 v_ptrs;    // device array of uint64 layer base addresses (V); 0 for MLA
    kvio_u64 host_base; // host buffer or staging image (HOST MEMORY note in kvio_copy_body)
    kvio_u64 host_idx;  // device-accessible token indices of the host side; 0 = identity (h = t)
    kvio_u64 dev_idx;   // device-accessible token indices of the device side
    kvio_i64 kv_stride, layer_stride, page_stride, token_stride, chunk_stride;
    kvio_i64 elem_bytes, chunk_bytes;
    kvio_u32 total;      // work items of this launch (< 2^31)
    kvio_u32 num_blocks; // workgroups of this launch (grid-stride over tiles)
    kvio_fastdiv vpc;    // vectors per chunk
    kvio_fastdiv dim0;   // innermost segment dimension (tokens or layers, see ORDER)
    kvio_fastdiv dim1;
    kvio_fastdiv dim2;   // outermost before kv
    kvio_fastdiv page;   // page_size, for h / P and h % P
    kvio_i32 layer_begin;
    kvio_i32 direction;  // 0: device -> host, 1: host -> device
    kvio_i32 host_idx_64;
    kvio_i32 dev_idx_64;
    // ABI v2 bounds (kvio_bounds): an item whose host index is outside [0, host_tokens) or
    // whose device index is outside [0, device_tokens) is skipped (no load, no store) and
    // recorded in the kvio_report at `report` (pinned host memory) with `epoch`. The identity
    // host index of the staging image is always in range (the launcher passes INT64_MAX).
    kvio_i64 host_tokens;
    kvio_i64 device_tokens;
    kvio_u64 report;     // kvio_report*: host_epoch, host_value, device_epoch, device_value
    kvio_u64 epoch;
};

// Host and device passes must agree on the kernel argument's layout (both LP64; the
// assembly's metadata shows .size: 216 for it).
static_assert(sizeof(kvio_copy_params) == 216, "kvio_copy_params layout changed");

// One plain system-scope store of a 64-bit report field: a relaxed atomic STORE (not a
// read-modify-write; host memory need not support PCIe atomics), so the value reaches host
// memory whatever the GPU's caches do. The emulation build stores plainly.
KVIO_DEVICE void kvio_report_store(kvio_u64 addr, kvio_u64 value) {
#if defined(KVIO_EMULATE)
    __atomic_store_n((volatile kvio_u64*)addr, value, __ATOMIC_RELAXED);
#else
    __hip_atomic_store((KVIO_GLOBAL kvio_u64*)addr, value, __ATOMIC_RELAXED,
                       __HIP_MEMORY_SCOPE_SYSTEM);
#endif
}

// Records a bad index: value first, then epoch (offsets of kvio_report; side 0 host, 16
// device). Racing work-items all store some bad value and the same epoch.
KVIO_DEVICE void kvio_report_bad(const kvio_copy_params& p, kvio_u32 side, kvio_i64 value) {
    kvio_report_store(p.report + side + 8, (kvio_u64)value);
    kvio_report_store(p.report + side, p.epoch);
}

// One token index from an int32 (shift 2) or int64 (shift 3) array, written without a
// branch: two dword loads, the second at +4 for int64 and a re-read of the same word for
// int32. Indices are read with ordinary (cached) loads; only the payload is non-temporal.
KVIO_DEVICE kvio_i64 kvio_load_index(kvio_u64 base, kvio_u32 i, kvio_u32 shift) {
    const kvio_u64 addr = base + ((kvio_u64)i << shift);
    const kvio_u32 lo = *(const KVIO_GLOBAL kvio_u32*)addr;
    const kvio_u32 hi = *(const KVIO_GLOBAL kvio_u32*)(addr + (shift == 3 ? 4 : 0));
    return shift == 3 ? (kvio_i64)(((kvio_u64)hi << 32) | lo) : (kvio_i64)(kvio_i32)lo;
}

// Coordinates of work item w: token t, layer l (relative to layer_begin), chunk c, kv,
// vector v.
struct kvio_coord {
    kvio_u32 t, l, c, kv, v;
};

template <int ORDER>
KVIO_DEVICE kvio_coord kvio_decompose(const kvio_copy_params& p, kvio_u32 w) {
    kvio_coord r;
    const kvio_u32 seg = kvio_fastdiv_div(w, p.vpc);
    r.v = w - seg * p.vpc.divisor;
    const kvio_u32 q0 = kvio_fastdiv_div(seg, p.dim0);
    const kvio_u32 i0 = seg - q0 * p.dim0.divisor;
    const kvio_u32 q1 = kvio_fastdiv_div(q0, p.dim1);
    const kvio_u32 i1 = q0 - q1 * p.dim1.divisor;
    r.kv = kvio_fastdiv_div(q1, p.dim2);
    const kvio_u32 i2 = q1 - r.kv * p.dim2.divisor;
    if (ORDER == KVIO_ORDER_LAYER_INNER) {
        r.l = i0; r.t = i1; r.c = i2;
    } else {
        r.t = i0; r.c = i1; r.l = i2;
    }
    return r;
}

// The generic strided copy. VEC: 16 (every address and size 16-B aligned), 8, or 1 (bytes).
// Per iteration each lane: decomposes UNROLL items (ALU only), issues all their index and
// layer-table loads, computes the addresses, issues UNROLL payload loads back to back, then
// the UNROLL stores. No load result is waited for between two payload loads.
template <int VEC, int ORDER, int WAVE, class Access = kvio_nt_access<VEC>>
KVIO_DEVICE void kvio_copy_body(const kvio_copy_params& p) {
    typedef typename Access::vec_t vec_t;
    constexpr kvio_u32 kWavesPerBlock = KVIO_BLOCK_THREADS / WAVE;
    constexpr kvio_u32 kTile = KVIO_UNROLL * WAVE; // items per wave per iteration
    const kvio_u32 tid = KVIO_WORKITEM_ID_X();
    const kvio_u32 lane = tid % WAVE;
    const kvio_u32 wave = KVIO_WORKGROUP_ID_X() * kWavesPerBlock + tid / WAVE;
    const kvio_u32 stride = p.num_blocks * kWavesPerBlock * kTile;
    const kvio_u32 last = p.total - 1;
    const kvio_u32 dev_shift = p.dev_idx_64 ? 3u : 2u;
    // Identity host indices (the staging image): read the device index array instead (always
    // valid memory) and ignore the value.
    const kvio_u64 host_idx_base = p.host_idx ? p.host_idx : p.dev_idx;
    const kvio_u32 host_shift = p.host_idx ? (p.host_idx_64 ? 3u : 2u) : dev_shift;

    for (kvio_u32 base = wave * kTile; base < p.total; base += stride) {
        kvio_coord co[KVIO_UNROLL];
        kvio_i64 h[KVIO_UNROLL], d[KVIO_UNROLL];
        kvio_u64 layer_base[KVIO_UNROLL], src[KVIO_UNROLL], dst[KVIO_UNROLL];
        vec_t buf[KVIO_UNROLL];
#pragma unroll
        for (int k = 0; k < KVIO_UNROLL; ++k) {
            // Items past the end take the last item (see the stores below).
            const kvio_u32 w = base + (kvio_u32)k * WAVE + lane;
            co[k] = kvio_decompose<ORDER>(p, w < p.total ? w : last);
        }
#pragma unroll
        for (int k = 0; k < KVIO_UNROLL; ++k) {
            d[k] = kvio_load_index(p.dev_idx, co[k].t, dev_shift);
            h[k] = kvio_load_index(host_idx_base, co[k].t, host_shift);
            // kv is 0 or 1: a select between two kernarg scalars (indexing a private array
            // would put it in scratch).
            const kvio_u64 table = co[k].kv ? p.v_ptrs : p.k_ptrs;
            layer_base[k] = ((const KVIO_GLOBAL kvio_u64*)table)[p.layer_begin + (kvio_i32)co[k].l];
        }
        bool ok[KVIO_UNROLL];
        bool host_bad = false, dev_bad = false;
        kvio_i64 host_value = 0, dev_value = 0;
#pragma unroll
        for (int k = 0; k < KVIO_UNROLL; ++k) {
            const kvio_coord c = co[k];
            const kvio_i64 hk = p.host_idx ? h[k] : (kvio_i64)c.t;
            // Bounds (ABI v2): one unsigned compare per side also catches negative values.
            const bool host_ok = (kvio_u64)hk < (kvio_u64)p.host_tokens;
            const bool dev_ok = (kvio_u64)d[k] < (kvio_u64)p.device_tokens;
            ok[k] = host_ok && dev_ok;
            if (!host_ok) {
                host_bad = true;
                host_value = hk;
            }
            if (!dev_ok) {
                dev_bad = true;
                dev_value = d[k];
            }
            const kvio_u64 dev = layer_base[k] + (kvio_u64)(d[k] * p.elem_bytes) +
                                 (kvio_u64)c.c * (kvio_u64)p.chunk_bytes + (kvio_u64)c.v * VEC;
            kvio_i64 page, off;
            kvio_page_divmod(hk, p.page, &page, &off);
            // HOST MEMORY: host_base is dereferenced by the GPU at the same numeric address the
            // CPU uses. That holds for hipHostMalloc'd memory and torch pinned memory
            // (pin_memory() / torch.empty(..., pin_memory=True), which ROCm allocates with
            // hipHostMalloc). Memory registered with hipHostRegister is mapped at a DIFFERENT
            // device address (hipHostGetDevicePointer); passing such a host pointer here would
            // fault. kvio_rocm therefore declares "pinned" (hipHostMalloc) as its host
            // allocator.
            const kvio_i64 layer = (kvio_i64)p.layer_begin + (kvio_i64)c.l; // absolute
            const kvio_u64 host =
                p.host_base +
                (kvio_u64)((kvio_i64)c.kv * p.kv_stride + layer * p.layer_stride +
                           page * p.page_stride + off * p.token_stride +
                           (kvio_i64)c.c * p.chunk_stride) +
                (kvio_u64)c.v * VEC;
            src[k] = p.direction ? host : dev;
            dst[k] = p.direction ? dev : host;
        }
        if (!host_bad && !dev_bad) {
            // The hot path: every item of this lane in range.
#pragma unroll
            for (int k = 0; k < KVIO_UNROLL; ++k)
                buf[k] = Access::load(src[k]);
            // Unconditional stores: a lane whose item is past the end rewrites the last item
            // (the same bytes to the same address, and that item belongs to this wave's
            // tile). A predicated store would let the compiler sink its load under the branch
            // and wait on it there.
#pragma unroll
            for (int k = 0; k < KVIO_UNROLL; ++k)
                Access::store(dst[k], buf[k]);
        } else {
            // A lane with an out-of-range index (a bug upstream): its skipped items touch no
            // byte, the others are copied one at a time (a cold path: one vector in flight
            // keeps its registers few, so the hot path's occupancy is what it was), then the
            // lane records one bad value per side.
#pragma unroll
            for (int k = 0; k < KVIO_UNROLL; ++k)
                if (ok[k]) Access::store(dst[k], Access::load(src[k]));
            if (host_bad) kvio_report_bad(p, 0, host_value);
            if (dev_bad) kvio_report_bad(p, 16, dev_value);
        }
    }
}

// The kernels, extern "C" so host and device passes agree on the symbol whatever KVIO_WAVE is.
#define KVIO_DEFINE_COPY_KERNEL(NAME, VEC, ORDER)                                            \
    KVIO_KERNEL void NAME(kvio_copy_params p) { kvio_copy_body<VEC, ORDER, KVIO_WAVE>(p); }

KVIO_DEFINE_COPY_KERNEL(kvio_copy_v16_token_inner, 16, KVIO_ORDER_TOKEN_INNER)
KVIO_DEFINE_COPY_KERNEL(kvio_copy_v16_layer_inner, 16, KVIO_ORDER_LAYER_INNER)
KVIO_DEFINE_COPY_KERNEL(kvio_copy_v8_token_inner, 8, KVIO_ORDER_TOKEN_INNER)
KVIO_DEFINE_COPY_KERNEL(kvio_copy_v8_layer_inner, 8, KVIO_ORDER_LAYER_INNER)
KVIO_DEFINE_COPY_KERNEL(kvio_copy_v1_token_inner, 1, KVIO_ORDER_TOKEN_INNER)
KVIO_DEFINE_COPY_KERNEL(kvio_copy_v1_layer_inner, 1, KVIO_ORDER_LAYER_INNER)

#endif // KVIO_ROCM_DEVICE_H
