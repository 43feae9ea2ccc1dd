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
 * column blocks between threads started for the call (tiles are per thread: each configures its own).
 *
 * Built by tile_matmul.py with the system's C compiler; see there.
 */
#include <immintrin.h>
#include <stdint.h>
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
 * Columns past n are zeros. */
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
