/*
 * A float vector of VW lanes for the tiled kernels: AVX-512 (16), AVX2 with FMA (8), or a
 * plain float (1) where neither is compiled in (-march=native decides). Every kernel that
 * includes it is written once over vf and runs at each width unchanged.
 *
 * v_exp2 takes x <= 64 (softmax arguments after a running max is subtracted: <= 0, or a few
 * units above where the max is let trail, tiled_attention.h) and is accurate to ~2 ulp; below
 * -126 it returns ~2^-126, which no float32 sum of weights >= 1 can see. v_exp2_coarse takes
 * the same range to ~8e-5, for weights that are rounded to bfloat16 next.
 */
#ifndef RADIXSERVE_VEC_H
#define RADIXSERVE_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
typedef __m512 vf;
static inline vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf v_set1(float x) { return _mm512_set1_ps(x); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float v_hmax(vf x) { return _mm512_reduce_max_ps(x); }
static inline float v_first(vf x) { return _mm512_cvtss_f32(x); }
static inline float v_hsum(vf x) { return _mm512_reduce_add_ps(x); }
static inline int v_any_above(vf x, float y) { return _mm512_cmp_ps_mask(x, _mm512_set1_ps(y), _CMP_GT_OQ) != 0; }
static inline vf v_round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf v_ldexp(vf p, vf n) { return _mm512_scalef_ps(p, n); }
static inline __mmask16 v_mask(int64_t count) {
    return count >= 16 ? (__mmask16)0xFFFF : count <= 0 ? 0 : (__mmask16)((1u << count) - 1);
}
/* x in its first `count` lanes, `fill` in the others. */
static inline vf v_keep(vf x, int64_t count, float fill) { return _mm512_mask_blend_ps(v_mask(count), _mm512_set1_ps(fill), x); }
/* The first `count` floats at p, zeros in the other lanes (nothing past them is read). */
static inline vf v_load_n(const float *p, int64_t count) { return _mm512_maskz_loadu_ps(v_mask(count), p); }
/* VW int8 codes as floats. */
static inline vf v_load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* Lane i = the sum of r[i]'s lanes: pairs within 128-bit lanes, then the 128-bit lanes. */
static inline vf v_sums(const vf r[VW]) {
    vf t[8], u[4];
    for (int i = 0; i < 8; ++i)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]), _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    const vf w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    const vf w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}
/* r[i] lane j <-> r[j] lane i: two in-lane stages, then two across 128-bit lanes. */
static inline void v_transpose(vf r[VW]) {
    vf a[16], b[16];
    for (int i = 0; i < 16; i += 2)
        a[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), a[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        b[i] = _mm512_shuffle_ps(a[i], a[i + 2], 0x44), b[i + 1] = _mm512_shuffle_ps(a[i], a[i + 2], 0xEE);
        b[i + 2] = _mm512_shuffle_ps(a[i + 1], a[i + 3], 0x44), b[i + 3] = _mm512_shuffle_ps(a[i + 1], a[i + 3], 0xEE);
    }
    for (int j = 0; j < 4; ++j) {
        const vf c_lo = _mm512_shuffle_f32x4(b[j], b[4 + j], 0x44), c_hi = _mm512_shuffle_f32x4(b[j], b[4 + j], 0xEE);
        const vf d_lo = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0x44);
        const vf d_hi = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0xEE);
        r[j] = _mm512_shuffle_f32x4(c_lo, d_lo, 0x88), r[4 + j] = _mm512_shuffle_f32x4(c_lo, d_lo, 0xDD);
        r[8 + j] = _mm512_shuffle_f32x4(c_hi, d_hi, 0x88), r[12 + j] = _mm512_shuffle_f32x4(c_hi, d_hi, 0xDD);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VW 8
typedef __m256 vf;
static inline vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf v_set1(float x) { return _mm256_set1_ps(x); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float v_first(vf x) { return _mm256_cvtss_f32(x); }
static inline float v_hmax(vf x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline float v_hsum(vf x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline int v_any_above(vf x, float y) { return _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(y), _CMP_GT_OQ)) != 0; }
static inline vf v_round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* p * 2^n for integral n in [-126, 127]: n goes straight into the exponent bits. */
static inline vf v_ldexp(vf p, vf n) {
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
static inline vf v_keep(vf x, int64_t count, float fill) {
    const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_cmp_ps(lanes, _mm256_set1_ps((float)count), _CMP_LT_OQ);
    return _mm256_blendv_ps(_mm256_set1_ps(fill), x, keep);
}
static inline vf v_load_n(const float *p, int64_t count) {
    if (count >= 8) return _mm256_loadu_ps(p);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), lanes));
}
static inline vf v_load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf v_sums(const vf r[VW]) {
    const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(r[0], r[1]), _mm256_hadd_ps(r[2], r[3]));
    const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(r[4], r[5]), _mm256_hadd_ps(r[6], r[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}
static inline void v_transpose(vf r[VW]) {
    vf a[8], b[8];
    for (int i = 0; i < 8; i += 2)
        a[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), a[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        b[i] = _mm256_shuffle_ps(a[i], a[i + 2], 0x44), b[i + 1] = _mm256_shuffle_ps(a[i], a[i + 2], 0xEE);
        b[i + 2] = _mm256_shuffle_ps(a[i + 1], a[i + 3], 0x44), b[i + 3] = _mm256_shuffle_ps(a[i + 1], a[i + 3], 0xEE);
    }
    for (int j = 0; j < 4; ++j)
        r[j] = _mm256_permute2f128_ps(b[j], b[4 + j], 0x20), r[4 + j] = _mm256_permute2f128_ps(b[j], b[4 + j], 0x31);
}
#else
#define VW 1
typedef float vf;
static inline vf v_load(const float *p) { return *p; }
static inline void v_store(float *p, vf x) { *p = x; }
static inline vf v_set1(float x) { return x; }
static inline vf v_add(vf a, vf b) { return a + b; }
static inline vf v_sub(vf a, vf b) { return a - b; }
static inline vf v_mul(vf a, vf b) { return a * b; }
static inline vf v_max(vf a, vf b) { return a > b ? a : b; }
static inline vf v_fma(vf a, vf b, vf c) { return a * b + c; }
static inline float v_hmax(vf x) { return x; }
static inline float v_first(vf x) { return x; }
static inline float v_hsum(vf x) { return x; }
static inline int v_any_above(vf x, float y) { return x > y; }
static inline vf v_round(vf x) { return nearbyintf(x); }
static inline vf v_ldexp(vf p, vf n) { return ldexpf(p, (int)n); }
static inline vf v_keep(vf x, int64_t count, float fill) { return count >= 1 ? x : fill; }
static inline vf v_load_n(const float *p, int64_t count) { return count >= 1 ? *p : 0.0f; }
static inline vf v_load_i8(const int8_t *p) { return (float)*p; }
static inline vf v_sums(const vf r[VW]) { return r[0]; }
static inline void v_transpose(vf r[VW]) { (void)r; }
#endif

/* Ask for p's cache line into L2. An asm statement: GCC drops a __builtin_prefetch whose
 * function it finds has no other effect (a block's prefetches vanished from decode that way). */
static inline void v_prefetch(const void *p) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)p));
#else
    __builtin_prefetch(p, 0, 2);
#endif
}

/* x with its first `count` lanes (none for count <= 0) replaced by `fill`: the keys of a
 * sliding window's first group that lie before the window. */
static inline vf v_drop(vf x, int64_t count, float fill) {
    if (count <= 0) return x;
    float lanes[VW];
    v_store(lanes, x);
    for (int64_t t = 0; t < count && t < VW; ++t) lanes[t] = fill;
    return v_load(lanes);
}

/* The first `count` (< VW) int8 codes at p as floats, zeros in the other lanes. */
static inline vf v_load_i8_n(const int8_t *p, int64_t count) {
    int8_t codes[VW] = {0};
    memcpy(codes, p, (size_t)count);
    return v_load_i8(codes);
}

/* 2^x for x <= 64: 2^round(x) times the polynomial c[0] r^degree + ... + c[degree] of
 * r = x - round(x), |r| <= 1/2 (c is a constant array: the loop unrolls into FMAs). */
static inline vf v_exp2_poly(vf x, const float *c, int degree) {
    x = v_max(x, v_set1(-126.0f));
    const vf n = v_round(x), r = v_sub(x, n);
    vf p = v_set1(c[0]);
    for (int i = 1; i <= degree; ++i) p = v_fma(p, r, v_set1(c[i]));
    return v_ldexp(p, n);
}

/* 2^x to ~2 ulp: a degree-6 Taylor polynomial of 2^r. */
static inline vf v_exp2(vf x) {
    static const float c[] = {1.5403530393381606e-4f, 1.3333558146428443e-3f, 9.6181291076284772e-3f,
                              5.5504108664821580e-2f, 2.4022650695910071e-1f, 6.9314718055994531e-1f, 1.0f};
    return v_exp2_poly(x, c, 6);
}

/* 2^x to ~8e-5 relative, for weights rounded to bfloat16 next (2^-9): a degree-3 fit of 2^r
 * (least squares in relative error at Chebyshev nodes). */
static inline vf v_exp2_coarse(vf x) {
    static const float c[] = {5.508868380751114e-2f, 2.4260405145947936e-1f, 6.932762416819607e-1f,
                              9.999289403695112e-1f};
    return v_exp2_poly(x, c, 3);
}

#endif
