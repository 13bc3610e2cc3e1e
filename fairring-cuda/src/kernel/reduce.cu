// fairring's device reduction kernels, compiled at run time by NVRTC.
//
//   fairring_reduce_<op>_<type>(dst, src, head, vectors, tail)   dst[i] = dst[i] op src[i]
//   fairring_reduce_many_<op>_<type>(dst, srcs, count, head, vectors, tail)
//                                   dst[i] = dst[i] op srcs.p[0][i] op ... op srcs.p[count-1][i]
//   fairring_divide_<type>(dst, n, head, vectors, tail)          dst[i] = dst[i] / n
//
// op: sum, product, min, max, and for integer types and bool band, bor, bxor;
// type: f32 f64 f16 bf16 i32 i64 u8 i8 i16 bool (divide: floats).
// The semantics are fairring-core's host kernels' (fairring_core::reduce), bit for
// bit except NaN payloads: wrapping integer arithmetic; bool as logic (any
// non-zero byte true, results 0 or 1); f16 and bf16 widened to f32
// exactly, combined in f32 and rounded to nearest even; float min and max propagate
// NaN and order -0 below +0. Nothing here may be compiled with fast-math flags
// (flush-to-zero, approximate division).
//
// The host splits the elements into `head` scalar elements, `vectors` 16-byte
// vectors and `tail` scalar elements, so that the vectors are 16-byte aligned in
// both operands; operands whose misalignment differs run as `head` alone. Every
// part is walked grid-stride, so any grid covers any size. dst and src never
// overlap (the host refuses), so src is read through the read-only path.
//
// The many-source kernel reads dst once and writes it once whatever the number
// of sources (a server folding M-1 contributions moves (M+1) x bytes, where
// M-1 pairwise passes move 3(M-1) x bytes). It combines left to right in the
// accumulator type and stores once: for f16 and bf16 the whole combination is
// kept in f32 and rounded once, as fairring-core's reduce_many does.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;

#define INLINE __device__ __forceinline__

// ---- half-precision conversions -------------------------------------------------

#ifdef FAIRRING_HOST_EMULATION
// The host emulation (kernel/emulation.rs, tests only) runs this file as C++ on
// the CPU, where the conversions are the compiler's IEEE _Float16 ones.
INLINE float f16_load(u16 h) { return fairring_emulated_f16_to_f32(h); }
INLINE u16 f16_store(float f) { return fairring_emulated_f32_to_f16(f); }
#else
INLINE float f16_load(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

INLINE u16 f16_store(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

INLINE float bf16_load(u16 b) { return __uint_as_float(((u32)b) << 16); }

INLINE u16 bf16_store(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);  // quiet NaN
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);                // nearest even
}

// ---- element types: storage, accumulator, conversions -----------------------------

template <class S, class A>
struct Native {
    typedef S Store;
    typedef A Acc;
    static INLINE A load(S s) { return (A)s; }
    static INLINE S store(A a) { return (S)a; }
};

struct Half {
    typedef u16 Store;
    typedef float Acc;
    static INLINE float load(u16 s) { return f16_load(s); }
    static INLINE u16 store(float a) { return f16_store(a); }
};

struct BHalf {
    typedef u16 Store;
    typedef float Acc;
    static INLINE float load(u16 s) { return bf16_load(s); }
    static INLINE u16 store(float a) { return bf16_store(a); }
};

typedef Native<float, float> F32;
typedef Native<double, double> F64;
typedef Half F16;
typedef BHalf BF16;
typedef Native<int, int> I32;
typedef Native<i64, i64> I64;
// 8-bit types combine in 32 bits; storing truncates modulo 256, which is exactly
// wrapping 8-bit arithmetic.
typedef Native<unsigned char, u32> U8;
typedef Native<signed char, int> I8;
// As the 8-bit types: 16 bits combine in 32 and store modulo 65536.
typedef Native<short, int> I16;

// A bool combines as a truth value, whose operators (below) are logical: sum
// and max are or, product and min and.
struct Truth {
    u32 v;
};

struct Boolean {
    typedef unsigned char Store;
    typedef Truth Acc;
    static INLINE Truth load(unsigned char s) {
        Truth t;
        t.v = s != 0;
        return t;
    }
    static INLINE unsigned char store(Truth a) { return (unsigned char)a.v; }
};
typedef Boolean BOOL;

// ---- operators ---------------------------------------------------------------------

INLINE float op_sum(float a, float b) { return a + b; }
INLINE double op_sum(double a, double b) { return a + b; }
INLINE int op_sum(int a, int b) { return (int)((u32)a + (u32)b); }
INLINE u32 op_sum(u32 a, u32 b) { return a + b; }
INLINE i64 op_sum(i64 a, i64 b) { return (i64)((u64)a + (u64)b); }

INLINE float op_product(float a, float b) { return a * b; }
INLINE double op_product(double a, double b) { return a * b; }
INLINE int op_product(int a, int b) { return (int)((u32)a * (u32)b); }
INLINE u32 op_product(u32 a, u32 b) { return a * b; }
INLINE i64 op_product(i64 a, i64 b) { return (i64)((u64)a * (u64)b); }

// Equal values (+0 and -0 included) and NaNs fall through to the bit patterns:
// OR gives the value, -0 for mixed zeros, and a NaN if either is one; for max,
// AND gives +0 for mixed zeros.
INLINE float op_min(float a, float b) {
    if (a < b) return a;
    if (b < a) return b;
    return __uint_as_float(__float_as_uint(a) | __float_as_uint(b));
}
INLINE double op_min(double a, double b) {
    if (a < b) return a;
    if (b < a) return b;
    return __longlong_as_double(__double_as_longlong(a) | __double_as_longlong(b));
}
INLINE float op_max(float a, float b) {
    if (a > b) return a;
    if (b > a) return b;
    u32 x = __float_as_uint(a), y = __float_as_uint(b);
    return __uint_as_float(a == b ? (x & y) : (x | y));
}
INLINE double op_max(double a, double b) {
    if (a > b) return a;
    if (b > a) return b;
    i64 x = __double_as_longlong(a), y = __double_as_longlong(b);
    return __longlong_as_double(a == b ? (x & y) : (x | y));
}
template <class A> INLINE A op_min(A a, A b) { return b < a ? b : a; }
template <class A> INLINE A op_max(A a, A b) { return a < b ? b : a; }

// Integers only (no float kernel is built with them); truth values are 0 or 1.
template <class A> INLINE A op_band(A a, A b) { return a & b; }
template <class A> INLINE A op_bor(A a, A b) { return a | b; }
template <class A> INLINE A op_bxor(A a, A b) { return a ^ b; }

INLINE Truth truth(u32 v) {
    Truth t;
    t.v = v;
    return t;
}
INLINE Truth op_sum(Truth a, Truth b) { return truth(a.v | b.v); }
INLINE Truth op_product(Truth a, Truth b) { return truth(a.v & b.v); }
INLINE Truth op_min(Truth a, Truth b) { return truth(a.v & b.v); }
INLINE Truth op_max(Truth a, Truth b) { return truth(a.v | b.v); }
INLINE Truth op_band(Truth a, Truth b) { return truth(a.v & b.v); }
INLINE Truth op_bor(Truth a, Truth b) { return truth(a.v | b.v); }
INLINE Truth op_bxor(Truth a, Truth b) { return truth(a.v ^ b.v); }

struct Sum { template <class A> static INLINE A apply(A a, A b) { return op_sum(a, b); } };
struct Product { template <class A> static INLINE A apply(A a, A b) { return op_product(a, b); } };
struct Min { template <class A> static INLINE A apply(A a, A b) { return op_min(a, b); } };
struct Max { template <class A> static INLINE A apply(A a, A b) { return op_max(a, b); } };
struct BitAnd { template <class A> static INLINE A apply(A a, A b) { return op_band(a, b); } };
struct BitOr { template <class A> static INLINE A apply(A a, A b) { return op_bor(a, b); } };
struct BitXor { template <class A> static INLINE A apply(A a, A b) { return op_bxor(a, b); } };

// ---- the loops -------------------------------------------------------------------

template <class E>
union Vector {
    uint4 v;
    typename E::Store e[16 / sizeof(typename E::Store)];
};

template <class E, class Op>
INLINE uint4 combine(uint4 d, uint4 s) {
    Vector<E> a, b;
    a.v = d;
    b.v = s;
#pragma unroll
    for (int k = 0; k < (int)(16 / sizeof(typename E::Store)); ++k)
        a.e[k] = E::store(Op::apply(E::load(a.e[k]), E::load(b.e[k])));
    return a.v;
}

template <class E, class Op>
INLINE void reduce(typename E::Store* dst, const typename E::Store* __restrict__ src,
                   u64 head, u64 vectors, u64 tail) {
    typedef typename E::Store S;
    const u64 lanes = 16 / sizeof(S);
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = tid; i < head; i += stride)
        dst[i] = E::store(Op::apply(E::load(dst[i]), E::load(__ldg(src + i))));
    uint4* dv = (uint4*)(dst + head);
    const uint4* sv = (const uint4*)(src + head);
    // Two vectors per thread per pass: four 16-byte loads in flight before the
    // first use.
    for (u64 i = tid; i < vectors; i += 2 * stride) {
        const u64 j = i + stride;
        const bool second = j < vectors;
        uint4 d0 = dv[i], s0 = __ldg(sv + i), d1, s1;
        if (second) {
            d1 = dv[j];
            s1 = __ldg(sv + j);
        }
        dv[i] = combine<E, Op>(d0, s0);
        if (second) dv[j] = combine<E, Op>(d1, s1);
    }
    const u64 rest = head + vectors * lanes;
    for (u64 i = tid; i < tail; i += stride)
        dst[rest + i] = E::store(Op::apply(E::load(dst[rest + i]), E::load(__ldg(src + rest + i))));
}

// At most this many sources per many-source launch (the parameter block
// stays small); the host folds more in several launches.
#define MAX_SOURCES 15

struct Sources {
    const void* p[MAX_SOURCES];
};

template <class E, class Op>
INLINE typename E::Acc fold(typename E::Acc acc, const Sources& srcs, u32 count, u64 i) {
    typedef typename E::Store S;
    // Unrolled to the bound so that every source is a parameter read at a
    // fixed offset (a dynamic index would copy the block to local memory).
#pragma unroll
    for (u32 k = 0; k < MAX_SOURCES; ++k)
        if (k < count) acc = Op::apply(acc, E::load(__ldg((const S*)srcs.p[k] + i)));
    return acc;
}

template <class E, class Op>
INLINE void reduce_many(typename E::Store* dst, const Sources& srcs, u32 count, u64 head,
                        u64 vectors, u64 tail) {
    typedef typename E::Store S;
    typedef typename E::Acc A;
    const int lanes = (int)(16 / sizeof(S));
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = tid; i < head; i += stride)
        dst[i] = E::store(fold<E, Op>(E::load(dst[i]), srcs, count, i));
    uint4* dv = (uint4*)(dst + head);
    for (u64 i = tid; i < vectors; i += stride) {
        Vector<E> d;
        d.v = dv[i];
        A acc[16 / sizeof(S)];
#pragma unroll
        for (int l = 0; l < lanes; ++l) acc[l] = E::load(d.e[l]);
#pragma unroll
        for (u32 k = 0; k < MAX_SOURCES; ++k) {
            if (k >= count) break;
            Vector<E> s;
            s.v = __ldg((const uint4*)((const S*)srcs.p[k] + head) + i);
#pragma unroll
            for (int l = 0; l < lanes; ++l) acc[l] = Op::apply(acc[l], E::load(s.e[l]));
        }
#pragma unroll
        for (int l = 0; l < lanes; ++l) d.e[l] = E::store(acc[l]);
        dv[i] = d.v;
    }
    const u64 rest = head + vectors * (u64)lanes;
    for (u64 i = tid; i < tail; i += stride)
        dst[rest + i] = E::store(fold<E, Op>(E::load(dst[rest + i]), srcs, count, rest + i));
}

template <class E>
INLINE typename E::Store divided(typename E::Store x, typename E::Acc n) {
    return E::store(E::load(x) / n);
}

template <class E>
INLINE void divide(typename E::Store* dst, u32 n, u64 head, u64 vectors, u64 tail) {
    typedef typename E::Store S;
    typedef typename E::Acc A;
    const u64 lanes = 16 / sizeof(S);
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const A by = (A)n;
    for (u64 i = tid; i < head; i += stride) dst[i] = divided<E>(dst[i], by);
    uint4* dv = (uint4*)(dst + head);
    for (u64 i = tid; i < vectors; i += stride) {
        Vector<E> a;
        a.v = dv[i];
#pragma unroll
        for (int k = 0; k < (int)lanes; ++k) a.e[k] = divided<E>(a.e[k], by);
        dv[i] = a.v;
    }
    const u64 rest = head + vectors * lanes;
    for (u64 i = tid; i < tail; i += stride) dst[rest + i] = divided<E>(dst[rest + i], by);
}

// ---- entry points ------------------------------------------------------------------

#define THREADS 256

#define REDUCE(OP, NAME, TYPE)                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) fairring_reduce_##NAME##_##TYPE( \
        TYPE::Store* dst, const TYPE::Store* src, u64 head, u64 vectors, u64 tail) {    \
        reduce<TYPE, OP>(dst, src, head, vectors, tail);                                 \
    }

#define REDUCE_MANY(OP, NAME, TYPE)                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS)                               \
        fairring_reduce_many_##NAME##_##TYPE(TYPE::Store* dst, Sources srcs, u32 count,  \
                                             u64 head, u64 vectors, u64 tail) {          \
        reduce_many<TYPE, OP>(dst, srcs, count, head, vectors, tail);                    \
    }

#define REDUCE_ALL(TYPE)               \
    REDUCE(Sum, sum, TYPE)             \
    REDUCE(Product, product, TYPE)     \
    REDUCE(Min, min, TYPE)             \
    REDUCE(Max, max, TYPE)             \
    REDUCE_MANY(Sum, sum, TYPE)        \
    REDUCE_MANY(Product, product, TYPE) \
    REDUCE_MANY(Min, min, TYPE)        \
    REDUCE_MANY(Max, max, TYPE)

#define REDUCE_BITWISE(TYPE)           \
    REDUCE(BitAnd, band, TYPE)         \
    REDUCE(BitOr, bor, TYPE)           \
    REDUCE(BitXor, bxor, TYPE)         \
    REDUCE_MANY(BitAnd, band, TYPE)    \
    REDUCE_MANY(BitOr, bor, TYPE)      \
    REDUCE_MANY(BitXor, bxor, TYPE)

#define DIVIDE(TYPE)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS) fairring_divide_##TYPE(       \
        TYPE::Store* dst, u32 n, u64 head, u64 vectors, u64 tail) {                      \
        divide<TYPE>(dst, n, head, vectors, tail);                                       \
    }

REDUCE_ALL(F32)
REDUCE_ALL(F64)
REDUCE_ALL(F16)
REDUCE_ALL(BF16)
REDUCE_ALL(I32)
REDUCE_ALL(I64)
REDUCE_ALL(U8)
REDUCE_ALL(I8)
REDUCE_ALL(I16)
REDUCE_ALL(BOOL)

REDUCE_BITWISE(I32)
REDUCE_BITWISE(I64)
REDUCE_BITWISE(U8)
REDUCE_BITWISE(I8)
REDUCE_BITWISE(I16)
REDUCE_BITWISE(BOOL)

DIVIDE(F32)
DIVIDE(F64)
DIVIDE(F16)
DIVIDE(BF16)
