/* Decode attention straight from the paged KV cache, on the CPU (float32 or bfloat16).
 *
 * Why: torch has no paged attention on the CPU, so the engine gathered every decode
 * row's context blocks into a padded copy (index_select) and ran SDPA on the copy:
 * the K/V bytes crossed memory three times (read, write the copy, read it again),
 * plus the padding. On the default preset that was 60% of a decode round's forward
 * (bench/bench_forward.py). Here each row reads its context once, block by block
 * through its block table, where it lies in the cache.
 *
 * Layout (scheduler/model/kv_cache.py): a layer's cache is [slots, kv_heads, head_dim],
 * slot = block * block_size + offset. Query heads are grouped: head h attends with
 * kv head h / group. Per row, one pass over its tokens computes every head's scores
 * (each token's K row for all kv heads is contiguous), a softmax per head, and one pass
 * accumulates V; the scores fit a per-thread buffer of heads * context floats.
 *
 * Rows are split over `threads` pthreads (the intra-op thread count the engine runs
 * torch with), in contiguous runs of about equal context. Called through ctypes, which
 * releases the GIL: the scheduler thread runs meanwhile, as it does during a torch op.
 *
 * The dot products, the softmax (its exp included) and the V accumulation work on 8-float
 * vectors (GCC/clang vector extensions) and sum their lanes in a fixed order, so nothing
 * depends on the compiler reassociating a sum (no -ffast-math); on x86-64 a clone for
 * AVX2 + FMA of the whole row loop (the helpers inlined) is picked at run time where the
 * CPU has them, and for bfloat16 one for AVX-512 before it (see accumulate2).
 *
 * bfloat16 (`decode_attention_bf16`): q, the caches and the output are bfloat16, the
 * arithmetic float32 (the output rounded to nearest even once, as torch rounds). Where the
 * head size is a multiple of 16, K and V rows are widened split, even and odd values apart
 * (split16), with q and the output split the same way: two integer operations per sixteen
 * values. Widening them in order into a scratch row shared by a KV group's heads had made the
 * bfloat16 kernel 40-50% slower per token than float32's in cache; split, it is as fast. The
 * cache is read at half float32's bytes; torch's path gathered the copy and ran SDPA in
 * bfloat16, slower per byte than in float32 on a CPU. Where a KV group has two query heads
 * (the default preset's 8 over 4), each K and V row is widened once for both (dot_split2,
 * accumulate2), each head's sums added in the same order as alone: the same bits, and a
 * forward's worth of bfloat16 calls 0.85-0.90x the time (bench/bench_decode_kernel.py, with
 * the AVX-512 clone that holds both heads' sums in registers).
 *
 * No Python API is used: the module init only exists so setuptools can build this as an
 * extension and pip can install it like one.
 */
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_vec.h"
#include "_kernels.h"

/* The largest head size: accumulate's row sums live in MAX_HEAD_DIM / LANES vectors.
 * Exported so that Python reads the limit from here (native_attention.MAX_HEAD_DIM). */
#define MAX_HEAD_DIM 256
const int64_t attention_max_head_dim = MAX_HEAD_DIM;

/* q, k, v and out hold float or uint16_t (bfloat16 bits) elements, as the entry point says */
typedef struct {
    const void *q;           /* [rows, q_stride]: row r's heads at q + r * q_stride */
    int64_t q_stride;
    const void *k, *v;       /* [slots, kv_heads, head_dim] */
    const int64_t *blocks;   /* [rows, max_blocks] */
    int64_t max_blocks;
    const int64_t *ctx;      /* [rows] context length (the new token included) */
    void *out;               /* [rows, heads, head_dim] */
    int64_t heads, kv_heads, head_dim, block_size, window;
    float scale;
    int64_t row0, row1;
    int status;
} Job;

/* &x[i] for an array of the kernel's type */
static inline __attribute__((always_inline)) const void *at(const void *x, int64_t i, const int bf16) {
    return bf16 ? (const void *)((const uint16_t *)x + i) : (const void *)((const float *)x + i);
}


/* a . b over D values (a float, b of the kernel's type) in 8 lanes, not yet summed: two
 * accumulators (two dependency chains), added lane by lane; D a multiple of 8 */
static inline __attribute__((always_inline)) v8 dot_lanes(const float *a, const void *b, int64_t D, const int bf16) {
    v8 s0 = {0}, s1 = {0};
    int64_t i = 0;
    for (; i + 16 <= D; i += 16) {
        s0 += load8(a + i) * elem8(b, i, bf16);
        s1 += load8(a + i + 8) * elem8(b, i + 8, bf16);
    }
    for (; i + 8 <= D; i += 8) s0 += load8(a + i) * elem8(b, i, bf16);
    return s0 + s1;
}

/* a . b over D values: dot_lanes, then the lanes' tree and the scalar tail */
static inline __attribute__((always_inline)) float dot(const float *a, const void *b, int64_t D, const int bf16) {
    const int64_t whole = D / LANES * LANES;
    const v8 s0 = dot_lanes(a, b, whole, bf16);
    float lanes[LANES];
    memcpy(lanes, &s0, sizeof lanes);
    float s = lane_sum(lanes);
    for (int64_t i = whole; i < D; i++) s += a[i] * elem(b, i, bf16);
    return s;
}

/* {sum of p[0]'s lanes, ..., sum of p[7]'s}: an 8 x 8 transpose folded into its adds (14
 * shuffles and 7 adds for 8 sums, where 8 lane_sums take 56 scalar adds); each vector's lanes
 * summed as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), a fixed order, though not lane_sum's
 * pairing: a score from here and one from `dot` or `dot_split_sum` (the tail tokens) may differ
 * by float rounding */
static inline __attribute__((always_inline)) v8 sum8(const v8 *p) {
    v8 a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = SHUFFLE8(p[2 * i], p[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14)
             + SHUFFLE8(p[2 * i], p[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        b[i] = SHUFFLE8(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
             + SHUFFLE8(a[2 * i], a[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUFFLE8(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE8(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* e^x for x <= 0 (a score minus its row's maximum), eight at a time in plain vector arithmetic:
 * libm's expf is a call per score, and the scalar version of this (a lane at a time) was still
 * the kernel's largest part (perf: its conversions and polynomial in scalar SSE, 40% of a
 * decode call whose K/V sat in L2). Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, e^r by a
 * degree-6 polynomial, 2^n by the exponent bits; about 1 ulp. The argument is clamped at -87
 * (e^-87 ~ 1.6e-38, which a softmax's sum of at least 1 makes nothing); a NaN stays NaN, as in
 * torch's softmax, without converting a NaN to an integer (undefined in C). */
static inline __attribute__((always_inline)) v8 exp8_nonpositive(const v8 *xp) {
    v8 x = *xp;
    const v8i is_nan = x != x;
    const v8 nan = SELECT8(is_nan, x, (v8){0});
    x = SELECT8(is_nan, (v8){0}, SELECT8(x < -87.0f, (v8){0} - 87.0f, x));
    return EXP_CEPHES(v8, v8i, x) + nan;
}

/* s[0:n] = softmax(s[0:n]): eight lanes whose order does not depend on the compiler; a tail
 * of under eight scores goes through the same exp, padded with the maximum (e^0: no lane
 * leaves exp8_nonpositive's domain) */
static inline __attribute__((always_inline)) void softmax(float *s, int64_t n) {
    v8 mx = (v8){0} + s[0];
    int64_t t = 0;
    for (; t + LANES <= n; t += LANES) {
        const v8 x = load8(s + t);
        mx = SELECT8(x > mx, x, mx);
    }
    float lane[LANES];
    memcpy(lane, &mx, sizeof lane);
    float m = lane[0];
    for (int j = 1; j < LANES; j++) m = lane[j] > m ? lane[j] : m;
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    v8 acc = {0};
    for (t = 0; t + LANES <= n; t += LANES) {
        const v8 x = load8(s + t) - m, e = exp8_nonpositive(&x);
        store8(s + t, &e);
        acc += e;
    }
    memcpy(lane, &acc, sizeof lane);
    float sum = lane_sum(lane);
    if (t < n) {
        float tail[LANES];
        for (int j = 0; j < LANES; j++) tail[j] = m;
        memcpy(tail, s + t, sizeof(float) * (size_t)(n - t));
        const v8 x = load8(tail) - m, e = exp8_nonpositive(&x);
        memcpy(tail, &e, sizeof tail);
        for (int64_t i = 0; t < n; t++, i++) {
            s[t] = tail[i];
            sum += s[t];
        }
    }
    const float inv = 1.0f / sum;
    for (t = 0; t < n; t++) s[t] *= inv;
}

/* Sixteen bfloat16 values as float32, split: the even-indexed ones and the odd-indexed ones.
 * A bfloat16 is float32's upper half, so of a 32-bit lane holding two, the odd one is the lane
 * with its low half cleared and the even one the lane shifted up: two integer operations per
 * sixteen values and no shuffle, where widening them in order takes a zero-extension and a
 * shift per eight. q and the output are kept split the same way (a row's q split once, its
 * output put back in order once), so each product pairs the same two values as in order. */
static inline __attribute__((always_inline)) void split16(const uint16_t *p, v8 *even, v8 *odd) {
    u32x8 u;
    memcpy(&u, p, sizeof u);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    const u32x8 e = u & 0xFFFF0000u, o = u << 16; /* the even value is the lane's upper half */
#else
    const u32x8 e = u << 16, o = u & 0xFFFF0000u; /* little-endian: the even value is the lower half */
#endif
    memcpy(even, &e, sizeof e);
    memcpy(odd, &o, sizeof o);
}

/* q . k over D values (D a multiple of 16), q split as split16 splits, k bfloat16 in order: in
 * 8 lanes, not yet summed */
static inline __attribute__((always_inline)) v8 dot_split(const float *q, const uint16_t *k, int64_t D) {
    v8 s0 = {0}, s1 = {0};
    for (int64_t c = 0; c < D; c += 16) {
        v8 e, o;
        split16(k + c, &e, &o);
        s0 += load8(q + c) * e;
        s1 += load8(q + c + 8) * o;
    }
    return s0 + s1;
}

/* dot_split for two query heads of one KV group against the same k: each head's sums in the
 * order dot_split adds them (the same bits), k widened once for both */
static inline __attribute__((always_inline)) void dot_split2(const float *q0, const float *q1, const uint16_t *k,
                                                              int64_t D, v8 *r0, v8 *r1) {
    v8 a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0};
    for (int64_t c = 0; c < D; c += 16) {
        v8 e, o;
        split16(k + c, &e, &o);
        a0 += load8(q0 + c) * e;
        a1 += load8(q0 + c + 8) * o;
        b0 += load8(q1 + c) * e;
        b1 += load8(q1 + c + 8) * o;
    }
    *r0 = a0 + a1;
    *r1 = b0 + b1;
}

/* dot_split with its lanes summed (lane_sum) */
static inline __attribute__((always_inline)) float dot_split_sum(const float *q, const void *k, int64_t D) {
    const v8 l = dot_split(q, (const uint16_t *)k, D);
    float lanes[LANES];
    memcpy(lanes, &l, sizeof lanes);
    return lane_sum(lanes);
}


/* y[0:D] += sum over i < count of p[i] * x[i * stride : i * stride + D] (x of the kernel's
 * type; with `split`, bfloat16 rows widened by split16 into a y split alike); where D is a
 * constant (see run) the accumulators live in registers across the block's tokens */
static inline __attribute__((always_inline)) void accumulate(float *y, const float *p, const void *x, int64_t count,
                                                              int64_t stride, int64_t D, const int bf16,
                                                              const int split) {
    enum { MAXV = MAX_HEAD_DIM / LANES };
    v8 acc[MAXV];
    const int64_t nv = D / LANES;
    for (int64_t k = 0; k < nv; k++) acc[k] = load8(y + k * LANES);
    for (int64_t i = 0; i < count; i++) {
        const v8 w = {p[i], p[i], p[i], p[i], p[i], p[i], p[i], p[i]};
        if (split)
            for (int64_t k = 0; k < nv; k += 2) {
                v8 e, o;
                split16((const uint16_t *)x + i * stride + k * LANES, &e, &o);
                acc[k] += w * e;
                acc[k + 1] += w * o;
            }
        else
            for (int64_t k = 0; k < nv; k++) acc[k] += w * elem8(x, i * stride + k * LANES, bf16);
    }
    for (int64_t k = 0; k < nv; k++) store8(y + k * LANES, &acc[k]);
    for (int64_t d = nv * LANES; d < D; d++)
        for (int64_t i = 0; i < count; i++) y[d] += p[i] * elem(x, i * stride + d, bf16);
}

/* accumulate's split path for two heads of one KV group over the same V rows: each head's
 * sums in accumulate's order (the same bits), each V row widened once for both */
static inline __attribute__((always_inline)) void accumulate2(float *y0, float *y1, const float *p0, const float *p1,
                                                               const void *x, int64_t count, int64_t stride,
                                                               int64_t D) {
    enum { MAXV = MAX_HEAD_DIM / LANES };
    v8 acc0[MAXV], acc1[MAXV];
    const int64_t nv = D / LANES;
    for (int64_t k = 0; k < nv; k++) {
        acc0[k] = load8(y0 + k * LANES);
        acc1[k] = load8(y1 + k * LANES);
    }
    for (int64_t i = 0; i < count; i++) {
        const v8 w0 = {p0[i], p0[i], p0[i], p0[i], p0[i], p0[i], p0[i], p0[i]};
        const v8 w1 = {p1[i], p1[i], p1[i], p1[i], p1[i], p1[i], p1[i], p1[i]};
        for (int64_t k = 0; k < nv; k += 2) {
            v8 e, o;
            split16((const uint16_t *)x + i * stride + k * LANES, &e, &o);
            acc0[k] += w0 * e;
            acc0[k + 1] += w0 * o;
            acc1[k] += w1 * e;
            acc1[k + 1] += w1 * o;
        }
    }
    for (int64_t k = 0; k < nv; k++) {
        store8(y0 + k * LANES, &acc0[k]);
        store8(y1 + k * LANES, &acc1[k]);
    }
}

/* Tokens ahead of the one in use whose K or V rows are asked for. A row's blocks lie anywhere in
 * the cache and the hardware's prefetchers follow a stream only within a page, so out of cache
 * every block (and page) started with a wait for memory: asking eight tokens ahead (every line
 * of their rows) made a forward's worth of decode calls out of cache 10-27% faster, one whose
 * K/V sat in cache up to 14% slower (bench/bench_decode_kernel.py). Sixteen ahead, with the
 * asks spread over the head loop (prefetch_share), read 1.1-1.5x faster again, in address order
 * and shuffled (BENCHMARKS.md, "The decode kernel's prefetches spread"). */
enum { AHEAD = 16 };

/* ask for the bytes at p on (each cache line once); a hint: it neither faults nor waits */
static inline __attribute__((always_inline)) void prefetch(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b, 0, 3);
}

/* the cache slot of row r's token t, through its block table */
static inline __attribute__((always_inline)) int64_t bt_slot(const Job *j, int64_t r, int64_t t, int64_t BS) {
    return j->blocks[r * j->max_blocks + t / BS] * BS + t % BS;
}

/* Ask for the K or V rows of row r's tokens a0 + part, a0 + part + parts, ... (below a1 and L):
 * one iteration's share of the rows ahead. Asked all at once, a block's sixteen rows (256 lines)
 * outnumbered the misses a core keeps in flight, and the loop stalled on its own hints until
 * they drained; a share per head keeps a few rows in flight while the heads compute. */
static inline __attribute__((always_inline)) void prefetch_share(const Job *j, const void *cache, int64_t r,
                                                                  int64_t a0, int64_t a1, int64_t L, int64_t part,
                                                                  int64_t parts, int64_t BS, int64_t tok,
                                                                  int64_t row_bytes, const int bf16) {
    for (int64_t a = a0 + part; a < a1 && a < L; a += parts)
        prefetch(at(cache, bt_slot(j, r, a, BS) * tok, bf16), row_bytes);
}

static inline __attribute__((always_inline)) void rows(Job *j, const int64_t D, const int64_t BS, const int bf16) {
    const int64_t H = j->heads, KVH = j->kv_heads;
    const int64_t G = H / KVH, tok = KVH * D, row_bytes = tok * (bf16 ? 2 : 4);
    int64_t longest = 0;
    for (int64_t r = j->row0; r < j->row1; r++)
        if (j->ctx[r] > longest) longest = j->ctx[r];
    /* the scores; for bfloat16 also the row's q widened and its output before rounding */
    const int split = bf16 && D % 16 == 0; /* bfloat16 split (split16); else widened in order */
    float *scores = malloc(sizeof(float) * (size_t)(H * (longest > 0 ? longest : 1) + (bf16 ? 2 * H * D : 0)));
    if (!scores) {
        j->status = -1;
        return;
    }
    float *wide = scores + H * (longest > 0 ? longest : 1);
    for (int64_t r = j->row0; r < j->row1; r++) {
        const int64_t L = j->ctx[r];
        const int64_t first = (j->window > 0 && L > j->window) ? L - j->window : 0;
        const int64_t n = L - first;
        const float *q;
        float *o;
        if (bf16) {
            const uint16_t *qh = (const uint16_t *)j->q + r * j->q_stride;
            if (split)
                for (int64_t i = 0; i < H * D; i += 16)
                    for (int m = 0; m < 8; m++) {
                        wide[i + m] = widen(qh[i + 2 * m]);
                        wide[i + 8 + m] = widen(qh[i + 2 * m + 1]);
                    }
            else
                for (int64_t i = 0; i < H * D; i++) wide[i] = widen(qh[i]);
            q = wide;
            o = wide + H * D;
        } else {
            q = (const float *)j->q + r * j->q_stride;
            o = (float *)j->out + r * H * D;
        }
        memset(o, 0, sizeof(float) * (size_t)(H * D));
        if (n > 0) {
            int64_t t = first;
            /* eight tokens' scores at a time, their lanes summed together; each head reads its KV
             * head's rows where they lie (head by head: 3-4% faster than by KV head in float32) */
            if (D % LANES == 0)
                for (; t + LANES <= L; t += LANES) {
                    int64_t kt[LANES];
                    for (int i = 0; i < LANES; i++) kt[i] = bt_slot(j, r, t + i, BS) * tok;
                    if (split && G == 2) /* a KV group's two heads on each K row widened once */
                        for (int64_t h = 0; h < H; h += 2) {
                            v8 p0[LANES], p1[LANES];
                            prefetch_share(j, j->k, r, t + AHEAD, t + AHEAD + LANES, L, h / 2, H / 2, BS, tok,
                                           row_bytes, bf16);
                            for (int i = 0; i < LANES; i++)
                                dot_split2(q + h * D, q + (h + 1) * D, (const uint16_t *)j->k + kt[i] + (h / 2) * D,
                                           D, &p0[i], &p1[i]);
                            const v8 s0 = sum8(p0) * j->scale, s1 = sum8(p1) * j->scale;
                            store8(scores + h * n + (t - first), &s0);
                            store8(scores + (h + 1) * n + (t - first), &s1);
                        }
                    else
                        for (int64_t h = 0; h < H; h++) {
                            v8 p[LANES];
                            prefetch_share(j, j->k, r, t + AHEAD, t + AHEAD + LANES, L, h, H, BS, tok, row_bytes,
                                           bf16);
                            for (int i = 0; i < LANES; i++)
                                p[i] = split ? dot_split(q + h * D, (const uint16_t *)j->k + kt[i] + (h / G) * D, D)
                                             : dot_lanes(q + h * D, at(j->k, kt[i] + (h / G) * D, bf16), D, bf16);
                            const v8 sc = sum8(p) * j->scale;
                            store8(scores + h * n + (t - first), &sc);
                        }
                }
            for (; t < L; t++) {
                const int64_t kt = bt_slot(j, r, t, BS) * tok;
                for (int64_t h = 0; h < H; h++) {
                    const void *kr = at(j->k, kt + (h / G) * D, bf16);
                    scores[h * n + (t - first)] = (split ? dot_split_sum(q + h * D, kr, D) : dot(q + h * D, kr, D, bf16))
                                                  * j->scale;
                }
            }
            for (int64_t h = 0; h < H; h++) { /* V's first rows, behind the softmax */
                prefetch_share(j, j->v, r, first, first + AHEAD, L, h, H, BS, tok, row_bytes, bf16);
                softmax(scores + h * n, n);
            }
            /* the next row's first K rows are asked for during this row's last block: its first
             * tokens' scores would otherwise each start with a wait for memory */
            const int64_t Ln = r + 1 < j->row1 ? j->ctx[r + 1] : 0;
            const int64_t fn = (j->window > 0 && Ln > j->window) ? Ln - j->window : 0;
            /* V a block at a time, each head's accumulator held across the block's tokens
             * (in registers where D is a constant: see accumulate) instead of reloaded per token */
            for (int64_t t0 = first; t0 < L; t0 = (t0 / BS + 1) * BS) {
                const int64_t t1 = (t0 / BS + 1) * BS < L ? (t0 / BS + 1) * BS : L;
                const int64_t vt = bt_slot(j, r, t0, BS) * tok;
                const int64_t Lnext = t1 == L ? Ln : 0; /* 0: none asked for */
                if (split && G == 2)
                    for (int64_t h = 0; h < H; h += 2) {
                        prefetch_share(j, j->v, r, t0 + AHEAD, t1 + AHEAD, L, h / 2, H / 2, BS, tok, row_bytes, bf16);
                        prefetch_share(j, j->k, r + 1, fn, fn + AHEAD, Lnext, h / 2, H / 2, BS, tok, row_bytes, bf16);
                        accumulate2(o + h * D, o + (h + 1) * D, scores + h * n + (t0 - first),
                                    scores + (h + 1) * n + (t0 - first), at(j->v, vt + (h / 2) * D, bf16), t1 - t0,
                                    tok, D);
                    }
                else
                    for (int64_t h = 0; h < H; h++) {
                        prefetch_share(j, j->v, r, t0 + AHEAD, t1 + AHEAD, L, h, H, BS, tok, row_bytes, bf16);
                        prefetch_share(j, j->k, r + 1, fn, fn + AHEAD, Lnext, h, H, BS, tok, row_bytes, bf16);
                        const void *vr = at(j->v, vt + (h / G) * D, bf16);
                        accumulate(o + h * D, scores + h * n + (t0 - first), vr, t1 - t0, tok, D, bf16, split);
                    }
            }
        }
        if (bf16) {
            uint16_t *oh = (uint16_t *)j->out + r * H * D;
            if (split) /* back in order */
                for (int64_t i = 0; i < H * D; i += 16)
                    for (int m = 0; m < 8; m++) {
                        oh[i + 2 * m] = narrow(o[i + m]);
                        oh[i + 2 * m + 1] = narrow(o[i + 8 + m]);
                    }
            else
                for (int64_t i = 0; i < H * D; i++) oh[i] = narrow(o[i]);
        }
    }
    free(scores);
}

/* The common head sizes as constants: the loops over D unroll and keep their vectors in
 * registers. With the engine's 16-token blocks also the block size: a token's block is then a
 * shift, not a 64-bit division (eight divisions per eight tokens were a tenth of a call whose
 * K/V sat in L2). */
#define DISPATCH(j, bf16)                                                                  \
    do {                                                                                   \
        const int64_t bs_ = (j)->block_size, d_ = (j)->head_dim;                          \
        if (bs_ == 16 && d_ == 64) rows(j, 64, 16, bf16);                                 \
        else if (bs_ == 16 && d_ == 128) rows(j, 128, 16, bf16);                          \
        else if (d_ == 64) rows(j, 64, bs_, bf16);                                        \
        else if (d_ == 128) rows(j, 128, bs_, bf16);                                      \
        else rows(j, d_, bs_, bf16);                                                      \
    } while (0)

/* float32 keeps the AVX2 + FMA clone: an AVX-512 one ran its head-size tails (D % 8 of 4-7) as
 * FMAs where that clone's vectorised tail does not fuse, so the bits would depend on the CPU */
MULTI_TARGET
static void *run(void *arg) {
    DISPATCH((Job *)arg, 0);
    return NULL;
}

MULTI_TARGET_WIDE
static void *run_bf16(void *arg) {
    DISPATCH((Job *)arg, 1);
    return NULL;
}

/* Rows over `threads` pthreads (the caller's included), each running `body` on its share. */
static int split_rows(void *(*body)(void *), const void *q, int64_t q_stride, const void *k, const void *v,
                      const int64_t *blocks, int64_t max_blocks, const int64_t *ctx, int64_t rows,
                      int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                      int64_t window, float scale, void *out, int64_t threads) {
    if (head_dim > MAX_HEAD_DIM || kv_heads < 1 || block_size < 1 || heads % kv_heads)
        return -1; /* accumulate's 32 vectors; whole groups */
    if (threads < 1) threads = 1;
    if (threads > rows) threads = rows > 0 ? rows : 1;
    Job jobs[64];
    pthread_t tid[64];
    if (threads > 64) threads = 64;
    int64_t total = 0;
    for (int64_t r = 0; r < rows; r++) total += ctx[r];
    /* contiguous runs of rows with about total / threads context each */
    int64_t r = 0, acc = 0;
    for (int64_t i = 0; i < threads; i++) {
        Job *j = &jobs[i];
        *j = (Job){q, q_stride, k, v, blocks, max_blocks, ctx, out, heads, kv_heads, head_dim, block_size,
                   window, scale, r, r, 0};
        const int64_t goal = total * (i + 1) / threads;
        /* a row goes to the run its middle falls in: no run overshoots by a whole row */
        while (r < rows && (acc + ctx[r] / 2 <= goal || i == threads - 1)) acc += ctx[r++];
        j->row1 = r;
    }
    int started[64] = {0};
    for (int64_t i = 1; i < threads; i++)
        started[i] = pthread_create(&tid[i], NULL, body, &jobs[i]) == 0;
    body(&jobs[0]);
    int status = jobs[0].status;
    for (int64_t i = 1; i < threads; i++) {
        if (started[i]) {
            pthread_join(tid[i], NULL);
            status |= jobs[i].status;
        } else {
            status = -1;
        }
    }
    return status;
}

/* out[r, h] = softmax(q[r, h] . K[ctx of r, h / G] * scale) . V[...] for every decode row r.
 * Returns 0, or -1 where a buffer could not be allocated or a thread not started (the
 * caller then falls back to the gather), as for a head size over MAX_HEAD_DIM. */
int decode_attention(const float *q, int64_t q_stride, const float *k, const float *v,
                     const int64_t *blocks, int64_t max_blocks, const int64_t *ctx, int64_t rows,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                     int64_t window, float scale, float *out, int64_t threads) {
    return split_rows(run, q, q_stride, k, v, blocks, max_blocks, ctx, rows, heads, kv_heads, head_dim, block_size,
                      window, scale, out, threads);
}

/* The same with q, the caches and out in bfloat16 (their bits as uint16_t), computed in float32. */
int decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                          const int64_t *blocks, int64_t max_blocks, const int64_t *ctx, int64_t rows,
                          int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                          int64_t window, float scale, uint16_t *out, int64_t threads) {
    return split_rows(run_bf16, q, q_stride, k, v, blocks, max_blocks, ctx, rows, heads, kv_heads, head_dim,
                      block_size, window, scale, out, threads);
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_attention", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__attention(void) { return PyModule_Create(&module); }
