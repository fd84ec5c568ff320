/*
 * membw.c - streaming-read memory bandwidth probe.
 *
 * Reads a large buffer (default 1 GiB) several times with a sum reduction and
 * reports the best achieved read bandwidth for 1 and 2 threads (or the thread
 * counts given on the command line). Used by scripts/bench-vs-llamacpp.sh as the
 * "what the memory system can deliver" reference for decode throughput.
 *
 * Build:  cc -O3 -march=native -fopenmp scripts/membw.c -o /tmp/membw
 *         (without -fopenmp it still builds, but every row is single-threaded
 *         and reports threads=1)
 * Run:    /tmp/membw [size_MiB] [reps] [threads...]
 *         defaults: 1024 MiB, 8 reps, threads 1 2
 * Output: one line per thread count, e.g.
 *         membw threads=1 size_mib=1024 best_gbps=12.34 median_gbps=12.01
 *
 * GB/s here is 1e9 bytes/s. Each thread streams a contiguous slice of the
 * buffer; the inner loop uses several independent accumulators so the compiler
 * vectorises it (AVX2/AVX-512 with -march=native) and it is load-bound, not
 * add-latency-bound. Pages are touched (written) before timing so page faults
 * are not measured.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#else
/* Built without -fopenmp: pragmas are ignored, everything runs on 1 thread. */
static int omp_get_thread_num(void) { return 0; }
static int omp_get_num_threads(void) { return 1; }
#endif

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Sum n uint64 words with 8 independent accumulators (vectorisable). */
static uint64_t sum_slice(const uint64_t *restrict p, size_t n) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        a0 += p[i + 0];
        a1 += p[i + 1];
        a2 += p[i + 2];
        a3 += p[i + 3];
        a4 += p[i + 4];
        a5 += p[i + 5];
        a6 += p[i + 6];
        a7 += p[i + 7];
    }
    for (; i < n; i++) a0 += p[i];
    return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    size_t size_mib = 1024;
    int reps = 8;
    int threads[16] = {1, 2};
    int nthreads_cfg = 2;

    if (argc > 1) size_mib = (size_t)strtoull(argv[1], NULL, 10);
    if (argc > 2) reps = atoi(argv[2]);
    if (argc > 3) {
        nthreads_cfg = 0;
        for (int i = 3; i < argc && nthreads_cfg < 16; i++) threads[nthreads_cfg++] = atoi(argv[i]);
    }
    if (size_mib == 0 || reps <= 0) {
        fprintf(stderr, "usage: %s [size_MiB] [reps] [threads...]\n", argv[0]);
        return 2;
    }

    size_t bytes = size_mib << 20;
    size_t words = bytes / sizeof(uint64_t);
    uint64_t *buf = NULL;
    if (posix_memalign((void **)&buf, 4096, bytes) != 0 || buf == NULL) {
        fprintf(stderr, "membw: cannot allocate %zu MiB\n", size_mib);
        return 1;
    }

    /* Touch every page (in parallel, so first-touch placement matches the readers). */
    int maxt = 1;
    for (int k = 0; k < nthreads_cfg; k++)
        if (threads[k] > maxt) maxt = threads[k];
#pragma omp parallel for num_threads(maxt) schedule(static)
    for (size_t i = 0; i < words; i++) buf[i] = (uint64_t)i;

    double *gbps = malloc(sizeof(double) * (size_t)reps);
    volatile uint64_t sink = 0;

    for (int k = 0; k < nthreads_cfg; k++) {
        int nt = threads[k];
        if (nt <= 0) continue;
#ifndef _OPENMP
        nt = 1;
#endif
        /* warm-up pass */
        {
            uint64_t total = 0;
#pragma omp parallel num_threads(nt) reduction(+ : total)
            {
                int t = omp_get_thread_num(), T = omp_get_num_threads();
                size_t lo = words * (size_t)t / (size_t)T, hi = words * (size_t)(t + 1) / (size_t)T;
                total += sum_slice(buf + lo, hi - lo);
            }
            sink += total;
        }
        for (int r = 0; r < reps; r++) {
            uint64_t total = 0;
            double t0 = now_s();
#pragma omp parallel num_threads(nt) reduction(+ : total)
            {
                int t = omp_get_thread_num(), T = omp_get_num_threads();
                size_t lo = words * (size_t)t / (size_t)T, hi = words * (size_t)(t + 1) / (size_t)T;
                total += sum_slice(buf + lo, hi - lo);
            }
            double dt = now_s() - t0;
            sink += total;
            gbps[r] = (double)bytes / dt / 1e9;
        }
        qsort(gbps, (size_t)reps, sizeof(double), cmp_double);
        printf("membw threads=%d size_mib=%zu best_gbps=%.2f median_gbps=%.2f\n", nt, size_mib,
               gbps[reps - 1], gbps[reps / 2]);
        fflush(stdout);
    }

    /* Use the checksum so the reads cannot be optimised away. */
    if (sink == 42) fprintf(stderr, "(checksum %llu)\n", (unsigned long long)sink);
    free(gbps);
    free(buf);
    return 0;
}
