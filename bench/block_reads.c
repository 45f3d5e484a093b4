/* How fast one thread reads 400 MB in blocks of 4-256 KB, in address order and in a shuffled
 * order, with light work per byte (a vector add): the rate a paged KV cache's reads can reach on
 * this machine when a row's blocks lie together or apart. A block of the engine's KV cache holds
 * 16 tokens of one layer, 16 KB in float32 for the default preset (4 KV heads x 64 x 4 B x 16).
 * BENCHMARKS.md ("Prefill attention in C", the decode rows' attention) quotes it.
 *
 *     gcc -O2 -mavx2 bench/block_reads.c -o /tmp/block_reads && /tmp/block_reads
 */
#include <stdio.h>
#include <stdlib.h>
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
    return sink == 12345.0f; /* the sums used: the reads are not optimised away */
}
