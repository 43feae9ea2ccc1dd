/* The small operations between a decode step's products, each fused into one pass (float32 or bfloat16 tensors):
 * the RMS norm of Llama-like models and the rotation of queries and keys by half their head dim.
 *
 * Each computes in float32 and rounds to the tensors' dtype wherever torch's sequence of operations would (bf16: to
 * nearest, ties to even), so a result differs from torch's only where a float32 sum is added up in another order.
 * Rows may be strided (a view of a wider product's output); the last dimension is contiguous.
 *
 * Built by native_build.py with the system's C compiler; see layer_ops.py.
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"

/* out[r] = round(weight * round(x[r] / sqrt(mean(x[r]^2) + eps))) for each of `rows` rows of `width` values: the
   `weight * hidden.to(input_dtype)` of Llama's RMSNorm, its mean a product with 1 / width as torch's is. */
int rms_norm(const void *x, int64_t x_stride, const void *weight, void *out, int64_t rows, int64_t width, float eps,
             int bf16) {
    const float inverse_width = 1.0f / (float)width;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t from = r * x_stride, to = r * width;
        vec squares = vzero();
        int64_t c = 0;
        for (; c + LANES <= width; c += LANES) {
            const vec v = load_vec(x, from + c, bf16);
            squares = vfmadd(v, v, squares);
        }
        float sum = vsum(squares);
        for (; c < width; ++c) sum += load1(x, from + c, bf16) * load1(x, from + c, bf16);
        const float scale = 1.0f / sqrtf(sum * inverse_width + eps);
        const vec scales = vset1(scale);
        for (c = 0; c + LANES <= width; c += LANES) {
            const vec normed = round_to(vmul(load_vec(x, from + c, bf16), scales), bf16);
            store_vec(out, to + c, vmul(load_vec(weight, c, bf16), normed), bf16);
        }
        for (; c < width; ++c) {
            float normed = load1(x, from + c, bf16) * scale;
            if (bf16) normed = bf16_to_float(float_to_bf16(normed));
            const float value = load1(weight, c, bf16) * normed;
            if (bf16) ((uint16_t *)out)[to + c] = float_to_bf16(value);
            else ((float *)out)[to + c] = value;
        }
    }
    return 0;
}

static inline float round1(float value, int bf16) { return bf16 ? bf16_to_float(float_to_bf16(value)) : value; }

static inline void store1(void *dst, int64_t index, float value, int bf16) {
    if (bf16) ((uint16_t *)dst)[index] = float_to_bf16(value);
    else ((float *)dst)[index] = value;
}

/* One head's vector rotated: out = round(round(x * cos) + round(rotate_half(x) * sin)), rotate_half(x) being
   (-x2, x1) for x's halves x1, x2. */
static void rotate_head(const void *x, int64_t from, const void *cos, const void *sin, int64_t at, void *out,
                        int64_t to, int64_t dim, int bf16) {
    const int64_t half = dim / 2;
    int64_t i = 0;
    for (; i + LANES <= half; i += LANES) {
        const vec x1 = load_vec(x, from + i, bf16), x2 = load_vec(x, from + half + i, bf16);
        const vec low = vsub(round_to(vmul(x1, load_vec(cos, at + i, bf16)), bf16),
                             round_to(vmul(x2, load_vec(sin, at + i, bf16)), bf16));
        const vec high = vadd(round_to(vmul(x2, load_vec(cos, at + half + i, bf16)), bf16),
                              round_to(vmul(x1, load_vec(sin, at + half + i, bf16)), bf16));
        store_vec(out, to + i, low, bf16);
        store_vec(out, to + half + i, high, bf16);
    }
    for (; i < half; ++i) {
        const float x1 = load1(x, from + i, bf16), x2 = load1(x, from + half + i, bf16);
        store1(out, to + i,
               round1(x1 * load1(cos, at + i, bf16), bf16) - round1(x2 * load1(sin, at + i, bf16), bf16), bf16);
        store1(out, to + half + i,
               round1(x2 * load1(cos, at + half + i, bf16), bf16) + round1(x1 * load1(sin, at + half + i, bf16), bf16),
               bf16);
    }
}

/* q_out (rows, heads, dim) and k_out (rows, kv_heads, dim), contiguous: each row's query and key heads (rows
   `q_stride` and `k_stride` values apart, heads `dim` apart) rotated by its row of cos and sin (rows, dim). */
int rotate(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *cos, const void *sin,
           void *q_out, void *k_out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int bf16) {
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = 0; h < heads; ++h)
            rotate_head(q, r * q_stride + h * dim, cos, sin, r * dim, q_out, (r * heads + h) * dim, dim, bf16);
        for (int64_t h = 0; h < kv_heads; ++h)
            rotate_head(k, r * k_stride + h * dim, cos, sin, r * dim, k_out, (r * kv_heads + h) * dim, dim, bf16);
    }
    return 0;
}
