/* torch's AVX-512 arithmetic where the bits must be torch's: its float -> bfloat16 rounding and
 * its SiLU, for the C kernels that do a step torch's ops would (_amx_gemm.c's gating in the GEMM's
 * pass, _elementwise.c's silu_mul); and its AVX2 SiLU, for silu_mul where torch runs its AVX2
 * kernels. Included by each; it defines TORCH_AVX512 where the compiler builds AVX-512 (and AVX2)
 * code, every function inline with its target, so a file uses them only under #ifdef TORCH_AVX512
 * and calls each only where the CPU runs torch's kernels of that width
 * (`native_elementwise.torch_expf16`, `torch_expf8`). */
#ifndef MSTRACE_TORCH_AVX512_H
#define MSTRACE_TORCH_AVX512_H

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TORCH_AVX512 1
#include <immintrin.h>

/* torch's vectorised float exp, `Sleef_expf16_u10` from libtorch_cpu, which its AVX-512 SiLU calls */
typedef __m512 (*ExpF16)(__m512);

/* float -> bfloat16 as torch's AVX-512 conversion rounds (nearest even by the integer carry, a NaN
 * to 0xFFFF; torch's scalar tail, past a row's last 32 values, writes 0x7FC0), in the low
 * halves of 32-bit lanes. Unlike VCVTNEPS2BF16 it keeps a subnormal: a SiLU of a large negative
 * gate times a small up is one. */
__attribute__((target("avx512f"))) static inline __m512i torch_bf16(__m512 v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0xFFFF), r);
}

/* F.silu on 16 floats as torch's vectorised kernel computes it: x / (1 + exp(-x)), the negation
 * a sign flip (Vectorized::neg), the exp torch's own */
__attribute__((target("avx512f"))) static inline __m512 torch_silu16(__m512 x, ExpF16 expf16) {
    const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), expf16(neg)));
}

/* torch's vectorised float exp of its AVX2 kernels, `Sleef_expf8_u10` */
typedef __m256 (*ExpF8)(__m256);

/* F.silu on 8 floats as torch's AVX2 kernel computes it (the same expression as torch_silu16) */
__attribute__((target("avx2"))) static inline __m256 torch_silu8(__m256 x, ExpF8 expf8) {
    const __m256 neg = _mm256_xor_ps(x, _mm256_set1_ps(-0.0f));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), expf8(neg)));
}
#endif

#endif
