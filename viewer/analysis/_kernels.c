/* The cost table's inner loops (viewer/analysis/native.py), called through ctypes,
 * which releases the GIL: the two analysis threads run in parallel.
 *
 * Sorted-array searches: a trace's queries come almost in order (one thread's rows
 * by start time), so each search starts from the previous answer and gallops (1, 2,
 * 4, ... steps) before it bisects: a query next to the last one costs a few
 * comparisons instead of a ~20-step bisection of a long array. Any order stays
 * correct, at O(log distance).
 *
 * Splitting probe rows by boundary: one counting sort over all rows, instead of a
 * mask, a nonzero and two gathers over every row for each boundary.
 *
 * Unions of intervals: a merge of the rows' sorted runs, not a sort of all of them;
 * a difference of two unions: one pass over both.
 *
 * Grouping collectives rows by (group, seq) for the straggler join: one pass over the
 * rows in key order, instead of numpy's gathers and reductions per group.
 *
 * whatif's replay of the rounds, which its intervals repeat 400 times: the Python loop's
 * 2-3 us a round made a window of 100,000 rounds two minutes.
 *
 * No Python API is used: the module init only exists so setuptools can build this
 * as an extension and pip can install it like one.
 */
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>

/* The first index in [0, n] with s[i] > q, given a guess g in [0, n]. */
static int64_t upper_from(const int64_t *s, int64_t n, int64_t q, int64_t g) {
    int64_t lo, hi, step = 1;
    if (g < n && s[g] <= q) { /* the answer is right of g: gallop up */
        lo = g + 1;
        hi = lo;
        while (hi < n && s[hi] <= q) {
            lo = hi + 1;
            hi += step;
            step <<= 1;
        }
        if (hi > n) hi = n;
    } else { /* the answer is g or left of it: gallop down */
        hi = g;
        lo = g;
        while (lo > 0 && s[lo - 1] > q) {
            hi = lo - 1;
            lo -= step;
            step <<= 1;
        }
        if (lo < 0) lo = 0;
    }
    while (lo < hi) { /* s[lo-1] <= q < s[hi] */
        int64_t mid = lo + (hi - lo) / 2;
        if (s[mid] <= q) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* out[j] = numpy.searchsorted(s, q[j], side="right"). */
void search_right(const int64_t *s, int64_t n, const int64_t *q, int64_t m, int64_t *out) {
    int64_t g = 0;
    for (int64_t j = 0; j < m; j++) {
        g = upper_from(s, n, q[j], g);
        out[j] = g;
    }
}

/* out[j] = the busy time before q[j], over the sorted, disjoint intervals
 * [s[k], s[k] + len[k]) whose prefix sums are cum[0..n] (cum[0] = 0). */
void busy_before(const int64_t *s, const int64_t *len, const int64_t *cum, int64_t n,
                 const int64_t *q, int64_t m, int64_t *out) {
    int64_t g = 0;
    for (int64_t j = 0; j < m; j++) {
        g = upper_from(s, n, q[j], g);
        if (g == 0) {
            out[j] = 0;
            continue;
        }
        int64_t k = g - 1, into = q[j] - s[k];
        out[j] = cum[k] + (into < len[k] ? into : len[k]);
    }
}

/* A row's key: its boundary code, or (host != NULL) code * 2 + 0 for a row on the
 * scheduling thread and code * 2 + 1 for any other; -1 when the code is out of range,
 * -2 for a row of another rank than `want` (rank != NULL: one rank's rows of a TP window,
 * split without copying them out first). */
static inline int64_t key_of(const int32_t *code, const uint8_t *host, const int64_t *rank, int64_t want,
                             int64_t i, int64_t ncodes) {
    if (rank && rank[i] != want) return -2;
    int64_t c = code[i];
    if (c < 0 || c >= ncodes) return -1;
    return host ? c * 2 + (host[i] ? 0 : 1) : c;
}

/* counts[key] += the chunk's rows with that key. Returns the first bad row, or -1. */
int64_t count_keys(const int32_t *code, const uint8_t *host, const int64_t *rank, int64_t want, int64_t n,
                   int64_t ncodes, int64_t *counts) {
    for (int64_t i = 0; i < n; i++) {
        int64_t k = key_of(code, host, rank, want, i, ncodes);
        if (k == -2) continue;
        if (k < 0) return i;
        counts[k]++;
    }
    return -1;
}

/* The chunk's rows copied to their key's run of ts_out / dur_out, in order: pos[key]
 * is where the key's next row goes (a stable counting sort, after count_keys). */
void scatter_rows(const int32_t *code, const uint8_t *host, const int64_t *rank, int64_t want, int64_t n,
                  int64_t ncodes, const int64_t *ts, const int64_t *dur, int64_t *pos, int64_t *ts_out,
                  int64_t *dur_out) {
    for (int64_t i = 0; i < n; i++) {
        int64_t k = key_of(code, host, rank, want, i, ncodes);
        if (k < 0) continue;
        int64_t at = pos[k]++;
        ts_out[at] = ts[i];
        dur_out[at] = dur[i];
    }
}

/* Union of intervals: the order of a stable sort by start is a merge of the input's
 * sorted runs (a run ends where a start falls), a run before another on ties; a window's
 * rows are a few such runs (one per boundary or row group), so the merge replaces a sort
 * of millions of rows. Heap entries are run numbers, keyed by (their next start, run). */
static inline int run_before(const int64_t *s, const int64_t *pos, int64_t a, int64_t b) {
    int64_t x = s[pos[a]], y = s[pos[b]];
    return x < y || (x == y && a < b);
}

static void sift_down(const int64_t *s, const int64_t *pos, int64_t *heap, int64_t k, int64_t i) {
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= k) return;
        if (c + 1 < k && run_before(s, pos, heap[c + 1], heap[c])) c++;
        if (!run_before(s, pos, heap[c], heap[i])) return;
        int64_t t = heap[c];
        heap[c] = heap[i];
        heap[i] = t;
        i = c;
    }
}

/* The union of [s[i], e[i]) as sorted disjoint intervals (touching ones merged), exactly as
 * viewer/analysis/intervals.py's numpy path gives it: a new interval where a start is past
 * every end before it in that order, ending at the running maximum of the ends. Writes
 * out_s / out_e (n entries each) and returns how many; -1 when the input has more than
 * max_runs sorted runs (the caller sorts instead), -2 when memory ran out. */
int64_t union_runs(const int64_t *s, const int64_t *e, int64_t n, int64_t max_runs,
                   int64_t *out_s, int64_t *out_e) {
    if (n == 0) return 0;
    int64_t k = 1;
    for (int64_t i = 1; i < n; i++) {
        if (s[i] < s[i - 1] && ++k > max_runs) return -1;
    }
    int64_t *pos = malloc(sizeof(int64_t) * 3 * k);
    if (!pos) return -2;
    int64_t *stop = pos + k, *heap = pos + 2 * k;
    int64_t r = 0;
    pos[0] = 0;
    for (int64_t i = 1; i < n; i++) {
        if (s[i] < s[i - 1]) {
            stop[r] = i;
            pos[++r] = i;
        }
    }
    stop[r] = n;
    int64_t m = 0, run_end = 0;
    for (int64_t j = 0; j < k; j++) heap[j] = j;
    int64_t live = k;
    for (int64_t j = k / 2 - 1; j >= 0; j--) sift_down(s, pos, heap, live, j);
    while (live) {
        int64_t top = heap[0];
        /* the top run's rows up to the next run's start need no heap work */
        int64_t bound = INT64_MAX, next = -1;
        if (live > 1) {
            next = heap[1];
            if (live > 2 && run_before(s, pos, heap[2], next)) next = heap[2];
            bound = s[pos[next]];
        }
        int64_t i = pos[top], end = stop[top];
        /* a tie with the next run goes to the lower run number */
        int64_t ties = next >= 0 && top < next;
        do {
            if (m == 0 || s[i] > run_end) {
                if (m) out_e[m - 1] = run_end; else run_end = e[i];
                out_s[m++] = s[i];
            }
            if (e[i] > run_end) run_end = e[i];  /* (the running maximum of every end so far) */
            i++;
        } while (i < end && (s[i] < bound || (ties && s[i] == bound)));
        pos[top] = i;
        if (i == end) heap[0] = heap[--live];
        sift_down(s, pos, heap, live, 0);
    }
    out_e[m - 1] = run_end;
    free(pos);
    return m;
}

/* [a_s, a_e) less [w_s, w_e), both sorted disjoint lists (unions): each interval of the
 * first cut by the waits it overlaps, in one pass over both; the pieces are the
 * non-empty overlaps of each interval with the gaps between waits, in order, as
 * viewer/analysis/intervals.py's numpy path gives them for waits of non-negative length
 * (a bad trace's negative wait makes the numpy path's gaps overlap: its pieces then
 * differ, their union does not). out_s / out_e hold na + nw entries; returns how many
 * were written. */
int64_t subtract_sorted(const int64_t *a_s, const int64_t *a_e, int64_t na, const int64_t *w_s,
                        const int64_t *w_e, int64_t nw, int64_t *out_s, int64_t *out_e) {
    int64_t j = 0, m = 0;
    for (int64_t i = 0; i < na; i++) {
        int64_t cur = a_s[i], end = a_e[i];
        while (j < nw && w_e[j] <= cur) j++;  /* waits over before this interval starts */
        for (int64_t k = j; cur < end; k++) {
            if (k == nw || w_s[k] >= end) {
                out_s[m] = cur;
                out_e[m++] = end;
                break;
            }
            if (w_s[k] > cur) {
                out_s[m] = cur;
                out_e[m++] = w_s[k];
            }
            if (w_e[k] > cur) cur = w_e[k];
        }
    }
    return m;
}

/* Rows grouped by key, given `order`, a stable sort of the rows by key (of rows that come
 * nearly sorted, as collectives in order of issue do, numpy's sort is cheap; a hash table
 * scattered them over memory and took longer): run[i] is row i's group, the groups numbered
 * in key order; per group its row count, its first row (the least issue; a tie goes to the
 * lower rank, then the earlier row) and its last (the greatest issue; a tie goes to the
 * higher rank, then the later row). Returns the number of groups. */
int64_t group_sorted(const int64_t *key, const int64_t *rank, const int64_t *issue, const int64_t *order,
                     int64_t n, int64_t *run, int64_t *count, int64_t *first, int64_t *last) {
    int64_t r = -1, prev = 0;
    for (int64_t j = 0; j < n; j++) {
        const int64_t i = order[j];
        if (r < 0 || key[i] != prev) {
            prev = key[i];
            r++;
            count[r] = 0;
            first[r] = last[r] = i;
        }
        run[i] = r;
        count[r]++;
        const int64_t f = first[r], l = last[r];
        if (issue[i] < issue[f] || (issue[i] == issue[f] && rank[i] < rank[f])) first[r] = i;
        if (issue[i] > issue[l] || (issue[i] == issue[l] && rank[i] >= rank[l])) last[r] = i;
    }
    return r + 1;
}

/* whatif's replay of a run's rounds: viewer/analysis/whatif_model.py's `simulate`, the
 * reference, line for line, the same operations on the same doubles in the same order (the
 * build keeps a*b+c apart: -ffp-contract=off), so both give the same timeline to the bit.
 * Python's max(a, b) keeps a unless b is greater (pmax), min(a, b) unless b is less. */
static double pmax(double a, double b) { return b > a ? b : a; }
static double pmin(double a, double b) { return b < a ? b : a; }

#define COLD_GAP_NS 500000.0 /* whatif_model.COLD_GAP_NS */

/* `two_streams`: out = the main stream's earlier work's end, the batch's main start, main end,
 * prefill end. */
static void two_streams(double r0, double main_end, double pre_end, double turn, double main, double pre,
                        double s_main, double s_pre, double out[4]) {
    const double rest = pmax(main_end - r0, 0.0);
    const double wait = rest > 0 ? turn : pmax(pmax(main_end, pre_end) + turn - r0, 0.0);
    const double queue[3] = {rest, main > 0 ? wait : 0.0, main};
    double ends[3] = {r0, r0, r0};
    double pre_left = pre, p_end = r0, t = r0;
    for (int k = 0; k < 3; k++) {
        double left = queue[k];
        while (left > 1e-9) {
            if (pre_left <= 0) {
                t = t + left;
                left = 0.0;
                break;
            }
            const double rate = k == 1 ? 1.0 : s_main, prate = k == 1 ? 1.0 : s_pre;
            const double dt = pmin(left / rate, pre_left / prate);
            left -= dt * rate;
            pre_left -= dt * prate;
            t += dt;
            if (pre_left <= 1e-9) {
                pre_left = 0.0;
                p_end = t;
            }
        }
        ends[k] = t;
    }
    if (pre_left > 0) p_end = t + pre_left;
    out[0] = ends[0], out[1] = ends[1], out[2] = ends[2], out[3] = p_end;
}

/* in: 13 rows of n (P, Q, head_Q, tail_P, not_before, L, T, D, D_pre, A, C, W, G); cold_at: n x 2
 * or NULL; split: 0 one stream, else the two streams' shares. out_r: 3 rows of `rounds` (start,
 * launched, ended); out_b: 3 rows of n (dev_start, dev_end, synced); busy: n x 4, NaN-filled.
 * Returns the last round's end. */
double replay_rounds(int64_t n, int64_t rounds, const int64_t *launches, const int64_t *collects,
                     const double *in, double cold, const uint8_t *cold_at, int split, double s_main,
                     double s_pre, double *out_r, double *out_b, uint8_t *held, double *busy) {
    const double *P = in, *Q = in + n, *head_Q = in + 2 * n, *tail_P = in + 3 * n, *not_before = in + 4 * n;
    const double *L = in + 5 * n, *T = in + 6 * n, *D = in + 7 * n, *D_pre = in + 8 * n, *A = in + 9 * n;
    const double *C = in + 10 * n, *W = in + 11 * n, *G = in + 12 * n;
    double *start = out_r, *launched = out_r + rounds, *ended = out_r + 2 * rounds;
    double *dev_start = out_b, *dev_end = out_b + n, *synced = out_b + 2 * n;
    double main_end = 0.0, pre_end = 0.0, t = 0.0;
    for (int64_t r = 0; r < rounds; r++) {
        const int64_t i = launches[r], j = collects[r];
        if (i >= 0) t = pmax(t, not_before[i]);
        start[r] = t;
        launched[r] = t + (i >= 0 ? P[i] : tail_P[j]);
        if (i >= 0) {
            const double ready = launched[r] + L[i];
            const double idle_since = i ? pmax(main_end, pre_end) : -INFINITY;
            if (!split) {
                const double by_device = i ? dev_end[i - 1] + T[i] : 0.0;
                held[i] = by_device > ready;
                dev_start[i] = pmax(ready, by_device);
                const double work = D[i] + D_pre[i] + A[i];
                const int starts_cold = cold_at ? cold_at[2 * i] : dev_start[i] - idle_since >= COLD_GAP_NS;
                const double c = starts_cold ? pmin(cold, D[i] + D_pre[i]) : 0.0;
                dev_end[i] = dev_start[i] + work + c;
                busy[4 * i] = dev_start[i], busy[4 * i + 1] = dev_end[i];
                main_end = pmax(main_end, dev_end[i]);
            } else {
                const double r0 = pmax(ready, pre_end);
                const double turn = i ? T[i] : 0.0;
                const int has_main = D[i] + A[i] > 0, has_pre = D_pre[i] > 0;
                int pre_cold, main_cold;
                if (cold_at) {
                    pre_cold = has_pre && cold_at[2 * i + 1];
                    main_cold = has_main && cold_at[2 * i];
                } else {
                    pre_cold = has_pre && r0 - idle_since >= COLD_GAP_NS;
                    main_cold = has_main && !has_pre && pmax(r0, idle_since + turn) - idle_since >= COLD_GAP_NS;
                }
                const double c_pre = pre_cold ? pmin(cold, D_pre[i]) : 0.0;
                const double c_main = main_cold ? pmin(cold, D[i]) : 0.0;
                double o[4];
                two_streams(r0, main_end, pre_end, turn, D[i] + A[i] + c_main, D_pre[i] + c_pre, s_main, s_pre, o);
                if (main_end > r0) {
                    dev_end[i - 1] = pmax(dev_end[i - 1], o[0]);
                    busy[4 * (i - 1) + 1] = o[0];
                }
                if (has_main) busy[4 * i] = o[1], busy[4 * i + 1] = o[2];
                if (has_pre) busy[4 * i + 2] = r0, busy[4 * i + 3] = o[3];
                const int last_main = has_main && (o[2] >= o[3] || !has_pre);
                dev_start[i] = last_main ? o[1] : r0;
                held[i] = dev_start[i] > ready;
                dev_end[i] = last_main ? o[2] : o[3];
                main_end = has_main ? o[2] : o[0];
                pre_end = has_pre ? o[3] : pre_end;
            }
        }
        if (j < 0) {
            t = launched[r] + head_Q[i];
        } else {
            synced[j] = pmax(launched[r] + W[j], dev_end[j] + C[j]);
            t = synced[j] + Q[j] + G[j];
        }
        ended[r] = t;
    }
    return t;
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
