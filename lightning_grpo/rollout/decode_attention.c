/* One decode step's attention over a slot cache, for every row at once (AVX2 + FMA, or AVX-512 where the build
 * targets it; float32 or bfloat16 tensors).
 *
 * Row r's new key and value (one per key/value head) are written at position lengths[r] of its slot, then each of
 * its query heads attends to positions [start, lengths[r]] of its slot (start > 0 only within a sliding window):
 * scores = scale * q.k (capped as cap * tanh(s / cap) when softcap > 0), their softmax, and the weighted sum of the
 * values. Everything is computed in float32 and the output is rounded once to the tensors' dtype (bf16: to nearest,
 * ties to even, as torch rounds). The query heads that share a key/value head are served together, so each cached
 * key and value is read once per step and converted once, in place (no copy of the cache, no mask tensor).
 *
 * Rows may come in groups whose slots start with the same prefix (the completions of one prompt: the same keys and
 * values, copied into each slot): a group's prefix is then read once, from its first row's slot, for the queries of
 * all its rows, and each row reads only its own positions after it. A group under a sliding window that cuts into
 * the prefix is served row by row.
 *
 * Layouts (all contiguous): q and out (rows, heads, dim); k_new and v_new (rows, kv_heads, dim); the caches
 * (slots, kv_heads, capacity, dim) with slot r holding row r. Groups: `order` lists the rows group after group,
 * group g being order[starts[g] .. starts[g + 1]) with a shared prefix of prefix[g] positions (0: none).
 * `threads` > 1 splits the (group, key/value head) pairs between this thread and kept workers (split_threads.h).
 *
 * Built by native_build.py with the system's C compiler; see decode_attention.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "split_threads.h"

typedef struct {
    const void *q, *k_new, *v_new;
    void *k_cache, *v_cache, *out;
    const int64_t *lengths, *order, *starts, *prefix;
    int64_t rows, heads, kv_heads, dim, capacity, window, groups, widest; /* widest: the most rows of a group */
    float scale, softcap;
    int bf16;
    atomic_int failed; /* a share could not have its scratch memory */
} Problem;

/* dim values of a key or value vector (bf16 or float32) into float32. */
static inline void to_float(const void *src, int64_t index, int64_t dim, int bf16, float *dst) {
    if (!bf16) {
        memcpy(dst, (const float *)src + index, (size_t)dim * 4);
        return;
    }
    int64_t c = 0;
    for (; c + LANES <= dim; c += LANES) vstoreu(dst + c, widen((const uint16_t *)src + index + c));
    for (; c < dim; ++c) dst[c] = bf16_to_float(((const uint16_t *)src)[index + c]);
}

static inline void copy_vector(const void *src, int64_t from, void *dst, int64_t to, int64_t dim, int bf16) {
    size_t width = bf16 ? 2 : 4;
    memcpy((char *)dst + to * width, (const char *)src + from * width, (size_t)dim * width);
}

/* -- vector math ------------------------------------------------------------------------------------------------ */

static inline float dot(const float *a, const float *b, int64_t dim) {
    vec acc0 = vzero(), acc1 = vzero();
    int64_t c = 0;
    for (; c + 2 * LANES <= dim; c += 2 * LANES) {
        acc0 = vfmadd(vloadu(a + c), vloadu(b + c), acc0);
        acc1 = vfmadd(vloadu(a + c + LANES), vloadu(b + c + LANES), acc1);
    }
    for (; c + LANES <= dim; c += LANES) acc0 = vfmadd(vloadu(a + c), vloadu(b + c), acc0);
    float sum = vsum(vadd(acc0, acc1));
    for (; c < dim; ++c) sum += a[c] * b[c];
    return sum;
}

/* scores[0..n) = exp(scores - max) in place; returns their sum. */
static float exp_shifted(float *scores, int64_t n) {
    float peak = -INFINITY;
    int64_t j = 0;
    if (n >= LANES) {
        vec most = vloadu(scores);
        for (j = LANES; j + LANES <= n; j += LANES) most = vmax(most, vloadu(scores + j));
        peak = vpeak(most);
    }
    for (; j < n; ++j) peak = scores[j] > peak ? scores[j] : peak;
    vec shift = vset1(peak), total = vzero();
    for (j = 0; j + LANES <= n; j += LANES) {
        vec e = vexp(vsub(vloadu(scores + j), shift));
        vstoreu(scores + j, e);
        total = vadd(total, e);
    }
    if (j < n) { /* the last n - j scores, through one vector padded with -inf (whose exp is 0) */
        float tail[LANES];
        for (int64_t i = 0; i < LANES; ++i) tail[i] = j + i < n ? scores[j + i] : -INFINITY;
        vec e = vexp(vsub(vloadu(tail), shift));
        vstoreu(tail, e);
        total = vadd(total, e);
        memcpy(scores + j, tail, (size_t)(n - j) * 4);
    }
    return vsum(total);
}

/* -- one (row, key/value head) pair ----------------------------------------------------------------------------- */

/* Positions whose keys are scored together, and query heads whose outputs are summed together (in registers). */
#define BLOCK 8
#define HEADS_AT_ONCE 4

/* The 8 horizontal sums of a[0..8), in order. */
static inline __m256 sum8x8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* Ask for the cache lines of `count` values from `index` on (past the end of the cache is harmless: a prefetch
   never faults). */
static inline void prefetch(const void *src, int64_t index, int64_t count, int bf16) {
    const char *start = (const char *)src + index * (bf16 ? 2 : 4), *end = start + count * (bf16 ? 2 : 4);
    for (const char *line = start; line < end; line += 64) _mm_prefetch(line, _MM_HINT_T0);
}

/* scores[g * stride + j] = scale * q_g . key_j (capped) for `count` queries and the n keys from `first` (a vector
   index) on. The values of the same positions are prefetched for `weigh`, which reads them next. */
static void score(const Problem *p, const float *queries, int64_t count, int64_t first, int64_t n, float *keys,
                  float *scores, int64_t stride) {
    const int64_t dim = p->dim;
    for (int64_t j0 = 0; j0 < n; j0 += BLOCK) {
        const int64_t block = n - j0 < BLOCK ? n - j0 : BLOCK;
        prefetch(p->k_cache, (first + j0 + 2 * BLOCK) * dim, BLOCK * dim, p->bf16); /* two blocks ahead */
        prefetch(p->v_cache, (first + j0 + 2 * BLOCK) * dim, BLOCK * dim, p->bf16);
        for (int64_t i = 0; i < block; ++i) to_float(p->k_cache, (first + j0 + i) * dim, dim, p->bf16, keys + i * dim);
        for (int64_t g = 0; g < count; ++g) {
            const float *q = queries + g * dim;
            float *out = scores + g * stride + j0;
            if (block == BLOCK && dim % LANES == 0) {
                vec acc[BLOCK];
                for (int i = 0; i < BLOCK; ++i) acc[i] = vzero();
                for (int64_t c = 0; c < dim; c += LANES) {
                    vec qv = vloadu(q + c);
                    for (int i = 0; i < BLOCK; ++i) acc[i] = vfmadd(qv, vloadu(keys + i * dim + c), acc[i]);
                }
                __m256 folded[BLOCK];
                for (int i = 0; i < BLOCK; ++i) folded[i] = fold(acc[i]);
                _mm256_storeu_ps(out, _mm256_mul_ps(sum8x8(folded), _mm256_set1_ps(p->scale)));
            } else {
                for (int64_t i = 0; i < block; ++i) out[i] = p->scale * dot(q, keys + i * dim, dim);
            }
            if (p->softcap > 0)
                for (int64_t i = 0; i < block; ++i) out[i] = p->softcap * tanhf(out[i] / p->softcap);
        }
    }
}

/* outs[h * dim + c] += sum_j weights[h * stride + j] * value_j[c] for H queries (a constant once inlined, so the
   accumulators stay in registers), two vectors of c at a time, then one, then lane by lane. */
static inline __attribute__((always_inline)) void weigh_heads(const Problem *p, const float *weights, int64_t first,
                                                              int64_t n, float *outs, int64_t stride, const int H) {
    const int64_t dim = p->dim;
    int64_t c = 0;
    for (; c + 2 * LANES <= dim; c += 2 * LANES) {
        vec acc[HEADS_AT_ONCE][2];
        for (int h = 0; h < H; ++h) {
            acc[h][0] = vloadu(outs + h * dim + c);
            acc[h][1] = vloadu(outs + h * dim + c + LANES);
        }
        for (int64_t j = 0; j < n; ++j) {
            const vec low = load_vec(p->v_cache, (first + j) * dim + c, p->bf16);
            const vec high = load_vec(p->v_cache, (first + j) * dim + c + LANES, p->bf16);
            for (int h = 0; h < H; ++h) {
                const vec w = vset1(weights[h * stride + j]);
                acc[h][0] = vfmadd(w, low, acc[h][0]);
                acc[h][1] = vfmadd(w, high, acc[h][1]);
            }
        }
        for (int h = 0; h < H; ++h) {
            vstoreu(outs + h * dim + c, acc[h][0]);
            vstoreu(outs + h * dim + c + LANES, acc[h][1]);
        }
    }
    for (; c + LANES <= dim; c += LANES) {
        vec acc[HEADS_AT_ONCE];
        for (int h = 0; h < H; ++h) acc[h] = vloadu(outs + h * dim + c);
        for (int64_t j = 0; j < n; ++j) {
            const vec value = load_vec(p->v_cache, (first + j) * dim + c, p->bf16);
            for (int h = 0; h < H; ++h) acc[h] = vfmadd(vset1(weights[h * stride + j]), value, acc[h]);
        }
        for (int h = 0; h < H; ++h) vstoreu(outs + h * dim + c, acc[h]);
    }
    for (; c < dim; ++c) {
        for (int h = 0; h < H; ++h) {
            float sum = 0;
            for (int64_t j = 0; j < n; ++j) sum += weights[h * stride + j] * load1(p->v_cache, (first + j) * dim + c, p->bf16);
            outs[h * dim + c] += sum;
        }
    }
}

/* outs[g * dim + c] += sum_j weights[g * stride + j] * value_j[c], for `count` queries and the n values from `first`
   (a vector index) on. */
static void weigh(const Problem *p, const float *weights, int64_t count, int64_t first, int64_t n, float *outs,
                  int64_t stride) {
    for (int64_t g0 = 0; g0 < count; g0 += HEADS_AT_ONCE) {
        const float *w = weights + g0 * stride;
        float *o = outs + g0 * p->dim;
        switch (count - g0 < HEADS_AT_ONCE ? count - g0 : HEADS_AT_ONCE) {
            case 1: weigh_heads(p, w, first, n, o, stride, 1); break;
            case 2: weigh_heads(p, w, first, n, o, stride, 2); break;
            case 3: weigh_heads(p, w, first, n, o, stride, 3); break;
            default: weigh_heads(p, w, first, n, o, stride, 4); break;
        }
    }
}

/* The first position row `row` attends to (> 0 only under a sliding window). */
static inline int64_t first_seen(const Problem *p, int64_t row) {
    const int64_t position = p->lengths[row];
    return p->window > 0 && position + 1 > p->window ? position + 1 - p->window : 0;
}

/* One (group, key/value head) pair. scratch: the group's queries and outputs (2 * rows * heads per kv head * dim),
   BLOCK * dim (keys) and rows * heads per kv head * capacity (scores, a row of `capacity` per query). */
static void attend(const Problem *p, int64_t pair, float *scratch) {
    const int64_t group = pair / p->kv_heads, head = pair % p->kv_heads, dim = p->dim, cap = p->capacity;
    const int64_t per_kv = p->heads / p->kv_heads, *rows = p->order + p->starts[group];
    const int64_t members = p->starts[group + 1] - p->starts[group], queries_n = members * per_kv;
    float *queries = scratch, *outs = queries + queries_n * dim, *keys = outs + queries_n * dim;
    float *scores = keys + BLOCK * dim;
    int64_t shared = p->prefix[group];
    for (int64_t m = 0; m < members; ++m) {
        const int64_t row = rows[m], at = (row * p->kv_heads + head) * cap + p->lengths[row], from = row * p->kv_heads + head;
        copy_vector(p->k_new, from * dim, p->k_cache, at * dim, dim, p->bf16);
        copy_vector(p->v_new, from * dim, p->v_cache, at * dim, dim, p->bf16);
        for (int64_t g = 0; g < per_kv; ++g)
            to_float(p->q, ((row * p->heads) + head * per_kv + g) * dim, dim, p->bf16, queries + (m * per_kv + g) * dim);
        if (first_seen(p, row) > 0) shared = 0; /* a window cuts into the prefix: row by row */
    }
    if (members == 1) shared = 0;
    const int64_t leader = (rows[0] * p->kv_heads + head) * cap; /* its slot's first position, in vectors */
    if (shared > 0) score(p, queries, queries_n, leader, shared, keys, scores, cap);
    for (int64_t m = 0; m < members; ++m) {
        const int64_t row = rows[m], slot = (row * p->kv_heads + head) * cap, start = shared > 0 ? shared : first_seen(p, row);
        score(p, queries + m * per_kv * dim, per_kv, slot + start, p->lengths[row] + 1 - start, keys,
              scores + m * per_kv * cap + (shared > 0 ? shared : 0), cap);
    }
    float inverse[queries_n];
    for (int64_t m = 0; m < members; ++m) {
        const int64_t row = rows[m], seen = p->lengths[row] + 1 - (shared > 0 ? 0 : first_seen(p, row));
        for (int64_t g = 0; g < per_kv; ++g) {
            const int64_t query = m * per_kv + g;
            inverse[query] = 1.0f / exp_shifted(scores + query * cap, seen);
        }
    }
    memset(outs, 0, (size_t)(queries_n * dim) * 4);
    if (shared > 0) weigh(p, scores, queries_n, leader, shared, outs, cap);
    for (int64_t m = 0; m < members; ++m) {
        const int64_t row = rows[m], slot = (row * p->kv_heads + head) * cap, start = shared > 0 ? shared : first_seen(p, row);
        weigh(p, scores + m * per_kv * cap + (shared > 0 ? shared : 0), per_kv, slot + start,
              p->lengths[row] + 1 - start, outs + m * per_kv * dim, cap);
    }
    for (int64_t m = 0; m < members; ++m) {
        for (int64_t g = 0; g < per_kv; ++g) {
            const int64_t query = m * per_kv + g, at = ((rows[m] * p->heads) + head * per_kv + g) * dim;
            for (int64_t c = 0; c < dim; ++c) {
                const float value = outs[query * dim + c] * inverse[query];
                if (p->bf16) ((uint16_t *)p->out)[at + c] = float_to_bf16(value);
                else ((float *)p->out)[at + c] = value;
            }
        }
    }
}

/* The (group, key/value head) pairs begin .. end. */
static void run(const void *problem, int64_t begin, int64_t end) {
    Problem *p = (Problem *)problem;
    const int64_t queries = p->widest * (p->heads / p->kv_heads);
    float *scratch = malloc((size_t)(2 * queries * p->dim + BLOCK * p->dim + queries * p->capacity) * 4);
    if (scratch == NULL) {
        atomic_store(&p->failed, 1);
        return;
    }
    for (int64_t pair = begin; pair < end; ++pair) attend(p, pair, scratch);
    free(scratch);
}

/* Returns 0, or -1 when scratch memory could not be had (nothing is then known to be computed). */
int decode_attention(const void *q, const void *k_new, const void *v_new, void *k_cache, void *v_cache,
                     const int64_t *lengths, const int64_t *order, const int64_t *starts, const int64_t *prefix,
                     void *out, int64_t rows, int64_t groups, int64_t heads, int64_t kv_heads, int64_t dim,
                     int64_t capacity, int64_t window, float scale, float softcap, int bf16, int threads) {
    int64_t widest = 1;
    for (int64_t g = 0; g < groups; ++g) widest = starts[g + 1] - starts[g] > widest ? starts[g + 1] - starts[g] : widest;
    Problem p = {q, k_new, v_new, k_cache, v_cache, out, lengths, order, starts, prefix, rows, heads, kv_heads,
                 dim, capacity, window, groups, widest, scale, softcap, bf16, 0};
    const int64_t pairs = groups * kv_heads;
    split_columns(run, &p, pairs, 1, threads);
    return atomic_load(&p.failed) ? -1 : 0;
}
