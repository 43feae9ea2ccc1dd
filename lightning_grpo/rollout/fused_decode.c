/* A decode step's decoder layers in one call: for each layer, the pre-attention RMS norm, the stacked q/k/v product,
 * the rotation, the attention over the slot cache, the output product and its residual add, the pre-MLP RMS norm,
 * the stacked gate/up product, SiLU(gate) * up, the down product and its residual add (a Llama-like layer).
 *
 * The norms, the rotation, the attention and the products are the kernels the decoder runs one by one (layer_ops.c,
 * decode_attention.c, tile_matmul.c), passed in as function pointers and called with the same arguments in the same
 * order, so each gives the same result it gives there; what this adds is the elementwise steps between them, each
 * rounded to bf16 where torch's bf16 operations round: SiLU of the gate (float32 math, exp within ~2e-7 of torch's),
 * its product with up, and the residual sums. The hidden states are updated in place.
 *
 * Built by native_build.py with the system's C compiler; see fused_decode.py.
 */
#include <stdint.h>
#include <string.h>

#include "simd.h"

typedef int (*TileLinear)(const uint16_t *, const uint16_t *, const float *, uint16_t *, int64_t, int64_t, int64_t,
                          int);
typedef int (*TileLinearInt8)(const uint16_t *, const int8_t *, const float *, const float *, uint16_t *, int64_t,
                              int64_t, int64_t, int);
typedef int (*Attend)(const void *, const void *, const void *, void *, void *, const int64_t *, const int64_t *,
                      const int64_t *, const int64_t *, void *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                      int64_t, float, float, int, int);
typedef int (*RmsNorm)(const void *, int64_t, const void *, void *, int64_t, int64_t, float, int);
typedef int (*Rotate)(const void *, int64_t, const void *, int64_t, const void *, const void *, void *, void *, int64_t,
                      int64_t, int64_t, int64_t, int);

typedef struct {
    TileLinear linear;
    TileLinearInt8 linear_int8;
    Attend attend;
    RmsNorm norm;
    Rotate rotate;
} Kernels;

/* A packed weight (tile_matmul's TileWeight): scale is NULL for bf16 tiles, the per-column scales for int8 ones;
 * split: whether the product runs on the step's threads (else on one). */
typedef struct {
    const void *tiles;
    const float *bias, *scale;
    int64_t out_features, in_features, split;
} Product;

typedef struct {
    const void *pre_attention, *pre_mlp; /* the norms' weights (bf16, hidden) */
    double pre_attention_eps, pre_mlp_eps;
    Product qkv, o, gate_up, down;
    void *keys, *values; /* the layer's caches (slots, kv_heads, capacity, dim) */
} Layer;

/* The step: its rows and shapes, the attention's inputs (as decode_attention.attend takes them), the rotation's cos
 * and sin (rows, dim) and scratch tensors of bf16: x (rows, hidden), qkv (rows, qkv width), q (rows, heads, dim),
 * k and v (rows, kv_heads, dim), attended (rows, heads, dim), branch (rows, hidden), gate_up (rows, 2 x
 * intermediate), act (rows, intermediate). */
typedef struct {
    int64_t rows, hidden, heads, kv_heads, dim, capacity, intermediate, groups, threads, attention_threads;
    double scale;
    const int64_t *lengths, *order, *starts, *prefix;
    const void *cos, *sin;
    void *x, *qkv, *q, *k, *v, *attended, *branch, *gate_up, *act;
} Step;

static int product(const Kernels *kernels, const Product *p, const Step *s, const void *x, void *out) {
    const int threads = p->split ? (int)s->threads : 1;
    if (p->scale)
        return kernels->linear_int8(x, p->tiles, p->scale, p->bias, out, s->rows, p->out_features, p->in_features,
                                    threads) < 0;
    kernels->linear(x, p->tiles, p->bias, out, s->rows, p->out_features, p->in_features, threads);
    return 0;
}

/* hidden += branch, each sum rounded to bf16 (torch's bf16 add). */
static void add_into(uint16_t *hidden, const uint16_t *branch, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) store_vec(hidden, i, vadd(load_vec(hidden, i, 1), load_vec(branch, i, 1)), 1);
    for (; i < n; ++i) hidden[i] = float_to_bf16(bf16_to_float(hidden[i]) + bf16_to_float(branch[i]));
}

/* act[r] = round(round(silu(gate[r])) * up[r]) for rows of gate_up = (gate, up), each `width` wide: torch's bf16
 * `act_fn(gate) * up`. */
static void silu_times_up(const uint16_t *gate_up, uint16_t *act, int64_t rows, int64_t width) {
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *gate = gate_up + r * 2 * width, *up = gate + width;
        uint16_t *out = act + r * width;
        int64_t i = 0;
        for (; i + LANES <= width; i += LANES) {
            const vec g = load_vec(gate, i, 1);
            const vec silu = bf16_round(vdiv(g, vadd(vset1(1.0f), vexp(vsub(vzero(), g)))));
            store_vec(out, i, vmul(silu, load_vec(up, i, 1)), 1);
        }
        for (; i < width; ++i) { /* widths are multiples of the tiles' 32; kept for any width */
            const float g = bf16_to_float(gate[i]);
            float e[LANES] = {0};
            e[0] = -g;
            vstoreu(e, vexp(vloadu(e)));
            const float silu = bf16_to_float(float_to_bf16(g / (1.0f + e[0])));
            out[i] = float_to_bf16(silu * bf16_to_float(up[i]));
        }
    }
}

/* The attention branch of one layer: x (normed) -> q, k, v -> rotated -> attended -> branch (the o product). */
static int attention_branch(const Kernels *kernels, const Layer *layer, const Step *s) {
    const int64_t q_width = s->heads * s->dim, kv_width = s->kv_heads * s->dim, qkv_width = layer->qkv.out_features;
    if (product(kernels, &layer->qkv, s, s->x, s->qkv)) return -1;
    const uint16_t *qkv = (const uint16_t *)s->qkv;
    kernels->rotate(qkv, qkv_width, qkv + q_width, qkv_width, s->cos, s->sin, s->q, s->k, s->rows, s->heads,
                    s->kv_heads, s->dim, 1);
    for (int64_t r = 0; r < s->rows; ++r) /* the attention kernel reads contiguous values */
        memcpy((uint16_t *)s->v + r * kv_width, qkv + r * qkv_width + q_width + kv_width, (size_t)kv_width * 2);
    if (kernels->attend(s->q, s->k, s->v, layer->keys, layer->values, s->lengths, s->order, s->starts, s->prefix,
                        s->attended, s->rows, s->groups, s->heads, s->kv_heads, s->dim, s->capacity, 0,
                        (float)s->scale, 0.0f, 1, (int)s->attention_threads))
        return -1;
    return product(kernels, &layer->o, s, s->attended, s->branch);
}

/* Runs `count` layers over hidden (rows, hidden) bf16 in place. Returns 0, or -1 when a kernel could not allocate
 * its scratch memory (hidden is then partly updated). */
int decode_layers(const Kernels *kernels, const Layer *layers, int64_t count, const Step *s, void *hidden) {
    uint16_t *h = (uint16_t *)hidden;
    const int64_t n = s->rows * s->hidden;
    for (int64_t i = 0; i < count; ++i) {
        const Layer *layer = layers + i;
        kernels->norm(h, s->hidden, layer->pre_attention, s->x, s->rows, s->hidden, (float)layer->pre_attention_eps, 1);
        if (attention_branch(kernels, layer, s)) return -1;
        add_into(h, (const uint16_t *)s->branch, n);
        kernels->norm(h, s->hidden, layer->pre_mlp, s->x, s->rows, s->hidden, (float)layer->pre_mlp_eps, 1);
        if (product(kernels, &layer->gate_up, s, s->x, s->gate_up)) return -1;
        silu_times_up((const uint16_t *)s->gate_up, (uint16_t *)s->act, s->rows, s->intermediate);
        if (product(kernels, &layer->down, s, s->act, s->branch)) return -1;
        add_into(h, (const uint16_t *)s->branch, n);
    }
    return 0;
}
