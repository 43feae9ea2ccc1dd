/* What the embedded generator's C kernels share: a float32 vector of LANES lanes (16 where the build targets
 * AVX-512 F and DQ, else 8: AVX2 + FMA) with its arithmetic, and bf16 <-> float32 conversions (bf16 is float32's upper
 * half; float32 -> bf16 rounds to nearest, ties to even, as torch does). Included by decode_attention.c and
 * layer_ops.c; native_build.py hashes it with them.
 */
#ifndef LIGHTNING_GRPO_SIMD_H
#define LIGHTNING_GRPO_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define LANES 16
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vloadu _mm512_loadu_ps
#define vstoreu _mm512_storeu_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vmax _mm512_max_ps
#define vmin _mm512_min_ps
#define vdiv _mm512_div_ps
#define vsqrt _mm512_sqrt_ps
#define vfmadd _mm512_fmadd_ps
#define vround(x) _mm512_roundscale_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vfloor(x) _mm512_roundscale_ps((x), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
/* v where x >= limit, else 0 (a NaN x keeps v). */
#define vzero_below(v, x, limit) _mm512_mask_mov_ps((v), _mm512_cmp_ps_mask((x), (limit), _CMP_LT_OQ), vzero())
#define vpow2(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
/* 16 bf16 values from h, widened to float32 (a bf16 is a float32's upper half). */
static inline vec widen(const uint16_t *h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16));
}
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
static inline float vpeak(vec a) { return _mm512_reduce_max_ps(a); }
/* The lower and upper 8 lanes added: a block's 8 sums in 8 lanes. */
static inline __m256 fold(vec a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); }
/* Each lane rounded to bf16 (to nearest, ties to even; a NaN stays a NaN), as a float32 whose lower half is 0. */
static inline vec bf16_round(vec v) {
    const __m512i bits = _mm512_castps_si512(v), upper = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), upper);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_and_si512(bits, upper), _mm512_set1_epi32(0x400000)));
    return _mm512_castsi512_ps(rounded);
}
/* 16 floats rounded to bf16 and stored at h. */
static inline void narrow(uint16_t *h, vec v) {
    const __m512i upper = _mm512_srli_epi32(_mm512_castps_si512(bf16_round(v)), 16);
    _mm256_storeu_si256((__m256i *)h, _mm512_cvtepi32_epi16(upper));
}
#else
#define LANES 8
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vloadu _mm256_loadu_ps
#define vstoreu _mm256_storeu_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vmax _mm256_max_ps
#define vmin _mm256_min_ps
#define vdiv _mm256_div_ps
#define vsqrt _mm256_sqrt_ps
#define vfmadd _mm256_fmadd_ps
#define vround(x) _mm256_round_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vfloor(x) _mm256_floor_ps(x)
#define vzero_below(v, x, limit) _mm256_andnot_ps(_mm256_cmp_ps((x), (limit), _CMP_LT_OQ), (v))
#define vpow2(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
static inline vec widen(const uint16_t *h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
}
static inline float vsum(vec a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float vpeak(vec a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline __m256 fold(vec a) { return a; }
static inline vec bf16_round(vec v) {
    const __m256i bits = _mm256_castps_si256(v), upper = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), upper);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(_mm256_and_si256(bits, upper), _mm256_set1_epi32(0x400000)), nan);
    return _mm256_castsi256_ps(rounded);
}
static inline void narrow(uint16_t *h, vec v) {
    const __m256i upper = _mm256_srli_epi32(_mm256_castps_si256(bf16_round(v)), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(upper, upper), 0xD8);
    _mm_storeu_si128((__m128i *)h, _mm256_castsi256_si128(packed));
}
#endif

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* LANES values at `index` of a bf16 or float32 array, as float32. */
static inline vec load_vec(const void *src, int64_t index, int bf16) {
    return bf16 ? widen((const uint16_t *)src + index) : vloadu((const float *)src + index);
}

/* LANES float32 values stored at `index` of a bf16 (rounded as torch rounds) or float32 array. */
static inline void store_vec(void *dst, int64_t index, vec v, int bf16) {
    if (bf16) narrow((uint16_t *)dst + index, v);
    else vstoreu((float *)dst + index, v);
}

/* A value rounded to the array's dtype and read back: what torch holds after an operation in that dtype. */
static inline vec round_to(vec v, int bf16) { return bf16 ? bf16_round(v) : v; }

static inline float load1(const void *src, int64_t index, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)src)[index]) : ((const float *)src)[index];
}

/* exp(x) lane by lane, Cephes' polynomial: relative error ~2e-7. Above log(FLT_MAX) it is infinity, as expf's; below
   -87.3 (where expf's results are subnormal) it is 0, and exp(-inf) = 0. */
static inline vec vexp(vec x) {
    const vec tiny = vset1(-87.3f), original = x;
    x = vmin(vmax(x, tiny), vset1(88.8f));
    vec n = vround(vmul(x, vset1(1.44269504088896341f)));
    x = vsub(x, vmul(n, vset1(0.693359375f)));
    x = vsub(x, vmul(n, vset1(-2.12194440e-4f)));
    vec y = vset1(1.9875691500e-4f);
    y = vfmadd(y, x, vset1(1.3981999507e-3f));
    y = vfmadd(y, x, vset1(8.3334519073e-3f));
    y = vfmadd(y, x, vset1(4.1665795894e-2f));
    y = vfmadd(y, x, vset1(1.6666665459e-1f));
    y = vfmadd(y, x, vset1(5.0000001201e-1f));
    y = vfmadd(y, vmul(x, x), vadd(x, vset1(1.0f)));
    const vec half = vfloor(vmul(n, vset1(0.5f))); /* 2^n in two factors: n = 128 overflows only if the result does */
    return vzero_below(vmul(vmul(y, vpow2(half)), vpow2(vsub(n, half))), original, tiny);
}

#endif
