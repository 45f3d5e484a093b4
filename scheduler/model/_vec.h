/* What the engine's C kernels share (_attention.c, _elementwise.c, _decode_layers.c; for
 * _prefill_attention.c its exp): 8-float vectors, a lane sum in a fixed order, bfloat16 <->
 * float32, and the run-time choice of the AVX2 + FMA clone (or, MULTI_TARGET_WIDE, an AVX-512
 * one before it). */
#ifndef MSTRACE_VEC_H
#define MSTRACE_VEC_H
/* v8 helpers are always inlined: the AVX argument ABI note does not apply */
#pragma GCC diagnostic ignored "-Wpsabi"
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MULTI_TARGET __attribute__((target_clones("arch=x86-64-v3", "default")))
/* with a clone for AVX-512 as well: its 32 vector registers hold two heads' sums where 16 spill
 * (the bfloat16 decode attention's accumulate2: 0.88-0.89x the time with it, 0.93x without) */
#define MULTI_TARGET_WIDE __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MULTI_TARGET
#define MULTI_TARGET_WIDE
#endif

#define LANES 8

/* GCC/clang vector extensions: 8 floats, SSE pairs in the default clone and one AVX
 * register in the x86-64-v3 one; no intrinsics, so other architectures build too */
typedef float v8 __attribute__((vector_size(32)));

typedef int32_t v8i __attribute__((vector_size(32))); /* a comparison's lanes: -1 true, 0 false */

/* lanes of a and b (b's numbered 8-15) picked by constant indices into a new v8 */
#if defined(__clang__)
#define SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* lane by lane, mask ? a : b (C has no ?: on vectors); a macro, as a function taking vectors
 * by value draws GCC's note on the AVX argument ABI */
#define SELECT8(mask, a, b) ((v8)(((v8i)(a) & (mask)) | ((v8i)(b) & ~(mask))))

static inline __attribute__((always_inline)) v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void store8(float *p, const v8 *v) { memcpy(p, v, sizeof *v); }

/* a fixed tree over the lanes: three dependent adds, not eight, and the same order every time */
static inline __attribute__((always_inline)) float lane_sum(const float *l) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* bfloat16 is float32's upper half: widening is a shift, exact; narrowing rounds */
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) float widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline __attribute__((always_inline)) v8 widen8(const uint16_t *p) {
    u16x8 h;
    memcpy(&h, p, sizeof h);
    const u32x8 u = __builtin_convertvector(h, u32x8) << 16;
    v8 f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* round to nearest even, as torch's float -> bfloat16 conversion (c10::BFloat16) does */
static inline __attribute__((always_inline)) uint16_t narrow(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* element i of a float (bf16 = 0) or bfloat16 (bf16 = 1) array, as float; bf16 is a
 * constant wherever these are inlined, so each kernel is compiled for one type */
static inline __attribute__((always_inline)) v8 elem8(const void *x, int64_t i, const int bf16) {
    return bf16 ? widen8((const uint16_t *)x + i) : load8((const float *)x + i);
}

static inline __attribute__((always_inline)) float elem(const void *x, int64_t i, const int bf16) {
    return bf16 ? widen(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* x rounded as a value of the kernel's type holds it: to bfloat16 and back, or as is */
static inline __attribute__((always_inline)) float rounded(float x, const int bf16) {
    return bf16 ? widen(narrow(x)) : x;
}

/* x[i] = v, in the kernel's type (bfloat16: rounded to nearest even) */
static inline __attribute__((always_inline)) void put(void *x, int64_t i, float v, const int bf16) {
    if (bf16)
        ((uint16_t *)x)[i] = narrow(v);
    else
        ((float *)x)[i] = v;
}

/* Cephes' expf of x, a vector of V (int lanes VI) in [-87, 0]: x = n ln2 + r with |r| <= ln2 / 2
 * (n rounded half down, as x <= 0), e^r by a degree-6 polynomial, 2^n by the exponent bits;
 * about 1 ulp. A statement expression (GCC, clang), so each vector width has it once. */
#define EXP_CEPHES(V, VI, x)                                                                \
    ({                                                                                      \
        const V x_ = (x);                                                                   \
        const VI ni_ = __builtin_convertvector(x_ * 1.44269504088896341f - 0.5f, VI);       \
        const V n_ = __builtin_convertvector(ni_, V);                                       \
        const V r_ = (x_ - n_ * 0.693359375f) + n_ * 2.12194440e-4f;                        \
        V p_ = (V){0} + 1.9875691500e-4f;                                                   \
        p_ = p_ * r_ + 1.3981999507e-3f;                                                    \
        p_ = p_ * r_ + 8.3334519073e-3f;                                                    \
        p_ = p_ * r_ + 4.1665795894e-2f;                                                    \
        p_ = p_ * r_ + 1.6666665459e-1f;                                                    \
        p_ = p_ * r_ + 5.0000001201e-1f;                                                    \
        p_ = p_ * r_ * r_ + r_ + 1.0f;                                                      \
        p_ * (V)((ni_ + 127) << 23);                                                        \
    })

#endif
