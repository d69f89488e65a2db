// Index arithmetic shared by the kernels (device) and the launcher (host). No includes: the
// device build has no C library headers (-nogpuinc), so the types come from clang's predefined
// macros.
#ifndef KVIO_ROCM_INDEX_H
#define KVIO_ROCM_INDEX_H

typedef __UINT64_TYPE__ kvio_u64;
typedef __INT64_TYPE__ kvio_i64;
typedef __UINT32_TYPE__ kvio_u32;
typedef __INT32_TYPE__ kvio_i32;

#if defined(__HIP__) && !defined(KVIO_EMULATE)
#define KVIO_HD __host__ __device__
#ifndef __host__
#define __host__ __attribute__((host))
#endif
#ifndef __device__
#define __device__ __attribute__((device))
#endif
#else
#define KVIO_HD
#endif

// Division by a run-time invariant divisor d in [1, 2^31] with one multiply-high and a shift
// (Granlund & Montgomery): s = ceil(log2 d), mul = floor(2^32 * (2^s - d) / d) + 1,
// n / d = (mulhi(n, mul) + n) >> s.
struct kvio_fastdiv {
    kvio_u32 divisor;
    kvio_u32 mul;
    kvio_u32 shift;
};

static inline KVIO_HD kvio_fastdiv kvio_fastdiv_make(kvio_u32 d) {
    kvio_fastdiv f;
    kvio_u32 s = 0;
    while (s < 32 && ((kvio_u64)1 << s) < d) ++s;
    f.divisor = d;
    f.shift = s;
    f.mul = (kvio_u32)(((((kvio_u64)1 << s) - d) << 32) / d + 1);
    return f;
}

// n / d for n < 2^31 (the 32-bit sum cannot overflow: mulhi(n, mul) < n).
static inline KVIO_HD kvio_u32 kvio_fastdiv_div(kvio_u32 n, kvio_fastdiv f) {
    const kvio_u32 hi = (kvio_u32)(((kvio_u64)n * f.mul) >> 32);
    return (hi + n) >> f.shift;
}

// n / d for any 32-bit n (64-bit sum).
static inline KVIO_HD kvio_u32 kvio_fastdiv_div_u32(kvio_u32 n, kvio_fastdiv f) {
    const kvio_u64 hi = ((kvio_u64)n * f.mul) >> 32;
    return (kvio_u32)((hi + n) >> f.shift);
}

// (h / P, h % P) for a host token index h >= 0. 32-bit reciprocal when h < 2^32 (every real
// host pool); a 64-bit division otherwise.
static inline KVIO_HD void kvio_page_divmod(kvio_i64 h, kvio_fastdiv page, kvio_i64* q,
                                            kvio_i64* r) {
    const kvio_u64 uh = (kvio_u64)h;
    if ((uh >> 32) == 0) {
        const kvio_u32 qq = kvio_fastdiv_div_u32((kvio_u32)uh, page);
        *q = (kvio_i64)qq;
        *r = (kvio_i64)((kvio_u32)uh - qq * page.divisor);
    } else {
        *q = (kvio_i64)(uh / page.divisor);
        *r = (kvio_i64)(uh % page.divisor);
    }
}

#endif // KVIO_ROCM_INDEX_H
