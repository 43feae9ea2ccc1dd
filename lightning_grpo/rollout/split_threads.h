/* Splitting a kernel's columns between threads started for one call (small_matmul.c, tile_matmul.c); native_build.py
 * hashes it with them.
 */
#ifndef LIGHTNING_GRPO_SPLIT_THREADS_H
#define LIGHTNING_GRPO_SPLIT_THREADS_H

#include <pthread.h>
#include <stdint.h>

#define MAX_THREADS 64

/* The work on columns begin .. end of one problem. */
typedef void (*ColumnWork)(const void *problem, int64_t begin, int64_t end);

typedef struct {
    ColumnWork work;
    const void *problem;
    int64_t begin, end;
} ColumnShare;

static void *run_share(void *arg) {
    const ColumnShare *share = (const ColumnShare *)arg;
    share->work(share->problem, share->begin, share->end);
    return 0;
}

/* `work` over columns 0 .. n, split into `threads` shares of whole multiples of `unit` columns, the first on this
 * thread. Returns 0, or the number of threads that could not be started (their shares were then done here). */
static int split_columns(ColumnWork work, const void *problem, int64_t n, int64_t unit, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    const int64_t share = ((n + threads - 1) / threads + unit - 1) / unit * unit;
    ColumnShare shares[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0}, failed = 0;
    for (int t = 0; t < threads; ++t) {
        const int64_t begin = t * share < n ? t * share : n;
        shares[t] = (ColumnShare){work, problem, begin, begin + share < n ? begin + share : n};
    }
    for (int t = 1; t < threads; ++t) started[t] = pthread_create(&ids[t], 0, run_share, &shares[t]) == 0;
    run_share(&shares[0]);
    for (int t = 1; t < threads; ++t) {
        if (started[t]) {
            pthread_join(ids[t], 0);
        } else {
            run_share(&shares[t]);
            ++failed;
        }
    }
    return failed;
}

#endif
