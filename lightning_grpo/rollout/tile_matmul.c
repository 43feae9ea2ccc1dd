/* out (M, N) = x (M, K) . w (N, K)^T (+ bias) in bf16 with float32 sums, on AMX tiles (Intel Xeon from Sapphire
 * Rapids on: amx_tile, amx_bf16).
 *
 * The weight is laid out once (`tile_pack`) as the B tiles `tdpbf16ps` reads: for each block of 16 columns (rows of
 * w) and each block of 32 of K, one 1 KiB tile of 16 rows of K-pairs by 16 columns, blocks in the order the product
 * streams them. A product then reads the weight once, front to back: for each pair of column blocks and each block
 * of K, two weight tiles, the x rows' A tiles (straight from x, 32 rows at a time), and up to four tile products into
 * float32 accumulators, which are rounded to bf16 (to nearest, ties to even) once K is done. x is read from the
 * cache; the weight is prefetched into L2 ahead of its use, so the stream runs at the memory's rate while the tiles
 * multiply.
 *
 * Each output is one row of x against one column of w, summed over K in the same blocks and order whatever M is and
 * wherever the row sits, so a row's result does not depend on the other rows of the batch. `threads` > 1 splits the
 * column blocks between this thread and kept workers (split_threads.h; tiles are per thread: each configures its own).
 *
 * int8 weights (`tile_linear_int8`, amx_int8): the weight's int8 values packed by `tile_pack` as the B tiles of
 * `tdpbssd` (16 columns x 64 of K, 1 KiB: half the bytes of the bf16 weight per element of K). Each row of x is split
 * into two int8 rows, x = s * (x1 + x2 / 254) + e with s = max |x| / 127 and |e| <= s / 508, so the activations keep
 * about 16 bits (more than bf16's 8 of mantissa for all but the row's smallest elements); both are multiplied
 * exactly into int32 sums, which are combined in float32 with the row's and the column's scales and the bias, then
 * rounded to bf16 once. 16 rows of x against two column blocks per pass; the weight is read from memory by the first
 * pass and from the cache by the others.
 *
 * Built by tile_matmul.py with the system's C compiler; see there.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "split_threads.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* How many K blocks (1 KiB of each stream) ahead the weight is prefetched into L2. */
#define PREFETCH_BLOCKS 32
#define TILE_ELEMENTS 512 /* bf16 elements in one 16 x 64-byte tile */

/* Linux lends a process the tile registers only once asked: 0 when granted (or already), else an error. */
int tile_permission(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

/* packed (ceil(n / 16) blocks x k / 32 blocks x 16 pairs x 16 columns x 2) from w (n, k); k a multiple of 32.
 * Columns past n are zeros. An int8 weight (n, k8) packs as (n, k8 / 2) bf16 would: each "pair" is then a quad. */
int tile_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
    const int64_t kblocks = k / 32, nblocks = (n + 15) / 16, pairs = k / 2;
    const uint32_t *source = (const uint32_t *)w;
    uint32_t *target = (uint32_t *)packed;
    for (int64_t nb = 0; nb < nblocks; ++nb) {
        uint32_t *block = target + nb * kblocks * 256;
        for (int c = 0; c < 16; ++c) {
            const int64_t row = nb * 16 + c;
            for (int64_t pair = 0; pair < pairs; ++pair) /* pair p of K sits in K block p / 16, row p % 16 */
                block[(pair / 16) * 256 + (pair % 16) * 16 + c] = row < n ? source[row * pairs + pair] : 0;
        }
    }
    return 0;
}

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

typedef struct {
    const uint16_t *x, *w;
    const float *bias;
    uint16_t *out;
    int64_t m, n, k, kblocks;
} Problem;

/* Tiles: accumulators 0 (rows a, block 0), 1 (a, block 1), 2 (b, 0), 3 (b, 1); x rows a 4, rows b 5; weight
 * blocks 6 and 7. rows_b may be 0 (its tiles are then unused). */
static void configure(int rows_a, int rows_b) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    const int rows[8] = {rows_a, rows_a, rows_b, rows_b, rows_a, rows_b, 16, 16};
    for (int t = 0; t < 8; ++t) {
        config.rows[t] = (uint8_t)(rows[t] > 0 ? rows[t] : 1);
        config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* rows r0 .. r0 + rows of out, columns c0 .. c0 + 16 (fewer at the end), from the float32 sums in acc. */
static inline void store(const Problem *p, const float *acc, int64_t r0, int rows, int64_t c0) {
    const int64_t cols = p->n - c0 < 16 ? p->n - c0 : 16;
    const __mmask16 mask = (__mmask16)((1u << cols) - 1);
    const __m512 bias = p->bias ? _mm512_maskz_loadu_ps(mask, p->bias + c0) : _mm512_setzero_ps();
    uint16_t *out = p->out + r0 * p->n + c0;
    for (int r = 0; r < rows; ++r) {
        const __m512 sums = _mm512_load_ps(acc + 16 * r);
        const __m512 value = p->bias ? _mm512_add_ps(sums, bias) : sums;
        _mm256_mask_storeu_epi16(out + r * p->n, mask, (__m256i)_mm512_cvtneps_pbh(value));
    }
}

#define STORE_TILE(T, R0, ROWS, C0)                                            \
    if ((C0) < p->n) {                                                          \
        _tile_stored(T, acc, 64);                                               \
        store(p, acc, R0, ROWS, C0);                                            \
    }

static inline void prefetch_tile(const uint16_t *tile) {
    for (int line = 0; line < 16; ++line) _mm_prefetch((const char *)tile + 64 * line, _MM_HINT_T1);
}

/* Rows r0 .. r0 + rows_a + rows_b of x against column block nb and, when `two`, nb + 1. */
static void block_pair(const Problem *p, int64_t r0, int rows_a, int rows_b, int64_t nb, int two, float *acc) {
    const int64_t strip = p->kblocks * TILE_ELEMENTS, stride = p->k * 2;
    const uint16_t *w0 = p->w + nb * strip, *w1 = w0 + strip;
    const uint16_t *xa = p->x + r0 * p->k, *xb = xa + 16 * p->k;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < p->kblocks; ++kb) {
        prefetch_tile(w0 + (kb + PREFETCH_BLOCKS) * TILE_ELEMENTS); /* a prefetch past the end never faults */
        if (two) prefetch_tile(w1 + (kb + PREFETCH_BLOCKS) * TILE_ELEMENTS);
        _tile_loadd(4, xa + kb * 32, stride);
        _tile_loadd(6, w0 + kb * TILE_ELEMENTS, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
            _tile_loadd(7, w1 + kb * TILE_ELEMENTS, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (rows_b) {
            _tile_loadd(5, xb + kb * 32, stride);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
        }
    }
    STORE_TILE(0, r0, rows_a, nb * 16)
    if (two) STORE_TILE(1, r0, rows_a, nb * 16 + 16)
    if (rows_b) {
        STORE_TILE(2, r0 + 16, rows_b, nb * 16)
        if (two) STORE_TILE(3, r0 + 16, rows_b, nb * 16 + 16)
    }
}

/* Column blocks begin .. end (pairs from begin) for every row of x. */
static void run_blocks(const void *problem, int64_t begin, int64_t end) {
    const Problem *p = (const Problem *)problem;
    float acc[256] __attribute__((aligned(64)));
    int configured = -1;
    for (int64_t nb = begin; nb < end; nb += 2) {
        for (int64_t r0 = 0; r0 < p->m; r0 += 32) {
            const int64_t left = p->m - r0;
            const int rows_a = left < 16 ? (int)left : 16;
            const int rows_b = left <= 16 ? 0 : (left < 32 ? (int)left - 16 : 16);
            if (rows_a * 64 + rows_b != configured) {
                configure(rows_a, rows_b);
                configured = rows_a * 64 + rows_b;
            }
            block_pair(p, r0, rows_a, rows_b, nb, nb + 1 < end, acc);
        }
    }
    _tile_release();
}

/* Returns 0, or the number of threads that could not be started (their blocks were then done by this thread).
 * Needs tile_permission() granted, k a multiple of 32 and w from tile_pack. */
int tile_linear(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out, int64_t m, int64_t n,
                int64_t k, int threads) {
    const Problem p = {x, w, bias, out, m, n, k, k / 32};
    const int64_t nblocks = (n + 15) / 16;
    return split_columns(run_blocks, &p, nblocks, 2, threads); /* whole pairs of blocks per thread */
}

/* ---- int8 weights (amx_int8) ---- */

/* 16 bf16 from `at` as float32. */
static inline __m512 load_bf16(const uint16_t *at) {
    return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const void *)at));
}

/* max |row[i]| over k elements, k a multiple of 16. */
static float row_peak(const uint16_t *row, int64_t k) {
    __m512 peak = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) peak = _mm512_max_ps(peak, _mm512_abs_ps(load_bf16(row + i)));
    return _mm512_reduce_max_ps(peak);
}

/* 16 float32, already whole numbers in [-127, 127], stored as int8. */
static inline void store_int8s(int8_t *at, __m512 whole) {
    _mm_storeu_si128((__m128i *)at, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(whole)));
}

/* q (n, k) int8 and scale (n) from w (n, k) bf16, k a multiple of 16: per row, scale = max |w| / 127 and q = w / scale
 * rounded to nearest (ties to even); a row of zeros has scale 0 and q 0. */
int tile_quantize(const uint16_t *w, int8_t *q, float *scale, int64_t n, int64_t k) {
    for (int64_t r = 0; r < n; ++r) {
        const uint16_t *row = w + r * k;
        const float s = row_peak(row, k) / 127.0f;
        scale[r] = s;
        const __m512 step = _mm512_set1_ps(s > 0 ? s : 1.0f);
        for (int64_t i = 0; i < k; i += 16) {
            const __m512 steps = _mm512_div_ps(load_bf16(row + i), step);
            store_int8s(q + r * k + i, _mm512_roundscale_ps(steps, _MM_FROUND_TO_NEAREST_INT));
        }
    }
    return 0;
}

/* Each row of x (m, k) as x1, x2 (int8, m x k) and scale (the row's s; 0 for a row of zeros). */
static void split_rows(const uint16_t *x, int8_t *x1, int8_t *x2, float *scale, int64_t m, int64_t k) {
    for (int64_t r = 0; r < m; ++r) {
        const uint16_t *row = x + r * k;
        const float s = row_peak(row, k) / 127.0f;
        scale[r] = s;
        const __m512 inverse = _mm512_set1_ps(s > 0 ? 1.0f / s : 0.0f), step = _mm512_set1_ps(s);
        for (int64_t i = 0; i < k; i += 16) {
            const __m512 v = load_bf16(row + i);
            const __m512 coarse = _mm512_roundscale_ps(_mm512_mul_ps(v, inverse), _MM_FROUND_TO_NEAREST_INT);
            const __m512 rest = _mm512_fnmadd_ps(coarse, step, v); /* |rest| <= s / 2 */
            const __m512 fine = _mm512_mul_ps(_mm512_mul_ps(rest, inverse), _mm512_set1_ps(254.0f));
            store_int8s(x1 + r * k + i, coarse);
            store_int8s(x2 + r * k + i, _mm512_roundscale_ps(fine, _MM_FROUND_TO_NEAREST_INT));
        }
    }
}

typedef struct {
    const int8_t *x1, *x2, *w; /* w: int8 tiles from tile_pack */
    const float *row_scale, *column_scale, *bias;
    uint16_t *out;
    int64_t m, n, k, kblocks; /* kblocks: blocks of 64 of k */
} Int8Problem;

/* out rows r0 .. r0 + rows, columns c0 .. c0 + 16 (fewer at the end) from the int32 sums of x1 (coarse) and x2. */
static inline void store_int8(const Int8Problem *p, const int32_t *coarse, const int32_t *fine, int64_t r0, int rows,
                              int64_t c0) {
    if (c0 >= p->n) return;
    const int64_t cols = p->n - c0 < 16 ? p->n - c0 : 16;
    const __mmask16 mask = (__mmask16)((1u << cols) - 1);
    const __m512 bias = p->bias ? _mm512_maskz_loadu_ps(mask, p->bias + c0) : _mm512_setzero_ps();
    const __m512 column = _mm512_maskz_loadu_ps(mask, p->column_scale + c0);
    uint16_t *out = p->out + r0 * p->n + c0;
    for (int r = 0; r < rows; ++r) {
        const __m512 sums = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(fine + 16 * r)),
                                            _mm512_set1_ps(1.0f / 254.0f),
                                            _mm512_cvtepi32_ps(_mm512_load_si512(coarse + 16 * r)));
        const __m512 value = _mm512_fmadd_ps(sums, _mm512_mul_ps(_mm512_set1_ps(p->row_scale[r0 + r]), column), bias);
        _mm256_mask_storeu_epi16(out + r * p->n, mask, (__m256i)_mm512_cvtneps_pbh(value));
    }
}

/* The weight stream's prefetch: `lines` cache lines from `at` at each K block of every pass, so that the bytes one
 * pair of column blocks reads are asked for over all of its passes, PREFETCH_BLOCKS KiB ahead. */
typedef struct {
    const char *at;
    int lines;
} Ahead;

/* Rows r0 .. r0 + rows of x against column block nb and, when `two`, nb + 1. Tiles: sums 0 (x1, block 0),
 * 1 (x1, block 1), 2 (x2, block 0), 3 (x2, block 1); x1 4, x2 5; weight blocks 6 and 7. Each weight tile is
 * loaded right before its products, which measured faster than loading all four operands first. */
static void block_pair_int8(const Int8Problem *p, int64_t r0, int rows, int64_t nb, int two, Ahead *ahead,
                            int32_t *sums) {
    const int64_t strip = p->kblocks * 1024;
    const int8_t *w0 = p->w + nb * strip, *w1 = w0 + strip;
    const int8_t *x1 = p->x1 + r0 * p->k, *x2 = p->x2 + r0 * p->k;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < p->kblocks; ++kb) {
        for (int line = 0; line < ahead->lines; ++line, ahead->at += 64) _mm_prefetch(ahead->at, _MM_HINT_T1);
        _tile_loadd(4, x1 + kb * 64, p->k);
        _tile_loadd(6, w0 + kb * 1024, 64);
        _tile_dpbssd(0, 4, 6);
        if (two) {
            _tile_loadd(7, w1 + kb * 1024, 64);
            _tile_dpbssd(1, 4, 7);
        }
        _tile_loadd(5, x2 + kb * 64, p->k);
        _tile_dpbssd(2, 5, 6);
        if (two) _tile_dpbssd(3, 5, 7);
    }
    int32_t *coarse = sums, *fine = sums + 256; /* tile numbers must be constants */
    _tile_stored(0, coarse, 64);
    _tile_stored(2, fine, 64);
    store_int8(p, coarse, fine, r0, rows, nb * 16);
    if (two) {
        _tile_stored(1, coarse, 64);
        _tile_stored(3, fine, 64);
        store_int8(p, coarse, fine, r0, rows, nb * 16 + 16);
    }
}

static void run_blocks_int8(const void *problem, int64_t begin, int64_t end) {
    const Int8Problem *p = (const Int8Problem *)problem;
    int32_t sums[512] __attribute__((aligned(64)));
    const int64_t passes = (p->m + 15) / 16;
    /* a pair's passes read 2 KiB a K block from memory once: 32 lines, shared between the passes (a prefetch
     * past the end never faults) */
    Ahead ahead = {(const char *)(p->w + begin * p->kblocks * 1024) + PREFETCH_BLOCKS * 1024,
                   (int)((32 + passes - 1) / passes)};
    int configured = -1;
    for (int64_t nb = begin; nb < end; nb += 2) {
        for (int64_t r0 = 0; r0 < p->m; r0 += 16) {
            const int rows = p->m - r0 < 16 ? (int)(p->m - r0) : 16;
            if (rows != configured) {
                configure(rows, rows);
                configured = rows;
            }
            block_pair_int8(p, r0, rows, nb, nb + 1 < end, &ahead, sums);
        }
    }
    _tile_release();
}

/* out (m, n) = x (m, k) . (w * column_scale)^T (+ bias), w int8 (n, k) packed by tile_pack as (n, k / 2); k a multiple
 * of 64. Returns as tile_linear does, or -1 when the split rows could not be allocated. */
int tile_linear_int8(const uint16_t *x, const int8_t *w, const float *column_scale, const float *bias, uint16_t *out,
                     int64_t m, int64_t n, int64_t k, int threads) {
    int8_t *split = malloc((size_t)(2 * m * k) + (size_t)m * sizeof(float));
    if (!split) return -1;
    float *row_scale = (float *)(split + 2 * m * k);
    split_rows(x, split, split + m * k, row_scale, m, k);
    const Int8Problem p = {split, split + m * k, w, row_scale, column_scale, bias, out, m, n, k, k / 64};
    const int failed = split_columns(run_blocks_int8, &p, (n + 15) / 16, 2, threads);
    free(split);
    return failed;
}
