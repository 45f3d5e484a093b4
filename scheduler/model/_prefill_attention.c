/* Prefill attention straight from the paged KV cache, on the CPU (float32 or bfloat16).
 *
 * Why: torch's CPU SDPA ran one call per prefill chunk at 28-40 GFLOP/s on the default preset
 * (bench/bench_forward.py: the largest loss of a prefill-heavy round), its two GEMMs MKL's,
 * which on an AMD CPU run their AVX2 kernels; a chunk after the first also gathered its whole
 * context out of the cache (index_select) and built an additive mask first. Here one call
 * takes every prefill chunk of a batch, reads each key where it lies in the cache (the chunk's
 * own K/V are already written there), and keeps the causal (and sliding-window) mask implicit.
 *
 * The method is flash attention's: a tile of R query rows (the (token, head) pairs of one KV
 * group, in order) against the keys in tiles of NK, with a running maximum and sum per row,
 * so no score matrix larger than NK x R exists. The rows are the vector lanes throughout:
 *   - S^T[key][row] = K[key] . Q^T[:, row]: Q's tile is transposed (and scaled) once, and each
 *     key's values are broadcast against it, so K is read in place, in the cache's layout;
 *   - the softmax runs down a key tile with a row per lane: its maxima, exps and sums are lane
 *     by lane, with no horizontal reduction;
 *   - O^T[d][row] += V[key][d] * P^T[key][row]: V is read in place too, and a row's rescale
 *     by the running maximum's change is one multiply per vector.
 * Each register block holds JT keys (or JT head-dim values) x R rows: 2 JT vectors.
 *
 * bfloat16: q, the caches and the output are bfloat16, the arithmetic float32, the output rounded
 * to nearest even once (as _attention.c's decode_attention_bf16 and torch's CPU SDPA do). A key
 * tile's K and V rows are widened once into a float tile for all the tile's rows (64 x D values
 * for 64 x D x R products), so the products are the float32 kernel's on the widened values: the
 * same bits as float32 inputs holding the same values, then rounded.
 *
 * Keys whose every row is masked are never read: a tile's keys run from the earliest key its
 * earliest row may see to its last row's position. A key tile only partly visible to some row
 * gets its scores set to -inf there, which the tile's exp turns into exactly 0.
 *
 * Built three times from one tile (_prefill_tile.h), each with the vector width its registers
 * hold: AVX-512 + FMA (16 floats, tiles of 32 rows, blocks of 8), AVX2 + FMA (8 floats, 16 rows,
 * blocks of 4: 11 of its 16 registers) and the baseline (4 floats, 8 rows). The best of the first
 * two the CPU runs is picked at each call (`isa` -1), or one named (the tests and
 * bench/bench_prefill_attention.py run each on one machine); without AVX2 the caller keeps SDPA.
 * The sums use FMAs where the build has them, so the bits differ between builds, as torch's do
 * between CPUs.
 *
 * Work items (one prefill chunk, one KV head, one row tile) are split over `threads` pthreads
 * in contiguous runs of about equal key counts. Called through ctypes, which releases the GIL.
 *
 * No Python API is used: the module init only exists so setuptools can build this as an
 * extension and pip can install it like one.
 */
/* v16 helpers are always inlined: the AVX-512 argument ABI note does not apply */
#pragma GCC diagnostic ignored "-Wpsabi"
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_vec.h"

#define R_MAX 32  /* rows of the widest tile: two 16-float vectors */
#define NK 64     /* keys of a tile */
#define MAX_HEAD_DIM 256
const int64_t prefill_attention_max_head_dim = MAX_HEAD_DIM;

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

/* a prefill chunk, as `meta` gives it: five int64 each */
enum { M_QROW, M_N, M_START, M_SLOTS, M_OUTROW, M_FIELDS };

/* q, k, v and out hold float or uint16_t (bfloat16 bits) elements, as `bf16` says */
typedef struct {
    const void *q;         /* row t's head h at q + t * q_stride + h * D */
    int64_t q_stride;
    const void *k, *v;     /* caches [slots, kv_heads, D] */
    const int64_t *slots;  /* chunk c's keys 0 .. start + n - 1 at slots[meta[c].slots ...] */
    const int64_t *meta;   /* [chunks, M_FIELDS] */
    void *out;             /* chunk c's token i, head h at out + (outrow + i) * H * D + h * D */
    int64_t heads, kv_heads, D, window;
    float scale;
    int bf16;
    const int64_t *items;  /* [chunk, kv head, tile] triples */
    int64_t item0, item1;
    int status;
} Job;

typedef struct {
    float *qt, *st, *ot;   /* Q^T [D][rows], S^T / P^T [NK][rows], O^T [D][rows] (rows R_MAX at most) */
    float *kw, *vw;        /* bfloat16: a key tile's K and V rows widened, [NK][D] */
    const float *kp[NK], *vp[NK];
} Scratch;

static const float zero_row[MAX_HEAD_DIM];

/* b[k][j] <-> b[j][k]: the 16 x 16 floats transposed in registers, by swapping the off-diagonal
 * blocks of 8, then of 4, 2 and 1 (each a two-vector shuffle per pair); the AVX-512 build moves
 * Q^T in and O^T out with it, where moving them a value at a time had cost about a fifth of the
 * kernel's time on short prompts (bench/bench_prefill_attention.py's "16 prompts"). GCC's
 * __builtin_shuffle: a clang build keeps the value-at-a-time moves (TRANSPOSE16). */
#if defined(__GNUC__) && !defined(__clang__)
#define TRANSPOSE16 1
#define SWAP_BLOCKS(S, LO, HI)                                         \
    for (int k = 0; k < 16; k++)                                       \
        if (!(k & (S))) {                                              \
            const v16 a = b[k], c = b[k + (S)];                        \
            b[k] = __builtin_shuffle(a, c, (v16i)LO);                  \
            b[k + (S)] = __builtin_shuffle(a, c, (v16i)HI);            \
        }
static inline __attribute__((always_inline)) void transpose16(v16 *b) {
    SWAP_BLOCKS(8, ((v16i){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}),
                ((v16i){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}))
    SWAP_BLOCKS(4, ((v16i){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}),
                ((v16i){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}))
    SWAP_BLOCKS(2, ((v16i){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}),
                ((v16i){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}))
    SWAP_BLOCKS(1, ((v16i){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}),
                ((v16i){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}))
}
#undef SWAP_BLOCKS
#endif

#define W 16
#define V v16
#define VI v16i
#define NAME(x) CAT(x, _w16)
#include "_prefill_tile.h"
#undef W
#undef V
#undef VI
#undef NAME
#define W 8
#define V v8
#define VI v8i
#define NAME(x) CAT(x, _w8)
#include "_prefill_tile.h"
#undef W
#undef V
#undef VI
#undef NAME
#define W 4
#define V v4
#define VI v4i
#define NAME(x) CAT(x, _w4)
#include "_prefill_tile.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HAVE_TARGETS 1
__attribute__((target("avx512f,avx2,fma"))) static void items_avx512(const Job *j, Scratch *s) {
    if (j->bf16) items_w16(j, s, 8, 1);
    else items_w16(j, s, 8, 0);
}
/* 2 x 4 sums, two of Q^T and a broadcast: 11 of AVX2's 16 registers */
__attribute__((target("avx2,fma"))) static void items_avx2(const Job *j, Scratch *s) {
    if (j->bf16) items_w8(j, s, 4, 1);
    else items_w8(j, s, 4, 0);
}
#endif
static void items_base(const Job *j, Scratch *s) {
    if (j->bf16) items_w4(j, s, 4, 1);
    else items_w4(j, s, 4, 0);
}

/* the build `isa` names (2 AVX-512, 1 AVX2, 0 the baseline; -1 the best this CPU runs of the
 * first two) and its rows a tile, or NULL where this CPU does not run it */
typedef void (*ItemsFn)(const Job *, Scratch *);
static ItemsFn pick(int64_t isa, int64_t *rows) {
    *rows = 8;
#ifdef HAVE_TARGETS
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f");
    /* the baseline build is never picked: 0.47-0.81x torch's SDPA on an AVX-512 CPU (its SSE
     * without FMAs against MKL's AVX2), so a CPU without AVX2 keeps SDPA */
    if (isa < 0) isa = avx512 ? 2 : avx2 ? 1 : -1;
    if (isa == 2) {
        *rows = 32;
        return avx512 ? items_avx512 : NULL;
    }
    if (isa == 1) {
        *rows = 16;
        return avx2 ? items_avx2 : NULL;
    }
#endif
    return isa == 0 ? items_base : NULL;
}

typedef struct {
    Job job;
    ItemsFn fn;
} Thread;

static void *run(void *arg) {
    Thread *th = (Thread *)arg;
    const int64_t D = th->job.D;
    Scratch s;
    s.qt = aligned_alloc(64, sizeof(float) * (size_t)(D * R_MAX));
    s.ot = aligned_alloc(64, sizeof(float) * (size_t)(D * R_MAX));
    s.st = aligned_alloc(64, sizeof(float) * NK * R_MAX);
    s.kw = th->job.bf16 ? aligned_alloc(64, sizeof(float) * (size_t)(2 * NK * D)) : NULL;
    s.vw = s.kw ? s.kw + NK * D : NULL;
    if (s.qt && s.ot && s.st && (s.kw || !th->job.bf16)) th->fn(&th->job, &s);
    else th->job.status = -1;
    free(s.qt);
    free(s.ot);
    free(s.st);
    free(s.kw);
    return NULL;
}

/* 1 where this CPU runs the build `isa` names, else 0 */
int prefill_attention_runs(int64_t isa) {
    int64_t rows;
    return pick(isa, &rows) != NULL;
}

/* out = softmax(q K^T * scale, causal and within `window` when > 0) V for every chunk's rows;
 * q, k, v and out bfloat16 (their bits) where `bf16`, else float.
 * Returns 0; -1 where the sizes are not ones it takes (D a multiple of 8 up to MAX_HEAD_DIM,
 * whole KV groups), a buffer could not be allocated or a thread not started; -2 where this CPU
 * does not run the build `isa` names. The caller then runs SDPA. */
int prefill_attention(const void *q, int64_t q_stride, const void *k, const void *v, const int64_t *slots,
                      const int64_t *meta, int64_t chunks, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      int64_t window, float scale, void *out, int64_t threads, int64_t isa, int64_t bf16) {
    if (head_dim > MAX_HEAD_DIM || head_dim % 8 || kv_heads < 1 || heads % kv_heads) return -1;
    int64_t rows;
    const ItemsFn fn = pick(isa, &rows);
    if (fn == NULL) return -2;
    const int64_t G = heads / kv_heads;
    int64_t count = 0, total = 0;
    for (int64_t c = 0; c < chunks; c++) count += kv_heads * ((meta[M_FIELDS * c + M_N] * G + rows - 1) / rows);
    if (count == 0) return 0;
    int64_t *items = malloc(sizeof(int64_t) * 4 * (size_t)count);
    if (items == NULL) return -1;
    int64_t *cost = items + 3 * count, i = 0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n = meta[M_FIELDS * c + M_N], start = meta[M_FIELDS * c + M_START];
        for (int64_t g = 0; g < kv_heads; g++)
            for (int64_t t = 0; t * rows < n * G; t++, i++) {
                items[3 * i] = c;
                items[3 * i + 1] = g;
                items[3 * i + 2] = t;
                const int64_t last = start + ((t + 1) * rows < n * G ? (t + 1) * rows : n * G) / G;
                cost[i] = window > 0 && last > window ? window : last; /* keys read, about */
                total += cost[i];
            }
    }
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (threads > count) threads = count;
    Thread th[64];
    pthread_t tid[64];
    int64_t it = 0, acc = 0;
    for (int64_t x = 0; x < threads; x++) {
        th[x] = (Thread){{q, q_stride, k, v, slots, meta, out, heads, kv_heads, head_dim, window, scale, bf16 != 0,
                          items, it, it, 0},
                         fn};
        const int64_t goal = total * (x + 1) / threads;
        while (it < count && (acc + cost[it] / 2 <= goal || x == threads - 1)) acc += cost[it++];
        th[x].job.item1 = it;
    }
    int started[64] = {0};
    for (int64_t x = 1; x < threads; x++) started[x] = pthread_create(&tid[x], NULL, run, &th[x]) == 0;
    run(&th[0]);
    int status = th[0].job.status;
    for (int64_t x = 1; x < threads; x++) {
        if (started[x]) {
            pthread_join(tid[x], NULL);
            status |= th[x].job.status;
        } else {
            status = -1;
        }
    }
    free(items);
    return status;
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_prefill_attention", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__prefill_attention(void) { return PyModule_Create(&module); }
