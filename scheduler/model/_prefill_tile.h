/* _prefill_attention.c's tile, for one vector width: included once per width with
 *   W: floats in a vector (16, 8 or 4), the rows of a tile being two vectors' lanes (R = 2 W);
 *   V, VI: that vector of floats and of int32, and NAME(x): x with the width's suffix;
 *   for W = 16, transpose16 where TRANSPOSE16 is defined (GCC).
 * GCC lowers a vector wider than the build's registers through the stack, piece by piece
 * (16-float vectors in the AVX2 build: 3 GFLOP/s), so each build takes the width it holds. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define SEL(mask, a, b) ((V)(((VI)(a) & (mask)) | ((VI)(b) & ~(mask))))
#define RW (2 * W)

static inline __attribute__((always_inline)) V NAME(load)(const float *p) {
    V v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void NAME(store)(float *p, V v) { memcpy(p, &v, sizeof v); }

/* e^x for x <= 0, exactly 0 below -87 (a masked score is -inf), where _attention.c's
 * exp8_nonpositive clamps there (a decode row has no masked scores). A NaN stays NaN: it is
 * neither below -87 nor at least -87, so the polynomial takes 0 in its place (no NaN converted
 * to an integer, undefined in C) and x - x (0 for a finite x) puts it back. (Selecting the NaN
 * lanes back, as _attention.c does, made the AVX-512 build's tile 2.4x slower.) */
static inline __attribute__((always_inline)) V NAME(exp)(V x) {
    const VI under = x < -87.0f, in = x >= -87.0f;
    const V e = EXP_CEPHES(V, VI, SEL(in, x, (V){0}));
    return SEL(under, (V){0}, e + (x - x));
}

static inline __attribute__((always_inline)) V NAME(max)(V a, V b) { return SEL(a > b, a, b); }

/* One row tile (RW rows) of one chunk's KV group, JT keys or head-dim values per register block. */
static inline __attribute__((always_inline)) void NAME(tile)(const Job *j, const int64_t *m, int64_t g, int64_t t,
                                                             Scratch *s, const int64_t D, const int JT,
                                                             const int bf16) {
    const int64_t H = j->heads, KVH = j->kv_heads, G = H / KVH, n = m[M_N], start = m[M_START];
    const int64_t r0 = t * RW, r1 = (r0 + RW < n * G) ? r0 + RW : n * G, tok = KVH * D;
    const int64_t *slots = j->slots + m[M_SLOTS];
    float *qt = s->qt, *st = s->st, *ot = s->ot;
    /* lanes past the chunk's rows repeat its last one: finite sums, never written out */
    int32_t pos[RW];
    int64_t qi[RW];
    for (int64_t l = 0; l < RW; l++) {
        const int64_t r = r0 + l < r1 ? r0 + l : r1 - 1, i = r / G, h = g * G + r % G;
        pos[l] = (int32_t)(start + i);
        qi[l] = (m[M_QROW] + i) * j->q_stride + h * D;
    }
#if W == 16 && defined(TRANSPOSE16)
    if (!bf16 && D % W == 0) /* 16 x 16 blocks transposed in registers (transpose16) */
        for (int64_t c0 = 0; c0 < RW; c0 += W) /* rows c0 .. c0 + 15 */
            for (int64_t d0 = 0; d0 < D; d0 += W) {
                V b[W];
                for (int k = 0; k < W; k++) b[k] = NAME(load)((const float *)j->q + qi[c0 + k] + d0) * j->scale;
                transpose16(b);
                for (int k = 0; k < W; k++) NAME(store)(qt + (d0 + k) * RW + c0, b[k]);
            }
    else
#endif
        for (int64_t l = 0; l < RW; l++)
            for (int64_t d = 0; d < D; d++) qt[d * RW + l] = elem(j->q, qi[l] + d, bf16) * j->scale;
    VI pos0, pos1;
    memcpy(&pos0, pos, sizeof pos0);
    memcpy(&pos1, pos + W, sizeof pos1);
    const int64_t pmin = pos[0], pmax = pos[r1 - r0 - 1], w = j->window;
    const int64_t lo = w > 0 && pmin - w + 1 > 0 ? pmin - w + 1 : 0;
    V mx0 = (V){0} - 1e30f, mx1 = mx0, l0 = {0}, l1 = {0};
    memset(ot, 0, sizeof(float) * (size_t)(D * RW));
    for (int64_t k0 = lo; k0 <= pmax; k0 += NK) {
        const int64_t nk = pmax - k0 + 1 < NK ? pmax - k0 + 1 : NK, nkp = (nk + JT - 1) / JT * JT;
        for (int64_t a = 0; a < nkp; a++) {
            const int64_t off = a < nk ? slots[k0 + a] * tok + g * D : -1;
            if (off < 0) {
                s->kp[a] = s->vp[a] = zero_row;
            } else if (bf16) { /* the tile's K and V rows widened once, for all its rows */
                float *kw = s->kw + a * D, *vw = s->vw + a * D;
                const uint16_t *kh = (const uint16_t *)j->k + off, *vh = (const uint16_t *)j->v + off;
                for (int64_t d = 0; d < D; d += 8) { /* D a multiple of 8 */
                    const v8 kx = widen8(kh + d), vx = widen8(vh + d);
                    store8(kw + d, &kx);
                    store8(vw + d, &vx);
                }
                s->kp[a] = kw;
                s->vp[a] = vw;
            } else {
                s->kp[a] = (const float *)j->k + off;
                s->vp[a] = (const float *)j->v + off;
            }
        }
        /* S^T = K Q^T, JT keys at a time */
        for (int64_t a0 = 0; a0 < nkp; a0 += JT) {
            V acc[8][2];
            for (int b = 0; b < JT; b++) acc[b][0] = acc[b][1] = (V){0};
            for (int64_t d = 0; d < D; d++) {
                const V q0 = NAME(load)(qt + d * RW), q1 = NAME(load)(qt + d * RW + W);
#pragma GCC unroll 8
                for (int b = 0; b < JT; b++) {
                    const float kv = s->kp[a0 + b][d];
                    acc[b][0] += kv * q0;
                    acc[b][1] += kv * q1;
                }
            }
            for (int b = 0; b < JT; b++) {
                NAME(store)(st + (a0 + b) * RW, acc[b][0]);
                NAME(store)(st + (a0 + b) * RW + W, acc[b][1]);
            }
        }
        /* the mask, where some row of the tile may not see some key of it */
        const int partial = k0 + nkp - 1 > pmin || (w > 0 && k0 <= pmax - w);
        for (int64_t a = 0; a < nkp && partial; a++) {
            const int32_t kpos = a < nk ? (int32_t)(k0 + a) : INT32_MAX;
            VI see0 = kpos <= pos0, see1 = kpos <= pos1;
            if (w > 0) {
                see0 &= kpos > pos0 - (int32_t)w;
                see1 &= kpos > pos1 - (int32_t)w;
            }
            NAME(store)(st + a * RW, SEL(see0, NAME(load)(st + a * RW), (V){0} - INFINITY));
            NAME(store)(st + a * RW + W, SEL(see1, NAME(load)(st + a * RW + W), (V){0} - INFINITY));
        }
        /* the running maximum and sum; the scores become their exps */
        V n0 = mx0, n1 = mx1;
        for (int64_t a = 0; a < nkp; a++) {
            n0 = NAME(max)(n0, NAME(load)(st + a * RW));
            n1 = NAME(max)(n1, NAME(load)(st + a * RW + W));
        }
        const V al0 = NAME(exp)(mx0 - n0), al1 = NAME(exp)(mx1 - n1);
        V s0 = {0}, s1 = {0};
        for (int64_t a = 0; a < nkp; a++) {
            const V e0 = NAME(exp)(NAME(load)(st + a * RW) - n0), e1 = NAME(exp)(NAME(load)(st + a * RW + W) - n1);
            NAME(store)(st + a * RW, e0);
            NAME(store)(st + a * RW + W, e1);
            s0 += e0;
            s1 += e1;
        }
        l0 = l0 * al0 + s0;
        l1 = l1 * al1 + s1;
        mx0 = n0;
        mx1 = n1;
        /* O^T = O^T * alpha + V^T P^T, JT head-dim values at a time */
        for (int64_t d0 = 0; d0 < D; d0 += JT) {
            V acc[8][2];
            for (int b = 0; b < JT; b++) {
                acc[b][0] = NAME(load)(ot + (d0 + b) * RW) * al0;
                acc[b][1] = NAME(load)(ot + (d0 + b) * RW + W) * al1;
            }
            for (int64_t a = 0; a < nkp; a++) {
                const V p0 = NAME(load)(st + a * RW), p1 = NAME(load)(st + a * RW + W);
                const float *vr = s->vp[a] + d0;
#pragma GCC unroll 8
                for (int b = 0; b < JT; b++) {
                    acc[b][0] += vr[b] * p0;
                    acc[b][1] += vr[b] * p1;
                }
            }
            for (int b = 0; b < JT; b++) {
                NAME(store)(ot + (d0 + b) * RW, acc[b][0]);
                NAME(store)(ot + (d0 + b) * RW + W, acc[b][1]);
            }
        }
    }
    float inv[RW];
    NAME(store)(inv, 1.0f / l0);
    NAME(store)(inv + W, 1.0f / l1);
#if W == 16 && defined(TRANSPOSE16)
    if (!bf16 && D % W == 0) { /* O^T's 16 x 16 blocks transposed back in registers */
        for (int64_t c0 = 0; c0 < r1 - r0; c0 += W) /* rows c0 .. c0 + 15, those the chunk has */
            for (int64_t d0 = 0; d0 < D; d0 += W) {
                V b[W];
                for (int k = 0; k < W; k++) b[k] = NAME(load)(ot + (d0 + k) * RW + c0);
                transpose16(b);
                for (int k = 0; k < W && c0 + k < r1 - r0; k++) {
                    const int64_t r = r0 + c0 + k, i = r / G, h = g * G + r % G;
                    NAME(store)((float *)j->out + (m[M_OUTROW] + i) * H * D + h * D + d0, b[k] * inv[c0 + k]);
                }
            }
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r++) {
        const int64_t l = r - r0, i = r / G, h = g * G + r % G;
        const int64_t oi = (m[M_OUTROW] + i) * H * D + h * D;
        for (int64_t d = 0; d < D; d++) put(j->out, oi + d, ot[d * RW + l] * inv[l], bf16);
    }
}

/* a thread's work items, of one dtype; the common head sizes as constants, so the loops unroll */
static inline __attribute__((always_inline)) void NAME(items)(const Job *j, Scratch *s, const int JT,
                                                              const int bf16) {
    for (int64_t it = j->item0; it < j->item1; it++) {
        const int64_t *x = j->items + 3 * it, *m = j->meta + M_FIELDS * x[0];
        if (j->D == 64) NAME(tile)(j, m, x[1], x[2], s, 64, JT, bf16);
        else if (j->D == 128) NAME(tile)(j, m, x[1], x[2], s, 128, JT, bf16);
        else NAME(tile)(j, m, x[1], x[2], s, j->D, JT, bf16);
    }
}

#undef SEL
#undef RW
