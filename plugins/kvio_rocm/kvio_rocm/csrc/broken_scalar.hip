// DELIBERATELY BROKEN kernels: fixtures that prove kvio_rocm/codegen.py's checker can fail.
// Never built into the library (build.py lists its sources explicitly).
//
// Each kernel is the real generic copy kernel of kvio_device.h with only the payload access
// replaced by a wrong one:
//   kvio_broken_v16_scalar_store  the "four-scalar" form: one 16-B nt load, then four separate
//                                 4-byte non-temporal stores (global_store_dword ... nt x4)
//   kvio_broken_v16_scalar_load   four separate 4-byte non-temporal loads, one 16-B nt store
//   kvio_broken_v16_plain         whole 16-B vectors, but plain loads and stores (no nt)
//   kvio_broken_v16_scratch       correct accesses, but the payload bounces through a private
//                                 array indexed at run time, which lives in scratch memory
// Note: written plainly, four adjacent 4-byte nontemporal accesses are merged back into one
// dwordx4 ... nt by LLVM's load/store vectorizer (clang 19 and 22, -O3, gfx942/gfx950). The
// empty asm with a memory clobber between the pieces stands for whatever keeps a real kernel
// from being merged (unknown aliasing, a fence, -O0, an opaque helper): it forces the
// four-scalar form into the assembly so the checker has something to catch.
#define KVIO_BROKEN_SPLIT() __asm__ volatile("" ::: "memory")
#include "kvio_device.h"

struct kvio_broken_scalar_store_access {
    typedef kvio_u32x4 vec_t;
    static KVIO_DEVICE_MEMBER vec_t load(kvio_u64 src) {
        return __builtin_nontemporal_load((const KVIO_GLOBAL vec_t*)src);
    }
    static KVIO_DEVICE_MEMBER void store(kvio_u64 dst, vec_t v) {
        KVIO_GLOBAL unsigned int* d = (KVIO_GLOBAL unsigned int*)dst;
        __builtin_nontemporal_store(v.x, d + 0);
        KVIO_BROKEN_SPLIT();
        __builtin_nontemporal_store(v.y, d + 1);
        KVIO_BROKEN_SPLIT();
        __builtin_nontemporal_store(v.z, d + 2);
        KVIO_BROKEN_SPLIT();
        __builtin_nontemporal_store(v.w, d + 3);
    }
};

struct kvio_broken_scalar_load_access {
    typedef kvio_u32x4 vec_t;
    static KVIO_DEVICE_MEMBER vec_t load(kvio_u64 src) {
        const KVIO_GLOBAL unsigned int* s = (const KVIO_GLOBAL unsigned int*)src;
        vec_t v;
        v.x = __builtin_nontemporal_load(s + 0);
        KVIO_BROKEN_SPLIT();
        v.y = __builtin_nontemporal_load(s + 1);
        KVIO_BROKEN_SPLIT();
        v.z = __builtin_nontemporal_load(s + 2);
        KVIO_BROKEN_SPLIT();
        v.w = __builtin_nontemporal_load(s + 3);
        return v;
    }
    static KVIO_DEVICE_MEMBER void store(kvio_u64 dst, vec_t v) {
        __builtin_nontemporal_store(v, (KVIO_GLOBAL vec_t*)dst);
    }
};

struct kvio_broken_plain_access {
    typedef kvio_u32x4 vec_t;
    static KVIO_DEVICE_MEMBER vec_t load(kvio_u64 src) { return *(const KVIO_GLOBAL vec_t*)src; }
    static KVIO_DEVICE_MEMBER void store(kvio_u64 dst, vec_t v) { *(KVIO_GLOBAL vec_t*)dst = v; }
};

struct kvio_broken_scratch_access {
    typedef kvio_u32x4 vec_t;
    static KVIO_DEVICE_MEMBER vec_t load(kvio_u64 src) {
        vec_t bounce[64];
        const unsigned slot = (unsigned)(src >> 4) & 63u;
        for (int i = 0; i < 64; ++i) bounce[i] = (vec_t)(unsigned)i;
        bounce[slot] = __builtin_nontemporal_load((const KVIO_GLOBAL vec_t*)src);
        return bounce[(slot * 7u) & 63u] + bounce[slot];
    }
    static KVIO_DEVICE_MEMBER void store(kvio_u64 dst, vec_t v) {
        __builtin_nontemporal_store(v, (KVIO_GLOBAL vec_t*)dst);
    }
};

KVIO_KERNEL void kvio_broken_v16_scalar_store(kvio_copy_params p) {
    kvio_copy_body<16, KVIO_ORDER_TOKEN_INNER, KVIO_WAVE, kvio_broken_scalar_store_access>(p);
}
KVIO_KERNEL void kvio_broken_v16_scalar_load(kvio_copy_params p) {
    kvio_copy_body<16, KVIO_ORDER_TOKEN_INNER, KVIO_WAVE, kvio_broken_scalar_load_access>(p);
}
KVIO_KERNEL void kvio_broken_v16_plain(kvio_copy_params p) {
    kvio_copy_body<16, KVIO_ORDER_TOKEN_INNER, KVIO_WAVE, kvio_broken_plain_access>(p);
}
KVIO_KERNEL void kvio_broken_v16_scratch(kvio_copy_params p) {
    kvio_copy_body<16, KVIO_ORDER_TOKEN_INNER, KVIO_WAVE, kvio_broken_scratch_access>(p);
}
