/* A decode round's decoder layers in one C call, bfloat16 on AMX (scheduler/model/native_layers.py).
 *
 * Why: in a decode round of 16 rows each of a layer's nine steps (norm, qkv GEMM, RoPE and the
 * KV write, attention, o GEMM, add and norm, gate/up GEMM with its gating, down GEMM, residual)
 * is a few microseconds to a few hundred of C, but each also cost its Python call: the
 * interpreter, the argument checks, ctypes, a tensor allocated for its output, all slower
 * right after a GEMM has streamed its weights through the caches. This file chains the same C
 * kernels the Python layer calls, in the same order on the same bits, with one call a round.
 *
 * It computes nothing of its own but the residual add (rounded as torch's bfloat16 add
 * rounds, _vec.h's `narrow`) and the RoPE tables' gather: the kernels are the other
 * extensions' (`_amx_gemm`, `_elementwise`, `_attention`, declared once in _kernels.h), whose
 * addresses the caller hands over in `Kernels`, so this file needs no link to the others.
 *
 * No Python API is used: the module init only exists so setuptools can build this as an
 * extension and pip can install it like one.
 */
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_kernels.h"
#include "_vec.h"

/* the kernels' addresses, typed by their one declaration */
typedef struct {
    __typeof__(amx_linear) *linear;
    __typeof__(amx_gated) *gated;
    __typeof__(rms_norm_bf16) *rms_norm;
    __typeof__(add_rms_norm_bf16) *add_rms_norm;
    __typeof__(rope_kv_bf16) *rope_kv;
    __typeof__(decode_attention_bf16) *attention;
    void *expf16;
} Kernels;

/* one layer's weights (packed for amx_linear) and caches, as addresses; a bias may be 0 */
enum { IN_NORM, QKV, QKV_BIAS, O, O_BIAS, POST_NORM, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, K_CACHE, V_CACHE,
       PER_LAYER };
/* the model's sizes */
enum { HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK_SIZE, NUM_SLOTS, THREADS, ROPE_ROWS, DIMS };

#define P(a) ((uint16_t *)(uintptr_t)(a))

/* out [rows, hidden] = the decoder layers over x [rows, hidden] for decode rows at `positions`
 * (the new token's), their K/V written at `slots` of each layer's caches, their context read
 * through `blocks` [rows, max_blocks]. cos_table and sin_table are RotaryTable's
 * [dims[ROPE_ROWS], head_dim]. `window`: the sliding window where some context exceeds it, else 0.
 * Returns 0, or -1 with `out` unwritten where a position lies past the tables, a kernel
 * refused (a slot outside the caches, the attention's own limits) or scratch could not be
 * allocated: the caller then runs the layers in Python, which writes the same K/V again or
 * raises why. The residual add rounds as torch's does; only a NaN's encoding can differ
 * (_vec.h's 0x7FC0, where torch's vectorised add writes 0xFFFF). */
int decode_layers(const Kernels *kn, const int64_t *layers, int64_t n_layers, const int64_t *dims, float eps,
                  const uint16_t *x, uint16_t *out, int64_t rows, const uint16_t *cos_table,
                  const uint16_t *sin_table, const int64_t *positions, const int64_t *slots, const int64_t *blocks,
                  int64_t max_blocks, int64_t window) {
    const int64_t hs = dims[HIDDEN], heads = dims[HEADS], kvh = dims[KV_HEADS], d = dims[HEAD_DIM];
    const int64_t inter = dims[INTER], qkvw = (heads + 2 * kvh) * d, qs = heads * d;
    const float scale = (float)pow((double)d, -0.5); /* Python's d ** -0.5, then float32 as ctypes passes it */
    if (rows < 1) return -1;
    /* scratch: cos, sin [rows, d]; h, sum [rows, hs]; qkv; attn [rows, qs]; gated [rows, inter]; y and the
     * running x [rows, hs]; then ctx [rows] */
    const size_t n16 = ((size_t)rows * (size_t)(2 * d + 4 * hs + qkvw + qs + inter) + 3) & ~(size_t)3; /* ctx aligned */
    uint16_t *buf = malloc(n16 * sizeof(uint16_t) + (size_t)rows * sizeof(int64_t));
    if (!buf) return -1;
    uint16_t *cos = buf, *sin = cos + rows * d, *h = sin + rows * d, *sum = h + rows * hs, *qkv = sum + rows * hs;
    uint16_t *attn = qkv + rows * qkvw, *gated = attn + rows * qs, *y = gated + rows * inter, *cur = y + rows * hs;
    int64_t *ctx = (int64_t *)(void *)(buf + n16);
    for (int64_t r = 0; r < rows; r++) {
        if (positions[r] < 0 || positions[r] >= dims[ROPE_ROWS]) {
            free(buf);
            return -1;
        }
        memcpy(cos + r * d, cos_table + positions[r] * d, (size_t)d * 2);
        memcpy(sin + r * d, sin_table + positions[r] * d, (size_t)d * 2);
        ctx[r] = positions[r] + 1;
    }
    memcpy(cur, x, (size_t)(rows * hs) * 2);
    int status = 0;
    for (int64_t i = 0; i < n_layers; i++) {
        const int64_t *w = layers + i * PER_LAYER;
        /* a kernel that refuses stops the round before the next one reads its output */
        kn->rms_norm(cur, hs, P(w[IN_NORM]), h, rows, hs, eps);
        if ((status = kn->linear(h, hs, P(w[QKV]), P(w[QKV_BIAS]), qkv, rows, qkvw, hs))) break;
        if ((status = kn->rope_kv(qkv, qkvw, cos, sin, rows, heads, kvh, d, P(w[K_CACHE]), P(w[V_CACHE]), slots,
                                  dims[NUM_SLOTS])))
            break;
        if ((status = kn->attention(qkv, qkvw, P(w[K_CACHE]), P(w[V_CACHE]), blocks, max_blocks, ctx, rows, heads,
                                    kvh, d, dims[BLOCK_SIZE], window, scale, attn, dims[THREADS])))
            break;
        if ((status = kn->linear(attn, qs, P(w[O]), P(w[O_BIAS]), y, rows, hs, qs))) break;
        kn->add_rms_norm(cur, y, sum, P(w[POST_NORM]), h, rows, hs, eps);
        if ((status = kn->gated(h, hs, P(w[GATE_UP]), P(w[GATE_UP_BIAS]), gated, rows, 2 * inter, hs, kn->expf16)))
            break;
        if ((status = kn->linear(gated, inter, P(w[DOWN]), P(w[DOWN_BIAS]), y, rows, hs, inter))) break;
        for (int64_t e = 0; e < rows * hs; e++) cur[e] = narrow(widen(sum[e]) + widen(y[e])); /* torch's add */
    }
    if (status == 0) memcpy(out, cur, (size_t)(rows * hs) * 2);
    free(buf);
    return status ? -1 : 0;
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_decode_layers", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__decode_layers(void) { return PyModule_Create(&module); }
