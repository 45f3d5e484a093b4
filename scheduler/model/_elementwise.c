/* RMSNorm and RoPE in one pass each, on the CPU (float32 and bfloat16), a decoder layer's two
 * joins (the residual add with the RMSNorm after it, and RoPE with the KV cache write), its
 * SiLU-gating, and the greedy sampler's argmax (scheduler/model/native_elementwise.py says why).
 *
 * Why: torch runs each as several passes with a tensor between them (RMSNorm: square,
 * mean, rsqrt, two products; RoPE: a rolled copy, two products, a sum). On the default
 * preset they ran at 2-7 GB/s against a copy bandwidth of 10-17 GB/s
 * (bench/bench_forward.py: 19-22% of their limits). Here RMSNorm and RoPE each read their
 * input once and write their output once; RoPE rotates q and k in place, in the GEMM's output.
 * The joins make two passes over a row each (the sum, then its norm; the rotation, then the
 * copy into the cache), the row still in cache for the second.
 * SiLU-gating (`silu_mul`, `silu_mul8`) is here where torch's AVX-512 or AVX2 kernels run:
 * with torch's own exp the bits are F.silu(gate) * up's. A first one-pass version with an exp
 * of its own (8 lanes) timed no faster than torch's two passes (an earlier host), where that
 * exp, not memory, bounded it. Where the projections run on AMX tiles the gating is done in the
 * gate/up GEMM's pass instead (_amx_gemm.c's amx_gated).
 *
 * The arithmetic is torch's, operation for operation (compiled without FMA contraction),
 * except the order of RMSNorm's sum of squares (lanes in a fixed tree). In bfloat16 that
 * includes torch's roundings: each bfloat16 op computes in float32 and rounds its result
 * to bfloat16 (nearest even), so the C code rounds wherever torch's expression ends an op
 * in bfloat16 and nowhere else (layers.rms_norm's float32 statistics; RoPE's two products
 * and their sum). The tests compare
 * each with torch's (tests/test_native_elementwise.py). One thread: these are a few
 * percent of the forward; called through ctypes, which releases the GIL.
 *
 * No Python API is used: the module init only exists so setuptools can build this as an
 * extension and pip can install it like one.
 */
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_vec.h"
#include "_kernels.h"
#include "_torch_avx512.h"

/* out[r] = x[r] * 1 / sqrt(mean(x[r]^2) + eps) * w, rows of n floats (x's rows x_stride apart) */
MULTI_TARGET
void rms_norm(const float *x, int64_t x_stride, const float *w, float *out, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * n;
        v8 acc = {0};
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            v8 v = load8(xr + i);
            acc += v * v;
        }
        float lanes[LANES];
        memcpy(lanes, &acc, sizeof lanes);
        float ss = lane_sum(lanes);
        for (; i < n; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (i = 0; i < n; i++) o[i] = (xr[i] * inv) * w[i];
    }
}


/* bfloat16 rows, as layers.rms_norm's torch path: float32 statistics, x * inv rounded to
 * bfloat16, then times the bfloat16 weight (rounded again) */
MULTI_TARGET
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int64_t rows, int64_t n,
                   float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *o = out + r * n;
        float lanes[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES)
            for (int j = 0; j < LANES; j++) {
                const float v = widen(xr[i + j]);
                lanes[j] += v * v;
            }
        float ss = lane_sum(lanes);
        for (; i < n; i++) ss += widen(xr[i]) * widen(xr[i]);
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (i = 0; i < n; i++) o[i] = narrow(widen(w[i]) * widen(narrow(widen(xr[i]) * inv)));
    }
}

/* The residual add and the next RMSNorm in one call: sum[r] = x[r] + y[r] (rounded to the
 * type, as torch's add), then out[r] = rms_norm(sum[r]) as rms_norm / rms_norm_bf16 compute
 * it. Rows of n values, all contiguous. */
MULTI_TARGET
void add_rms_norm(const float *x, const float *y, float *sum, const float *w, float *out, int64_t rows, int64_t n,
                  float eps) {
    for (int64_t i = 0; i < rows * n; i++) sum[i] = x[i] + y[i];
    rms_norm(sum, n, w, out, rows, n, eps);
}

MULTI_TARGET
void add_rms_norm_bf16(const uint16_t *x, const uint16_t *y, uint16_t *sum, const uint16_t *w, uint16_t *out,
                       int64_t rows, int64_t n, float eps) {
    for (int64_t i = 0; i < rows * n; i++) sum[i] = narrow(widen(x[i]) + widen(y[i]));
    rms_norm_bf16(sum, n, w, out, rows, n, eps);
}

/* x[t, h, :] = x * cos[t] + roll(x, D / 2) * sin[t] in place, for `heads` heads of D values
 * per row (rows x_stride apart); cos and sin [T, D], sin signed as RotaryTable keeps it. In
 * bfloat16 (bf16 = 1, a constant where this is inlined) each product and the sum is rounded
 * to bfloat16, as torch's `x * cos + roll(x) * sin` rounds in bfloat16 */
static inline __attribute__((always_inline)) void rope_rows(void *x, int64_t x_stride, const void *cos,
                                                             const void *sin, int64_t rows, int64_t heads, int64_t D,
                                                             const int bf16) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < rows; t++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t v0 = t * x_stride + h * D, c0 = t * D;
            int64_t i = 0;
            if (!bf16) /* eight lanes at a time, the same products and sums (GCC kept this loop scalar:
                        * x, written in place, may alias the tables for all it knows) */
                for (float *xf = (float *)x + v0; i + LANES <= half; i += LANES) {
                    const float *cf = (const float *)cos + c0 + i, *sf = (const float *)sin + c0 + i;
                    const v8 a = load8(xf + i), b = load8(xf + i + half);
                    const v8 lo = a * load8(cf) + b * load8(sf), hi = b * load8(cf + half) + a * load8(sf + half);
                    store8(xf + i, &lo);
                    store8(xf + i + half, &hi);
                }
            for (; i < half; i++) {
                const float a = elem(x, v0 + i, bf16), b = elem(x, v0 + i + half, bf16);
                const float lo = rounded(a * elem(cos, c0 + i, bf16), bf16);
                const float lo_r = rounded(b * elem(sin, c0 + i, bf16), bf16);
                const float hi = rounded(b * elem(cos, c0 + i + half, bf16), bf16);
                const float hi_r = rounded(a * elem(sin, c0 + i + half, bf16), bf16);
                put(x, v0 + i, lo + lo_r, bf16);
                put(x, v0 + i + half, hi + hi_r, bf16);
            }
        }
}

MULTI_TARGET
void rope(float *x, int64_t x_stride, const float *cos, const float *sin, int64_t rows, int64_t heads, int64_t D) {
    rope_rows(x, x_stride, cos, sin, rows, heads, D, 0);
}

MULTI_TARGET
void rope_bf16(uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *sin, int64_t rows, int64_t heads,
               int64_t D) {
    rope_rows(x, x_stride, cos, sin, rows, heads, D, 1);
}

/* Rows ahead of the one being stored whose cache slots are asked for. A decode round's slots
 * lie one in each of its rows' last blocks, anywhere in a pool far beyond the caches, and a
 * store to a line not in cache first reads it: row by row, each row's k and v (2 KB in float32
 * on the default preset) waited for those reads one after another. Asked a few rows ahead, a
 * cold call of 57 rows took 0.73-0.79x the time, 128 rows 0.70-0.81x, 16 rows 0.84-0.90x
 * (bench/bench_rope_kv.py, four runs); 2, 4 and 8 rows ahead were within a few percent of each
 * other. They ask to write, but the compiler emits PREFETCHW for that only with a target flag the
 * clones do not carry, so they are plain prefetches here; a build with the flag read within 3%
 * of this one. */
enum { STORE_AHEAD = 4 };

/* ask for a cache slot's k and v rows (`row` bytes each): a hint, it neither faults nor waits */
static inline __attribute__((always_inline)) void prefetch_slot(const void *k_cache, const void *v_cache,
                                                                 int64_t slot, size_t row) {
    for (size_t b = 0; b < row; b += 64) {
        __builtin_prefetch((const char *)k_cache + (size_t)slot * row + b, 1, 3);
        __builtin_prefetch((const char *)v_cache + (size_t)slot * row + b, 1, 3);
    }
}

/* A qkv GEMM's output after it: RoPE on its q and k heads in place (as `rope`), then each
 * row's k and v heads copied to its cache slot (caches [slots, kv_heads, D]), as the two
 * index_copy_ calls did, a row at a time (rotated, then copied while in cache). Returns -1, with
 * nothing written, where a slot lies outside the caches' num_slots (the caller then rotates
 * and stores apart, and index_copy_ says why). */
static inline __attribute__((always_inline)) int rope_kv_rows(void *qkv, int64_t stride, const void *cos,
                                                               const void *sin, int64_t rows, int64_t heads,
                                                               int64_t kv_heads, int64_t D, void *k_cache,
                                                               void *v_cache, const int64_t *slots, int64_t num_slots,
                                                               const int bf16) {
    for (int64_t t = 0; t < rows; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    const size_t es = bf16 ? 2 : 4, row = (size_t)(kv_heads * D) * es;
    for (int64_t t = 0; t < rows && t < STORE_AHEAD; t++) prefetch_slot(k_cache, v_cache, slots[t], row);
    for (int64_t t = 0; t < rows; t++) {
        if (t + STORE_AHEAD < rows) prefetch_slot(k_cache, v_cache, slots[t + STORE_AHEAD], row);
        char *x = (char *)qkv + (size_t)(t * stride) * es;
        rope_rows(x, stride, (const char *)cos + (size_t)(t * D) * es, (const char *)sin + (size_t)(t * D) * es, 1,
                  heads + kv_heads, D, bf16);
        const char *k = x + (size_t)(heads * D) * es;
        memcpy((char *)k_cache + (size_t)slots[t] * row, k, row);
        memcpy((char *)v_cache + (size_t)slots[t] * row, k + row, row);
    }
    return 0;
}

MULTI_TARGET
int rope_kv(float *qkv, int64_t stride, const float *cos, const float *sin, int64_t rows, int64_t heads,
            int64_t kv_heads, int64_t D, float *k_cache, float *v_cache, const int64_t *slots, int64_t num_slots) {
    return rope_kv_rows(qkv, stride, cos, sin, rows, heads, kv_heads, D, k_cache, v_cache, slots, num_slots, 0);
}

MULTI_TARGET
int rope_kv_bf16(uint16_t *qkv, int64_t stride, const uint16_t *cos, const uint16_t *sin, int64_t rows,
                 int64_t heads, int64_t kv_heads, int64_t D, uint16_t *k_cache, uint16_t *v_cache,
                 const int64_t *slots, int64_t num_slots) {
    return rope_kv_rows(qkv, stride, cos, sin, rows, heads, kv_heads, D, k_cache, v_cache, slots, num_slots, 1);
}

/* out[r] = the index of row r's largest value, as torch's argmax picks it: the first of equal
 * maxima (-0 equal to +0), and the first NaN where the row has one (torch counts a NaN larger
 * than any number). Rows of n floats, `stride` apart. ACC x 8 lanes each keep the best of the
 * indices they see, in order, by that rule (ACC apart, so the compares do not wait on each
 * other); the lanes' bests, then the row's tail, are folded by it, the lower index winning a
 * tie. Why: torch's CPU argmax keeps its index one value at a time (3.3 GB/s here: 0.57 ms
 * for a [57, 8192] round's logits). */
enum { ACC = 4 };

static inline __attribute__((always_inline)) int argmax_better(float v, int64_t i, float bv, int64_t best) {
    const int nan = v != v, bnan = bv != bv;
    return nan ? (!bnan || i < best) : (!bnan && (v > bv || (v == bv && i < best)));
}

MULTI_TARGET
void argmax_rows(const float *x, int64_t stride, int64_t rows, int64_t n, int64_t *out) {
    const int64_t block = ACC * LANES;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        int64_t best = 0, i = 1;
        float bv = n > 0 ? row[0] : 0.0f;
        if (n >= block) {
            v8 mv[ACC];
            v8i mi[ACC];
            const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
            for (int k = 0; k < ACC; k++) {
                mv[k] = load8(row + k * LANES);
                mi[k] = lane + k * LANES;
            }
            for (i = block; i + block <= n; i += block)
                for (int k = 0; k < ACC; k++) {
                    const v8 v = load8(row + i + k * LANES);
                    const v8i at = lane + (int32_t)(i + k * LANES);
                    const v8i take = (v > mv[k]) | ((v != v) & (mv[k] == mv[k]));
                    mv[k] = (v8)(((v8i)v & take) | ((v8i)mv[k] & ~take));
                    mi[k] = (at & take) | (mi[k] & ~take);
                }
            float lv[ACC * LANES];
            int32_t li[ACC * LANES];
            memcpy(lv, mv, sizeof lv);
            memcpy(li, mi, sizeof li);
            bv = lv[0], best = li[0];
            for (int l = 1; l < ACC * LANES; l++)
                if (argmax_better(lv[l], li[l], bv, best)) bv = lv[l], best = li[l];
        }
        for (; i < n; i++) /* the tail's indices are past every lane's */
            if (argmax_better(row[i], i, bv, best)) bv = row[i], best = i;
        out[r] = best;
    }
}

#ifdef TORCH_AVX512
/* 16 bfloat16 values as floats (exact) */
__attribute__((target("avx512f"))) static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Bytes ahead of the values in use that float32's gate and up streams ask for. The input is a
 * GEMM's output, which that GEMM's own traffic has pushed out of the near caches by the time this
 * pass runs, and the hardware's prefetchers left the two streams waiting: asked 1 KB ahead, a
 * call right after the gate/up GEMM took 0.70-0.89x the time at 57-569 rows, most of the way to
 * its time on a copy made just before (bench/bench_gating.py); 512 B ahead helped less, 2 KB as
 * much. bfloat16 is as it was: one run with the asks read 0.89x at 569 rows and 1.04-1.08x at 57
 * and 128, inside what the same code reads against itself there (0.98-1.06x), so not measured
 * to help. The addresses may pass the rows' end (a prefetch does not fault), so they are formed
 * as integers. */
enum { GATING_AHEAD = 1024 };

/* y[r] = silu(gate) * up, [gate | up] being row r of gu (rows `stride` elements apart, each
 * 2 * inter long), y [rows, inter]; in bfloat16 each op's result rounded as torch's rounds it */
__attribute__((target("avx512f"))) static void silu_mul_rows(const void *gu, int64_t stride, void *y, int64_t rows,
                                                             int64_t inter, ExpF16 expf16, const int bf16) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < inter; j += 16) {
            if (bf16) {
                const uint16_t *g = (const uint16_t *)gu + r * stride + j;
                const __m512i s = torch_bf16(torch_silu16(widen16(g), expf16));
                const __m512 prod = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(s, 16)), widen16(g + inter));
                _mm256_storeu_si256((__m256i *)((uint16_t *)y + r * inter + j), _mm512_cvtepi32_epi16(torch_bf16(prod)));
            } else {
                const float *g = (const float *)gu + r * stride + j;
                _mm_prefetch((const char *)((uintptr_t)g + GATING_AHEAD), _MM_HINT_T0);           /* gate */
                _mm_prefetch((const char *)((uintptr_t)(g + inter) + GATING_AHEAD), _MM_HINT_T0); /* up */
                const __m512 s = torch_silu16(_mm512_loadu_ps(g), expf16);
                _mm512_storeu_ps((float *)y + r * inter + j, _mm512_mul_ps(s, _mm512_loadu_ps(g + inter)));
            }
        }
}

/* silu_mul_rows in float32 with torch's AVX2 SiLU, eight values at a time, asking as far ahead
 * (GATING_AHEAD was chosen on an AVX-512 host, not re-tuned for AVX2). Each line is asked for
 * twice, once per vector: a loop over a line at a time with one ask per line took 1.04-1.09x
 * the time on an AMD EPYC without AVX-512 (bench/bench_gating.py, two builds alternated). */
__attribute__((target("avx2"))) static void silu_mul_rows8(const float *gu, int64_t stride, float *y, int64_t rows,
                                                           int64_t inter, ExpF8 expf8) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < inter; j += 8) {
            const float *g = gu + r * stride + j;
            _mm_prefetch((const char *)((uintptr_t)g + GATING_AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)((uintptr_t)(g + inter) + GATING_AHEAD), _MM_HINT_T0);
            const __m256 s = torch_silu8(_mm256_loadu_ps(g), expf8);
            _mm256_storeu_ps(y + r * inter + j, _mm256_mul_ps(s, _mm256_loadu_ps(g + inter)));
        }
}
#endif

/* SiLU-gating in one pass: y [rows, inter] = F.silu(gate) * up, [gate | up] a gate/up GEMM's
 * output. torch computes it in two ops, each a pass over memory with a tensor between them, its
 * product in AVX2 on an AVX-512 CPU; here each value is read once and the result written once.
 * The bits are torch's on one thread where its AVX-512 kernels run every value through their
 * vector loops (a row's values past its last 32, or 64 in bfloat16, take its scalar exp; so
 * would the ends of a thread's piece, which the caller avoids: native_elementwise._torch_serial):
 * `expf16` is its exp (native_elementwise.torch_expf16), inter a multiple of 32 (64 in
 * bfloat16). Returns 0, or -1 with y untouched where that does not hold or this build has no
 * AVX-512. */
static int silu_mul_checked(const void *gu, int64_t stride, void *y, int64_t rows, int64_t inter, void *expf16,
                            const int bf16) {
#ifdef TORCH_AVX512
    if (!expf16 || inter % (bf16 ? 64 : 32)) return -1;
    silu_mul_rows(gu, stride, y, rows, inter, (ExpF16)expf16, bf16);
    return 0;
#else
    (void)gu, (void)stride, (void)y, (void)rows, (void)inter, (void)expf16, (void)bf16;
    return -1;
#endif
}

int silu_mul(const float *gu, int64_t stride, float *y, int64_t rows, int64_t inter, void *expf16) {
    return silu_mul_checked(gu, stride, y, rows, inter, expf16, 0);
}

int silu_mul_bf16(const uint16_t *gu, int64_t stride, uint16_t *y, int64_t rows, int64_t inter, void *expf16) {
    return silu_mul_checked(gu, stride, y, rows, inter, expf16, 1);
}

/* silu_mul in float32 where torch runs its AVX2 kernels: `expf8` is their exp
 * (native_elementwise.torch_expf8), inter a multiple of 16 (their loop's two vectors; past the
 * last 16 a row's values take torch's scalar exp). Returns 0, or -1 with y untouched. */
int silu_mul8(const float *gu, int64_t stride, float *y, int64_t rows, int64_t inter, void *expf8) {
#ifdef TORCH_AVX512
    if (!expf8 || inter % 16) return -1;
    silu_mul_rows8(gu, stride, y, rows, inter, (ExpF8)expf8);
    return 0;
#else
    (void)gu, (void)stride, (void)y, (void)rows, (void)inter, (void)expf8;
    return -1;
#endif
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_elementwise", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__elementwise(void) { return PyModule_Create(&module); }
