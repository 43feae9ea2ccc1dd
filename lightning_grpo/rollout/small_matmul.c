/* out (M, N) = x (M, K) . w (N, K)^T in float32, for the few rows of a decode step (AVX2 + FMA).
 *
 * The weight is streamed once, four rows at a time; each group of four is multiplied with every row of x while it
 * sits in the L1 cache (x itself stays in L2), and the next four are prefetched meanwhile. A block of 3 rows of x
 * by 4 rows of w keeps 12 accumulators of 8 lanes in registers. Each output element is the dot product of one x row
 * and one w row, summed in the same order whatever M is and wherever the row sits, so a row's result does not depend
 * on the other rows of the batch. `threads` > 1 splits the columns (rows of w) between this thread and kept workers
 * (split_threads.h).
 *
 * Built by small_matmul.py with the system's C compiler; see there.
 */
#include <immintrin.h>
#include <stdint.h>

#include "split_threads.h"

/* The four horizontal sums of a0..a3, in order. */
static inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* The same sum as sum4 gives for one lane set (same order of additions), for the last columns. */
static inline float sum1(__m256 a) {
    __m256 z = _mm256_setzero_ps();
    return _mm_cvtss_f32(sum4(a, z, z, z));
}

typedef struct {
    const float *x, *w;
    float *out;
    int64_t m, n, k, kfull; /* kfull: k rounded down to a multiple of 8 */
    __m256i tail;           /* lanes k - kfull of the last, partial vector */
} Problem;

#define FMA4(A)                                          \
    acc[i][0] = _mm256_fmadd_ps(A, b0, acc[i][0]);       \
    acc[i][1] = _mm256_fmadd_ps(A, b1, acc[i][1]);       \
    acc[i][2] = _mm256_fmadd_ps(A, b2, acc[i][2]);       \
    acc[i][3] = _mm256_fmadd_ps(A, b3, acc[i][3]);

/* out[r..r+ROWS, c..c+4] for rows r of x and columns c (rows of w). */
#define BLOCK(ROWS)                                                                                         \
    static void block##ROWS(const Problem *p, int64_t r, int64_t c) {                                       \
        const int64_t k = p->k;                                                                             \
        const float *x = p->x + r * k, *w0 = p->w + c * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;        \
        __m256 acc[ROWS][4];                                                                                \
        for (int i = 0; i < ROWS; ++i)                                                                      \
            for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();                                    \
        int64_t j = 0;                                                                                      \
        for (; j < p->kfull; j += 8) {                                                                      \
            __m256 b0 = _mm256_loadu_ps(w0 + j), b1 = _mm256_loadu_ps(w1 + j);                              \
            __m256 b2 = _mm256_loadu_ps(w2 + j), b3 = _mm256_loadu_ps(w3 + j);                              \
            if (r == 0) { /* fetch the next 4 weight rows while these are used (a prefetch never faults) */ \
                _mm_prefetch((const char *)(w3 + k + j), _MM_HINT_T0);                                      \
                _mm_prefetch((const char *)(w3 + 2 * k + j), _MM_HINT_T0);                                  \
                _mm_prefetch((const char *)(w3 + 3 * k + j), _MM_HINT_T0);                                  \
                _mm_prefetch((const char *)(w3 + 4 * k + j), _MM_HINT_T0);                                  \
            }                                                                                               \
            for (int i = 0; i < ROWS; ++i) {                                                                \
                __m256 a = _mm256_loadu_ps(x + i * k + j);                                                  \
                FMA4(a)                                                                                     \
            }                                                                                               \
        }                                                                                                   \
        if (j < k) {                                                                                        \
            __m256 b0 = _mm256_maskload_ps(w0 + j, p->tail), b1 = _mm256_maskload_ps(w1 + j, p->tail);      \
            __m256 b2 = _mm256_maskload_ps(w2 + j, p->tail), b3 = _mm256_maskload_ps(w3 + j, p->tail);      \
            for (int i = 0; i < ROWS; ++i) {                                                                \
                __m256 a = _mm256_maskload_ps(x + i * k + j, p->tail);                                      \
                FMA4(a)                                                                                     \
            }                                                                                               \
        }                                                                                                   \
        for (int i = 0; i < ROWS; ++i)                                                                      \
            _mm_storeu_ps(p->out + (r + i) * p->n + c, sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));   \
    }
BLOCK(1)
BLOCK(2)
BLOCK(3)

/* One column c (a single row of w) for every row of x: the columns left over after the blocks of 4. */
static void column(const Problem *p, int64_t c) {
    const int64_t k = p->k;
    const float *w = p->w + c * k;
    for (int64_t r = 0; r < p->m; ++r) {
        const float *x = p->x + r * k;
        __m256 acc = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j < p->kfull; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(w + j), acc);
        if (j < k) acc = _mm256_fmadd_ps(_mm256_maskload_ps(x + j, p->tail), _mm256_maskload_ps(w + j, p->tail), acc);
        p->out[r * p->n + c] = sum1(acc);
    }
}

/* Columns begin .. end (rows of w) for every row of x. */
static void run_columns(const void *problem, int64_t begin, int64_t end) {
    const Problem *p = (const Problem *)problem;
    int64_t c = begin;
    for (; c + 4 <= end; c += 4) {
        int64_t r = 0;
        for (; r + 3 <= p->m; r += 3) block3(p, r, c);
        if (p->m - r == 2) block2(p, r, c);
        else if (p->m - r == 1) block1(p, r, c);
    }
    for (; c < end; ++c) column(p, c);
}

/* Returns 0, or the number of threads that could not be started (their columns were then done by this thread). */
int small_matmul(const float *x, const float *w, float *out, int64_t m, int64_t n, int64_t k, int threads) {
    Problem p = {x, w, out, m, n, k, k & ~(int64_t)7, _mm256_setzero_si256()};
    int32_t lanes[8];
    for (int i = 0; i < 8; ++i) lanes[i] = i < k - p.kfull ? -1 : 0;
    p.tail = _mm256_loadu_si256((const __m256i *)lanes);
    return split_columns(run_columns, &p, n, 4, threads); /* whole blocks of 4 columns per thread */
}
