/* The C kernels that _decode_layers.c chains, declared once: each defining file includes this,
 * so its definition must match, and _decode_layers.c types its function pointers from it. */
#ifndef MSTRACE_KERNELS_H
#define MSTRACE_KERNELS_H

#include <stdint.h>

/* _amx_gemm.c */
int amx_linear(const uint16_t *x, int64_t x_stride, const uint16_t *p, const uint16_t *bias, uint16_t *y, int64_t m,
               int64_t n, int64_t k);
int amx_gated(const uint16_t *x, int64_t x_stride, const uint16_t *p, const uint16_t *bias, uint16_t *y, int64_t m,
              int64_t n, int64_t k, void *expf16);

/* _elementwise.c */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int64_t rows, int64_t n,
                   float eps);
void add_rms_norm_bf16(const uint16_t *x, const uint16_t *y, uint16_t *sum, const uint16_t *w, uint16_t *out,
                       int64_t rows, int64_t n, float eps);
int rope_kv_bf16(uint16_t *qkv, int64_t stride, const uint16_t *cos, const uint16_t *sin, int64_t rows,
                 int64_t heads, int64_t kv_heads, int64_t D, uint16_t *k_cache, uint16_t *v_cache,
                 const int64_t *slots, int64_t num_slots);

/* _attention.c */
int decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                          const int64_t *blocks, int64_t max_blocks, const int64_t *ctx, int64_t rows,
                          int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                          int64_t window, float scale, uint16_t *out, int64_t threads);

#endif
