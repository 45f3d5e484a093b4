/* How fast one thread reads 400 MB in blocks of 4-256 KB, in address order and in a shuffled
 * order, with light work per byte (a vector add): the rate a paged KV cache's reads can reach on
 * this machine when a row's blocks lie together or apart. A block of the engine's KV cache holds
 * 16 tokens of one layer, 16 KB in float32 for the default preset (4 KV heads x 64 x 4 B x 16).
 * BENCHMARKS.md ("Prefill attention in C", the decode rows' attention) quotes it.
 *
 * Then reads in the decode kernel's order with the same light work (kv_rows): a forward's worth
 * of decode rows (8 layers, 57 rows of 16-768 tokens, the caches asked for 2 MB pages as the
 * engine's pool asks; it prints how much got them), each token's 1 KB K or V row read whole and
 * asked for 16 tokens ahead as _attention.c asks (AHEAD): K's pass then V's pass (the kernel's
 * order: the softmax needs every score first), and K and V in one pass (an online softmax's
 * order), shuffled blocks and in order. Unlike the kernel it reads a token's row at once, not
 * head by head, and asks for nothing across a pass's start (the kernel asks for V's first rows
 * during the softmax and the next row's first K rows during a row's last block): a rate for a
 * decode kernel with no arithmetic, not the kernel's own.
 *
 *     gcc -O2 -mavx2 bench/block_reads.c -o /tmp/block_reads && /tmp/block_reads
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

typedef float v8 __attribute__((vector_size(32)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* the blocks of `bytes` bytes in the order `order`, every float of them added into 8 vectors */
static float read_blocks(const float *x, const long *order, long blocks, long bytes) {
    v8 acc[8] = {{0}};
    for (long i = 0; i < blocks; i++) {
        const float *b = x + order[i] * (bytes / 4);
        for (long t = 0; t < bytes / 4; t += 64)
            for (int k = 0; k < 8; k++) {
                v8 v;
                __builtin_memcpy(&v, b + t + 8 * k, sizeof v);
                acc[k] += v;
            }
    }
    v8 s = {0};
    for (int k = 0; k < 8; k++) s += acc[k];
    return s[0] + s[7];
}

/* best of 3 passes, GB/s */
static double rate(const float *x, const long *order, long blocks, long bytes, float *sink) {
    double best = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        const double t0 = now();
        *sink += read_blocks(x, order, blocks, bytes);
        const double dt = now() - t0;
        best = dt < best ? dt : best;
    }
    return (double)blocks * bytes / best / 1e9;
}

enum { LAYERS = 8, ROWS = 57, TOK = 256 /* floats in a token's K or V row */, BS = 16, MAXBLK = 49, AHEAD = 16 };

/* one pass over token rows t of `cache` through the block table `bt` (each row's 1 KB asked for
 * AHEAD tokens before it is read), the K and V caches in turn or together */
static void kv_rows(float *const *k, float *const *v, const long *table, const long *ctx, int together, v8 *out) {
    v8 acc[8] = {{0}}; /* locals, eight apart as read_blocks keeps them: one chain of adds (or one
                        * through `out`, each waiting on the last one's store) caps the rate */
    for (int l = 0; l < LAYERS; l++)
        for (int r = 0; r < ROWS; r++) {
            const long *bt = table + r * MAXBLK;
            for (int pass = 0; pass < (together ? 1 : 2); pass++)
                for (long t = 0; t < ctx[r]; t++) {
                    const long a = t + AHEAD;
                    for (int c = 0; c < 2; c++) {
                        if (!together && c != pass) continue;
                        const float *cache = c ? v[l] : k[l];
                        if (a < ctx[r])
                            for (int b = 0; b < TOK * 4; b += 64)
                                __builtin_prefetch((const char *)(cache + (bt[a / BS] * BS + a % BS) * TOK) + b, 0, 3);
                        const float *x = cache + (bt[t / BS] * BS + t % BS) * TOK;
                        for (int i = 0; i < TOK; i += 64)
                            for (int a = 0; a < 8; a++) {
                                v8 w;
                                __builtin_memcpy(&w, x + i + 8 * a, sizeof w);
                                acc[a] += w;
                            }
                    }
                }
        }
    for (int a = 0; a < 8; a++) *out += acc[a];
}

static void decode_reads(void) {
    const long blocks = ROWS * MAXBLK, bytes = blocks * BS * TOK * sizeof(float), huge = 2L << 20;
    const long span = (bytes + huge - 1) / huge * huge;
    float *k[LAYERS], *v[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        k[l] = aligned_alloc(huge, span);
        v[l] = aligned_alloc(huge, span);
        if (k[l] == NULL || v[l] == NULL) exit(1);
        madvise(k[l], span, MADV_HUGEPAGE);
        madvise(v[l], span, MADV_HUGEPAGE);
        memset(k[l], 1, bytes);
        memset(v[l], 1, bytes);
    }
    long huge_kb = 0;
    char line[256];
    FILE *maps = fopen("/proc/self/smaps_rollup", "r");
    while (maps != NULL && fgets(line, sizeof line, maps) != NULL) sscanf(line, "AnonHugePages: %ld kB", &huge_kb);
    if (maps != NULL) fclose(maps);
    printf("the decode rows' caches: %ld MB, %ld MB of this process's memory on 2 MB pages\n",
           2 * LAYERS * bytes / (1L << 20), huge_kb / 1024);
    long table[ROWS * MAXBLK], ctx[ROWS], read = 0;
    for (int r = 0; r < ROWS; r++) read += ctx[r] = 16 + rand() % 752;
    read *= 2L * TOK * sizeof(float) * LAYERS;
    v8 acc = {0};
    for (int shuffled = 0; shuffled < 2; shuffled++) {
        for (long i = 0; i < blocks; i++) table[i] = i;
        for (long i = blocks - 1; shuffled && i > 0; i--) {
            const long j = rand() % (i + 1), t = table[i];
            table[i] = table[j];
            table[j] = t;
        }
        double best[2] = {1e30, 1e30};
        for (int rep = 0; rep < 5; rep++)
            for (int together = 0; together < 2; together++) {
                const double t0 = now();
                kv_rows(k, v, table, ctx, together, &acc);
                const double dt = now() - t0;
                best[together] = dt < best[together] ? dt : best[together];
            }
        printf("a forward's decode rows (%.0f MB of K/V), blocks %s: K then V %.1f GB/s, K and V in one pass %.1f GB/s\n",
               read / 1e6, shuffled ? "shuffled" : "in order", read / best[0] / 1e9, read / best[1] / 1e9);
    }
    if (acc[0] == 12345.0f) puts("");
}

int main(void) {
    const long n = 100L * 1000 * 1000; /* 400 MB of floats: far beyond any cache */
    float *x = aligned_alloc(4096, n * sizeof(float)), sink = 0;
    if (x == NULL) return 1;
    for (long i = 0; i < n; i++) x[i] = (float)(i & 1023) * 1e-3f;
    const long sizes[] = {4096, 16384, 65536, 262144};
    srand(1);
    for (int s = 0; s < 4; s++) {
        const long bytes = sizes[s], blocks = n * (long)sizeof(float) / bytes;
        long *order = malloc(sizeof(long) * blocks);
        if (order == NULL) return 1;
        for (long i = 0; i < blocks; i++) order[i] = i;
        const double in_order = rate(x, order, blocks, bytes, &sink);
        for (long i = blocks - 1; i > 0; i--) {
            const long j = rand() % (i + 1), t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        const double shuffled = rate(x, order, blocks, bytes, &sink);
        printf("blocks of %3ld KB: in order %.1f GB/s, shuffled %.1f GB/s\n", bytes / 1024, in_order, shuffled);
        free(order);
    }
    free(x);
    decode_reads();
    return sink == 12345.0f; /* the sums used: the reads are not optimised away */
}
