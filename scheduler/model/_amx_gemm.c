/* The projections' bfloat16 GEMM on AMX tiles, one thread (scheduler/model/packed_gemm.py).
 *
 * Why: on a decode round the GEMMs read every projection's weight to multiply a few rows, so
 * their speed is the speed the weights stream at. The default preset's weights (56 MB in
 * bfloat16) stay in this host's L3 from one forward to the next, which one core reads at
 * 23-28 GB/s; oneDNN's reordered GEMM (`_linear_pointwise`) read them at 15-20 GB/s on 16 rows
 * and spent 15-35 us a call on its set-up. This kernel is the plain loop: each column pair's
 * weight blocks, laid out once in the order the tile loads read them, go through two tile
 * multiply-adds per 32 values of K; the rows of x go 16 at a time through the same blocks,
 * which stay in cache between row blocks.
 *
 * Layout (`amx_pack`): W [N, K] as [N / 16][K / 32][16][16][2]: for column tile j and K step s a
 * 1 KB block whose row r holds, for the tile's 16 columns c, W[16j + c][32s + 2r] and
 * W[16j + c][32s + 2r + 1] (the pairs AMX's TDPBF16PS multiplies). N a multiple of 32, K of 32.
 *
 * Arithmetic: each output is the float32 sum of exact bfloat16 products, in the order the tile
 * unit adds them, plus the bias (float32), rounded to bfloat16 once (nearest even, as torch
 * rounds; VCVTNEPS2BF16, so AVX512-BF16 is needed too, which every AMX CPU has). oneDNN sums in another order, so an output can differ from its by one bfloat16 ulp
 * (or two, where the sum cancels; tests/test_packed_gemm.py: almost all equal).
 *
 * Needs a CPU with AMX-TILE, AMX-BF16 and AVX512-BF16, the OS's AVX-512 state and Linux's
 * permission for the tile data (`amx_ready`); anything else, or a compiler without the AMX intrinsics, builds the stubs and
 * packed_gemm uses oneDNN's GEMM. No Python API: the module init only lets setuptools build it.
 */
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include "_kernels.h"

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "_torch_avx512.h"
#else
#define HAVE_AMX 0
#endif

/* the tile configuration's 64 bytes, palette 1 */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileCfg;

/* 1 where this CPU has AMX-TILE, AMX-BF16, AVX512F and AVX512-BF16, the OS saves the AVX-512
 * state (XCR0), and the kernel lets this process use the tile data (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, Linux 5.16 and later), else 0 */
int amx_ready(void) {
#if HAVE_AMX
    unsigned a, b, c, d, lo, hi;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE: xgetbv may run */
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0xE6u) != 0xE6u) return 0; /* the OS saves the AVX and AVX-512 state (store16's) */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!(b & (1u << 16)) || !(d & (1u << 24)) || !(d & (1u << 22))) return 0; /* AVX512F, AMX-TILE, AMX-BF16 */
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return 0; /* AVX512-BF16 (the rounding) */
    (void)hi;
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return 0;
#endif
}

/* W [N, K] (bfloat16 bits) into the layout above, p of N * K values */
void amx_pack(const uint16_t *w, uint16_t *p, int64_t n, int64_t k) {
    const int64_t ks = k / 32;
    for (int64_t j = 0; j < n / 16; j++)
        for (int64_t s = 0; s < ks; s++) {
            uint16_t *blk = p + (j * ks + s) * 512;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++) {
                    blk[r * 32 + c * 2] = w[(16 * j + c) * k + 32 * s + 2 * r];
                    blk[r * 32 + c * 2 + 1] = w[(16 * j + c) * k + 32 * s + 2 * r + 1];
                }
        }
}

#if HAVE_AMX
__attribute__((target("amx-tile")))
static void configure(int rows) {
    TileCfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 3; t++) { /* tiles 0, 1: two column tiles' sums; 2: 16 rows of x */
        cfg.rows[t] = (uint8_t)rows;
        cfg.colsb[t] = 64;
    }
    for (int t = 3; t < 5; t++) { /* tiles 3, 4: a K step's weight block of each column tile */
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* 16 floats to bfloat16 and back: the value a bfloat16 tensor would hold */
__attribute__((target("avx512f,avx512bf16")))
static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* 16 values (+ bias) as float32 */
__attribute__((target("avx512f")))
static inline __m512 load16(const float *acc, const uint16_t *bias) {
    __m512 v = _mm512_loadu_ps(acc);
    if (bias) /* bfloat16 bits shifted up are the float32 */
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bias)), 16)));
    return v;
}

/* 16 sums (+ bias) to bfloat16, nearest even (VCVTNEPS2BF16: torch's rounding; a NaN stays a NaN) */
__attribute__((target("avx512f,avx512bf16")))
static inline void store16(uint16_t *y, const float *acc, const uint16_t *bias) {
    _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(load16(acc, bias)));
}

/* silu(gate) * up for 16 columns, each step rounded to bfloat16 where torch's separate ops
 * round: the GEMM's output as store16 rounds it, F.silu's and the product's as torch's
 * conversion does. SiLU is torch's vectorised kernel's x / (1 + exp(-x)) with torch's own exp
 * (`expf16`): the same bits as `F.silu(gate) * up` on this kernel's gate/up output. */
__attribute__((target("avx512f,avx512bf16")))
static inline void store_gated(uint16_t *y, const float *gate, const float *up, const uint16_t *gate_bias,
                               const uint16_t *up_bias, ExpF16 expf16) {
    const __m512 g = round_bf16(load16(gate, gate_bias)), u = round_bf16(load16(up, up_bias));
    const __m512i s = torch_bf16(torch_silu16(g, expf16));
    const __m512 sf = _mm512_castsi512_ps(_mm512_slli_epi32(s, 16));
    _mm256_storeu_si256((__m256i *)y, _mm512_cvtepi32_epi16(torch_bf16(_mm512_mul_ps(sf, u))));
}

/* What one call computes: y = x . W^T (+ bias), or with `expf16` the gating of W's two halves */
typedef struct {
    const uint16_t *p, *bias;
    uint16_t *y;
    int64_t n, ks, y_cols;
    ExpF16 expf16; /* NULL: the plain product */
} Gemm;

/* rows of one 16-row block's sums (acc [16][32]: column tiles a, b) into y at pair q */
__attribute__((target("avx512f,avx512bf16")))
static inline void emit(const Gemm *g, float acc[16][32], int64_t row0, int rows, int64_t q) {
    const uint16_t *bias = g->bias;
    uint16_t *y = g->y + row0 * g->y_cols;
    if (g->expf16) { /* gate tile q, up tile q + n / 32: output columns 16q.. */
        const uint16_t *bg = bias ? bias + 16 * q : NULL, *bu = bias ? bias + g->n / 2 + 16 * q : NULL;
        for (int r = 0; r < rows; r++) store_gated(y + r * g->y_cols + 16 * q, acc[r], acc[r] + 16, bg, bu, g->expf16);
    } else { /* column tiles 2q, 2q + 1: output columns 32q.. */
        const uint16_t *b0 = bias ? bias + 32 * q : NULL, *b1 = bias ? bias + 32 * q + 16 : NULL;
        for (int r = 0; r < rows; r++) {
            store16(y + r * g->y_cols + 32 * q, acc[r], b0);
            store16(y + r * g->y_cols + 32 * q + 16, acc[r] + 16, b1);
        }
    }
}

/* Two column tiles at a time, 16 rows of x per pass. (Two row blocks by two column tiles, four
 * sums at once, measured 1.3-1.5x slower here on 64-512 rows: BENCHMARKS.md.) */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16")))
static void gemm(const uint16_t *x, int64_t x_stride, const Gemm *g, int64_t m) {
    float acc[16][32];
    const int64_t ks = g->ks;
    int configured = -1;
    for (int64_t q = 0; q < g->n / 32; q++) {
        const int64_t ja = g->expf16 ? q : 2 * q, jb = g->expf16 ? q + g->n / 32 : 2 * q + 1;
        const uint16_t *b0 = g->p + ja * ks * 512, *b1 = g->p + jb * ks * 512;
        for (int64_t m0 = 0; m0 < m; m0 += 16) {
            const int rows = (int)(m - m0 < 16 ? m - m0 : 16);
            if (rows != configured) {
                configure(rows);
                configured = rows;
            }
            _tile_zero(0);
            _tile_zero(1);
            const uint16_t *xa = x + m0 * x_stride;
            for (int64_t s = 0; s < ks; s++) {
                /* the first row block asks for the weight four K steps ahead (every line of both
                 * blocks; past the pair's end it is the next pair's): a forward's GEMMs measured
                 * 1-9% faster, most where the host was slow and its L3 shared */
                if (m0 == 0)
                    for (int l = 0; l < 16; l++) {
                        const uintptr_t ahead = (uintptr_t)(((s + 4) * 512 + 32 * l) * 2); /* may pass the end */
                        _mm_prefetch((const char *)((uintptr_t)b0 + ahead), _MM_HINT_T0);
                        _mm_prefetch((const char *)((uintptr_t)b1 + ahead), _MM_HINT_T0);
                    }
                _tile_loadd(2, xa + 32 * s, x_stride * 2);
                _tile_loadd(3, b0 + s * 512, 64);
                _tile_loadd(4, b1 + s * 512, 64);
                _tile_dpbf16ps(0, 2, 3);
                _tile_dpbf16ps(1, 2, 4);
            }
            _tile_stored(0, &acc[0][0], 128);
            _tile_stored(1, &acc[0][16], 128);
            emit(g, acc, m0, rows, q);
        }
    }
    _tile_release();
}
#endif

/* y [m, n] = x [m, k] . W^T (+ bias [n]), all bfloat16 bits, W packed by amx_pack; x's rows
 * x_stride values apart, y contiguous. Returns 0, or -1 where the kernel is not built (the
 * caller only calls it where amx_ready said 1) or the sizes are not multiples of 32. */
int amx_linear(const uint16_t *x, int64_t x_stride, const uint16_t *p, const uint16_t *bias, uint16_t *y, int64_t m,
               int64_t n, int64_t k) {
#if HAVE_AMX
    if (n % 32 || k % 32 || m < 0) return -1;
    const Gemm g = {p, bias, y, n, k / 32, n, NULL};
    gemm(x, x_stride, &g, m);
    return 0;
#else
    (void)x, (void)x_stride, (void)p, (void)bias, (void)y, (void)m, (void)n, (void)k;
    return -1;
#endif
}

/* y [m, n / 2] = silu(gate) * up where [gate | up] = x . W^T (+ bias [n]) (a gate/up projection,
 * gate the first n / 2 columns), each step rounded to bfloat16 as torch's ops apart round;
 * expf16 is torch's vectorised float exp (the caller passes Sleef_expf16_u10, which its silu
 * calls). n and k multiples of 32. Returns 0 or -1 as amx_linear. */
int amx_gated(const uint16_t *x, int64_t x_stride, const uint16_t *p, const uint16_t *bias, uint16_t *y, int64_t m,
              int64_t n, int64_t k, void *expf16) {
#if HAVE_AMX
    if (n % 32 || k % 32 || m < 0 || !expf16) return -1;
    const Gemm g = {p, bias, y, n, k / 32, n / 2, (ExpF16)expf16};
    gemm(x, x_stride, &g, m);
    return 0;
#else
    (void)x, (void)x_stride, (void)p, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)expf16;
    return -1;
#endif
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_amx_gemm", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__amx_gemm(void) { return PyModule_Create(&module); }
