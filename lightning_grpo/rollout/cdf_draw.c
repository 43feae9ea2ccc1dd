/* One token per row drawn from softmax(logits / temperature) by inverting the row's CDF at a uniform number, and
 * its log-probability: sampling.draw's algorithm in two passes over the row (float32 or bfloat16 logits).
 *
 * Per row: the largest logit; then the softmax's numerators exp(x / temperature - max) summed per block of BLOCK
 * entries (the numerators are not stored); the running sum over the blocks (its last value is the row's total);
 * the first block whose running sum passes uniform * total, and in it the first entry whose running sum does. A draw
 * that rounding puts on an entry of weight 0 moves to the nearest earlier entry with weight (else the first one).
 * The log-probability is (x / temperature - max) - log(total). Division by the temperature is a division, as torch's
 * `div_` is, so the scores are torch's to the bit; exp is simd.h's (exp(-inf) = 0: a dropped token is never drawn).
 *
 * Built by native_build.py with the system's C compiler; see cdf_draw.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define BLOCK 256 /* sampling._CDF_BLOCK */

/* LANES scores from `index` on: the logits divided by the temperature (unless it is 1). */
static inline vec scores_at(const void *logits, int64_t index, int bf16, int scaled, vec temperature) {
    const vec x = load_vec(logits, index, bf16);
    return scaled ? vdiv(x, temperature) : x;
}

static inline float score1(const void *logits, int64_t index, int bf16, int scaled, float temperature) {
    const float x = load1(logits, index, bf16);
    return scaled ? x / temperature : x;
}

/* The largest score of a row: the largest logit divided by the temperature (division rounds monotonically). */
static float row_max(const void *logits, int64_t from, int64_t vocab, int bf16, int scaled, float temperature) {
    vec most = vset1(-INFINITY);
    int64_t j = 0;
    for (; j + LANES <= vocab; j += LANES) most = vmax(most, load_vec(logits, from + j, bf16));
    float peak = vpeak(most);
    for (; j < vocab; ++j) peak = fmaxf(peak, load1(logits, from + j, bf16));
    return scaled ? peak / temperature : peak;
}

/* exp(score - peak) for each of `count` (<= BLOCK) scores from `index` on, into weights; returns their sum. */
static float block_weights(const void *logits, int64_t index, int64_t count, int bf16, int scaled, float temperature,
                           float peak, float *weights) {
    const vec t = vset1(temperature), shift = vset1(peak);
    vec total = vzero();
    int64_t j = 0;
    for (; j + LANES <= count; j += LANES) {
        const vec e = vexp(vsub(scores_at(logits, index + j, bf16, scaled, t), shift));
        vstoreu(weights + j, e);
        total = vadd(total, e);
    }
    float sum = vsum(total);
    for (; j < count; ++j) {
        const float x = score1(logits, index + j, bf16, scaled, temperature) - peak;
        weights[j] = x < -87.3f ? 0.0f : expf(x);
        sum += weights[j];
    }
    return sum;
}

/* The last entry at or before `token` with a positive weight, else the first one after it. */
static int64_t nearest_positive(const void *logits, int64_t from, int64_t vocab, int64_t token, int bf16, int scaled,
                                float temperature, float peak) {
    float weight;
    for (int64_t j = token; j >= 0; --j) {
        block_weights(logits, from + j, 1, bf16, scaled, temperature, peak, &weight);
        if (weight > 0) return j;
    }
    for (int64_t j = token + 1; j < vocab; ++j) {
        block_weights(logits, from + j, 1, bf16, scaled, temperature, peak, &weight);
        if (weight > 0) return j;
    }
    return token;
}

static void draw_row(const void *logits, int64_t from, int64_t vocab, int bf16, float temperature, float uniform,
                     float *masses, int64_t *token, float *logprob) {
    const int scaled = temperature != 1.0f;
    const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
    const float peak = row_max(logits, from, vocab, bf16, scaled, temperature);
    float weights[BLOCK], total = 0;
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t count = vocab - b * BLOCK < BLOCK ? vocab - b * BLOCK : BLOCK;
        masses[b] = block_weights(logits, from + b * BLOCK, count, bf16, scaled, temperature, peak, weights);
    }
    for (int64_t b = 0; b < blocks; ++b) total += masses[b]; /* one after another, as torch's cumsum adds them */
    const float target = uniform * total;
    int64_t block = 0;
    float before = 0; /* the mass of the blocks before `block` */
    while (block < blocks - 1 && !(before + masses[block] > target)) before += masses[block++];
    const int64_t start = block * BLOCK, count = vocab - start < BLOCK ? vocab - start : BLOCK;
    block_weights(logits, from + start, count, bf16, scaled, temperature, peak, weights);
    const float inner_target = target - before;
    int64_t offset = count - 1;
    float inner = 0;
    for (int64_t j = 0; j < count; ++j) {
        inner += weights[j];
        if (inner > inner_target) {
            offset = j;
            break;
        }
    }
    int64_t drawn = start + offset;
    if (weights[offset] == 0) drawn = nearest_positive(logits, from, vocab, drawn, bf16, scaled, temperature, peak);
    *token = drawn;
    *logprob = (score1(logits, from + drawn, bf16, scaled, temperature) - peak) - logf(total);
}

/* tokens[r] and logprobs[r] for each of `rows` rows of `vocab` logits (rows `stride` values apart). Returns 0, or -1
   when scratch memory could not be had. */
int cdf_draw(const void *logits, int64_t rows, int64_t vocab, int64_t stride, int bf16, float temperature,
             const float *uniform, int64_t *tokens, float *logprobs) {
    float *masses = malloc((size_t)((vocab + BLOCK - 1) / BLOCK) * sizeof(float));
    if (masses == NULL) return -1;
    for (int64_t r = 0; r < rows; ++r)
        draw_row(logits, r * stride, vocab, bf16, temperature, uniform[r], masses, tokens + r, logprobs + r);
    free(masses);
    return 0;
}
