/* Each row's label log-probability under softmax(logits / temperature), the row's entropy and log-normaliser
 * (forward), and the gradient of the label log-probabilities with respect to the logits (backward):
 * selected_logprobs.py's arithmetic, two passes over a row forward and one backward, float32 or bfloat16 logits.
 *
 * Forward, per row: the largest score (the largest logit divided by the temperature: division by a positive number
 * rounds monotonically); then exp(score - peak) summed (Z) and weighted by (score - peak) (W), a minus-infinite
 * score counting in neither; log-normaliser peak + log Z, label log-probability score[label] - log-normaliser,
 * entropy log Z - W / Z. Backward, per row: (onehot(label) - exp(score - log-normaliser)) * grad / temperature,
 * rounded to the output's dtype (bf16 as torch rounds). Scores are logits divided by the temperature in float32,
 * as torch's `div_` divides; exp is simd.h's.
 *
 * Rows are shared between threads (split_threads.h). Built by native_build.py; see selected_logprobs.py.
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"
#include "split_threads.h"

typedef struct {
    const void *logits;
    int64_t vocab, stride; /* logits of row r start at r * stride */
    int bf16;              /* logits (and the backward's output) are bf16, else float32 */
    float temperature;
    const int64_t *labels;
    float *logprobs, *entropy, *log_norm; /* forward's outputs; the backward reads log_norm */
    const float *grad;                    /* backward: d loss / d logprob of each row */
    void *out;                            /* backward: (rows, vocab) contiguous, the logits' dtype */
} Rows;

static inline vec score_vec(const Rows *p, int64_t index, vec temperature) {
    const vec x = load_vec(p->logits, index, p->bf16);
    return p->temperature != 1.0f ? vdiv(x, temperature) : x;
}

static inline float score1(const Rows *p, int64_t index) {
    const float x = load1(p->logits, index, p->bf16);
    return p->temperature != 1.0f ? x / p->temperature : x;
}

static float row_peak(const Rows *p, int64_t from) {
    vec most = vset1(-INFINITY);
    int64_t j = 0;
    for (; j + LANES <= p->vocab; j += LANES) most = vmax(most, load_vec(p->logits, from + j, p->bf16));
    float peak = vpeak(most);
    for (; j < p->vocab; ++j) peak = fmaxf(peak, load1(p->logits, from + j, p->bf16));
    return p->temperature != 1.0f ? peak / p->temperature : peak;
}

static void forward_rows(const void *problem, int64_t begin, int64_t end) {
    const Rows *p = problem;
    const vec temperature = vset1(p->temperature), tiny = vset1(-87.3f);
    for (int64_t r = begin; r < end; ++r) {
        const int64_t from = r * p->stride;
        const float peak = row_peak(p, from);
        const vec shift = vset1(peak);
        vec total = vzero(), weighted = vzero();
        int64_t j = 0;
        for (; j + LANES <= p->vocab; j += LANES) {
            const vec d = vsub(score_vec(p, from + j, temperature), shift), e = vexp(d);
            total = vadd(total, e);
            /* a score below vexp's cut-off has weight 0: its term is 0, not 0 * -inf */
            weighted = vadd(weighted, vzero_below(vmul(e, d), d, tiny));
        }
        float z = vsum(total), w = vsum(weighted);
        for (; j < p->vocab; ++j) {
            const float d = score1(p, from + j) - peak;
            if (d >= -87.3f) {
                const float e = expf(d);
                z += e;
                w += e * d;
            }
        }
        const float log_z = logf(z);
        p->log_norm[r] = peak + log_z;
        p->logprobs[r] = score1(p, from + p->labels[r]) - p->log_norm[r];
        p->entropy[r] = log_z - w / z;
    }
}

static void backward_rows(const void *problem, int64_t begin, int64_t end) {
    const Rows *p = problem;
    const vec temperature = vset1(p->temperature);
    const int scaled = p->temperature != 1.0f;
    for (int64_t r = begin; r < end; ++r) {
        const int64_t from = r * p->stride, to = r * p->vocab;
        const float g = p->grad[r], lse = p->log_norm[r];
        const vec minus_g = vset1(-g), shift = vset1(lse);
        int64_t j = 0;
        for (; j + LANES <= p->vocab; j += LANES) {
            vec v = vmul(vexp(vsub(score_vec(p, from + j, temperature), shift)), minus_g);
            store_vec(p->out, to + j, scaled ? vdiv(v, temperature) : v, p->bf16);
        }
        for (; j < p->vocab; ++j) {
            const float d = score1(p, from + j) - lse, v = (d < -87.3f ? 0.0f : expf(d)) * -g;
            const float value = scaled ? v / p->temperature : v;
            if (p->bf16) ((uint16_t *)p->out)[to + j] = float_to_bf16(value);
            else ((float *)p->out)[to + j] = value;
        }
        const int64_t label = p->labels[r];
        const float d = score1(p, from + label) - lse;
        const float v = (d < -87.3f ? 0.0f : expf(d)) * -g + g;
        const float value = scaled ? v / p->temperature : v;
        if (p->bf16) ((uint16_t *)p->out)[to + label] = float_to_bf16(value);
        else ((float *)p->out)[to + label] = value;
    }
}

/* logprobs, entropy and log_norm (each `rows` float32) of `rows` rows of `vocab` logits, rows `stride` values
   apart, labels in [0, vocab) (the caller checks them). Returns 0. */
int logprob_rows_forward(const void *logits, int64_t rows, int64_t vocab, int64_t stride, int bf16, float temperature,
                         const int64_t *labels, float *logprobs, float *entropy, float *log_norm, int threads) {
    const Rows problem = {logits, vocab, stride, bf16, temperature, labels, logprobs, entropy, log_norm, 0, 0};
    split_columns(forward_rows, &problem, rows, 1, threads);
    return 0;
}

/* out (rows, vocab) contiguous, the logits' dtype: the gradient of sum(grad * logprobs) with respect to the logits,
   from the forward's log_norm. Returns 0. */
int logprob_rows_backward(const void *logits, int64_t rows, int64_t vocab, int64_t stride, int bf16, float temperature,
                          const int64_t *labels, const float *log_norm, const float *grad, void *out, int threads) {
    const Rows problem = {logits, vocab, stride, bf16, temperature, labels, 0, 0, (float *)log_norm, grad, out};
    split_columns(backward_rows, &problem, rows, 1, threads);
    return 0;
}
