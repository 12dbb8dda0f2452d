/*
 * The quantized-weight products shared by quant_linear.c (one weight, out = x @ w.T) and
 * moe_experts.c (a mixture of experts' selected experts in one call): the weight and activation
 * types, the activations' rounding into two int8 codes an element, and each path's products
 * (scalar, AVX2, AVX512-VNNI lanes), each over some features and all the rows of a QActs.
 * The layouts, the rounding and the paths are described in quant_linear.c. Threads are the
 * callers' business: nothing here opens a parallel region.
 */
#ifndef RADIXSERVE_QUANT_DOT_H
#define RADIXSERVE_QUANT_DOT_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "reduce.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef struct {
    const uint8_t *codes;  /* [N, K * bits / 8] */
    const void *scale;     /* [N, K / G] float32, or float16 where half */
    const void *offset;    /* [N, K / G] as scale, or NULL: -zero * scale */
    int64_t N, K, bits, group, zero, half;
    int64_t lanes;         /* 1: the lanes layout (features across the vector lanes, below) */
} QWeight;

#define LANES 32 /* features a block of the lanes layout */

/* The activations of one call: per row, int8 codes, each 32-block's dx, and per weight group
 * the sum of the dequantized activations. The AVX2 paths read x16 and dxt, laid out block by
 * block (a block's rows side by side) so that a tile of rows finds them at one address. */
typedef struct {
    int8_t *xq;      /* [M, K] high codes */
    int8_t *xr;      /* [M, K] residual codes, in 1/256ths of dx */
    float *dx;       /* [M, K / 32] */
    float *xsum;     /* [M, K / G] */
    int16_t *x16;    /* [K / 32, ld, 32] 256 xq + xr (|x16| <= 32,639) */
    int64_t M, K, groups;
    float *dxt;      /* [K / 32, ld] dx / 256 */
    int64_t ld;      /* rows between one block's rows and the next block's in x16 and dxt (>= M) */
} QActs;

/* Bytes acts_at takes for M rows of K. */
static size_t acts_bytes(int64_t M, int64_t K, int64_t groups) {
    return (size_t)(4 * M * K) + sizeof(float) * (size_t)(M * (2 * (K / 32) + groups)) + 256;
}

/* Activations for M rows of K in the memory at *p (advanced past them, 64-byte aligned). */
static QActs acts_at(char **p, int64_t M, int64_t K, int64_t group) {
    QActs a = {NULL, NULL, NULL, NULL, NULL, M, K, K / group, NULL, M};
    char *q = (char *)(((uintptr_t)*p + 63) & ~(uintptr_t)63);
    a.xq = (int8_t *)q;
    a.xr = a.xq + M * K;
    a.dx = (float *)(((uintptr_t)(a.xr + M * K) + 63) & ~(uintptr_t)63);
    a.xsum = a.dx + M * (K / 32);
    a.dxt = (float *)(((uintptr_t)(a.xsum + M * a.groups) + 63) & ~(uintptr_t)63);
    a.x16 = (int16_t *)(((uintptr_t)(a.dxt + M * (K / 32)) + 63) & ~(uintptr_t)63);
    *p = (char *)(a.x16 + M * K);
    return a;
}

/* Rows [first, first + count) of a as activations of their own (views, nothing copied). */
static QActs acts_rows(const QActs *a, int64_t first, int64_t count) {
    const int64_t K = a->K;
    const QActs v = {a->xq + first * K, a->xr + first * K, a->dx + first * (K / 32), a->xsum + first * a->groups,
                     a->x16 + first * 32, count, K, a->groups, a->dxt + first, a->ld};
    return v;
}

/* Block b of row r in x16 and dxt. */
static inline const int16_t *x16_at(const QActs *a, int64_t r, int64_t b) { return a->x16 + (b * a->ld + r) * 32; }
static inline float dxt_at(const QActs *a, int64_t r, int64_t b) { return a->dxt[b * a->ld + r]; }

static int weight_valid(const QWeight *w) {
    if (w->K <= 0 || w->N <= 0 || w->K % 64 || (w->bits != 4 && w->bits != 8) || (w->half != 0 && w->half != 1))
        return 0;
    if (w->group == 16 || w->group == 32) return 1;
    return w->group > 0 && w->group % 64 == 0 && w->K % w->group == 0;
}

static inline int64_t row_bytes(const QWeight *w) { return w->K * w->bits / 8; }

/* An IEEE float16 as float32, exactly (every float16 is a float32), without F16C. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        const float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    bits = sign | (exp == 31 ? 0x7F800000u : (exp + 112) << 23) | (man << 13);
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* Element i of a scale or offset array of the weight's dtype. */
static inline float group_value(const QWeight *w, const void *base, int64_t i) {
    return w->half ? half_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* The same in the vector paths: F16C's conversion (the same value). */
static inline float group_value_fast(const QWeight *w, const void *base, int64_t i) {
#if defined(__F16C__) && defined(__AVX2__)
    if (w->half) return _cvtsh_ss(((const uint16_t *)base)[i]);
#endif
    return group_value(w, base, i);
}

/* Row n's groups of a scale or offset array. */
static inline const void *group_row(const QWeight *w, const void *base, int64_t n, int64_t groups) {
    return (const char *)base + n * groups * (w->half ? 2 : 4);
}

/* Code k of feature row `codes` (any layout). */
static inline int code_at(const uint8_t *codes, int64_t k, int64_t bits) {
    if (bits == 8) return codes[k];
    const int64_t chunk = k / 64, j = k % 64;
    const uint8_t byte = codes[chunk * 32 + (j & 31)];
    return j < 32 ? (byte & 15) : (byte >> 4);
}

/* One 32-element block of x into its high and residual codes; returns dx, and each
 * 16 elements' sum of x^ / dx in half[]. */
static inline float quantize_block(const float *x, int8_t *q, int8_t *res, float half[2]) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
    for (int h = 0; h < 2; ++h) {
        const __m512 v = _mm512_mul_ps(h ? x1 : x0, inv); /* |v| <= 127: the conversion rounds to nearest even */
        const __m512i hi = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(v), top), bottom);
        const __m512 hf = _mm512_cvtepi32_ps(hi);
        const __m512i lo = _mm512_max_epi32(
            _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(v, hf), _mm512_set1_ps(256.0f))), top),
            bottom);
        _mm_storeu_si128((__m128i *)(q + 16 * h), _mm512_cvtepi32_epi8(hi));
        _mm_storeu_si128((__m128i *)(res + 16 * h), _mm512_cvtepi32_epi8(lo));
        half[h] = _mm512_reduce_add_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(1.0f / 256.0f), hf));
    }
    return amax / 127.0f;
#else
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    half[0] = half[1] = 0.0f; /* in registers: a sum kept in memory made every element wait on the last store */
    for (int i = 0; i < 32; ++i) {
        const float v = x[i] * inv;
        const int hi = (int)lrintf(v), clamped = hi > 127 ? 127 : hi < -127 ? -127 : hi;
        const int lo = (int)lrintf((v - (float)clamped) * 256.0f), low = lo > 127 ? 127 : lo < -127 ? -127 : lo;
        q[i] = (int8_t)clamped;
        res[i] = (int8_t)low;
        half[i / 16] += (float)clamped + (float)low * (1.0f / 256.0f);
    }
    return amax / 127.0f;
#endif
}

/* Row r of x (at xr) into row r of the activations. */
static void quantize_acts_row(const float *xr, QActs *a, int64_t r, int64_t group) {
    const int64_t K = a->K, blocks = K / 32;
    int8_t *q = a->xq + r * K, *res = a->xr + r * K;
    float *dx = a->dx + r * blocks, *xs = a->xsum + r * a->groups;
    memset(xs, 0, sizeof(float) * a->groups);
    for (int64_t b = 0; b < blocks; ++b) {
        float half[2];
        const float d = dx[b] = quantize_block(xr + 32 * b, q + 32 * b, res + 32 * b, half);
        int16_t *x16 = (int16_t *)x16_at(a, r, b);
        for (int64_t i = 0; i < 32; ++i) x16[i] = (int16_t)(256 * q[32 * b + i] + res[32 * b + i]);
        a->dxt[b * a->ld + r] = d * (1.0f / 256.0f);
        if (group == 16) {
            xs[2 * b] += d * half[0], xs[2 * b + 1] += d * half[1];
        } else {
            xs[32 * b / group] += d * (half[0] + half[1]);
        }
    }
}

/* sum_g offset[g] * xsum[g] of feature n */
static inline float offset_term(const QWeight *w, int64_t n, const float *xsum, int64_t groups) {
    float s = 0.0f;
    if (w->offset) {
        const void *offset = group_row(w, w->offset, n, groups);
        for (int64_t g = 0; g < groups; ++g) s += group_value(w, offset, g) * xsum[g];
        return s;
    }
    const void *scale = group_row(w, w->scale, n, groups);
    for (int64_t g = 0; g < groups; ++g) s += group_value(w, scale, g) * xsum[g];
    return -(float)w->zero * s;
}

/* ---- scalar ------------------------------------------------------------------------ */

static void feature_scalar(const QWeight *w, const QActs *a, int64_t n, float *out, int64_t ldo, const float *bias) {
    const uint8_t *codes = w->codes + n * row_bytes(w);
    const void *scale = group_row(w, w->scale, n, a->groups);
    for (int64_t r = 0; r < a->M; ++r) {
        const int8_t *q = a->xq + r * a->K, *res = a->xr + r * a->K;
        const float *dx = a->dx + r * (a->K / 32);
        const int64_t span = w->group == 16 ? 16 : 32; /* elements one integer dot covers */
        float sum = 0.0f;
        for (int64_t g = 0; g < a->K / span; ++g) {
            int32_t dot = 0;
            for (int64_t i = span * g; i < span * (g + 1); ++i) {
                const int u = code_at(codes, i, w->bits);
                dot += 256 * u * q[i] + u * res[i];
            }
            sum += group_value(w, scale, span * g / w->group) * (dx[span * g / 32] * (1.0f / 256.0f)) * (float)dot;
        }
        out[r * ldo + n] = sum + offset_term(w, n, a->xsum + r * a->groups, a->groups) + (bias ? bias[n] : 0.0f);
    }
}

/* ---- AVX2: codes and activations widened to 16 bits, vpmaddwd ------------------------- */

#if defined(__AVX2__)

/* Every AVX2 product multiplies codes widened to 16 bits by the activations' 16-bit x16 =
 * 256 xq + xr, one vpmaddwd per 16 elements: the same integer as 256 u.xq + u.xr, in half the
 * multiplies of two vpmaddubsw and their vpmaddwd (with the constant group sizes below, 1.5x at
 * one row and at 8 rows on Zen 3). Lane i of a block's int32 sums covers elements 2i,
 * 2i + 1, 16 + 2i and 17 + 2i; every path below forms each feature's sum in that order, so a
 * row's result does not depend on the rows beside it. Up to AVX2_TILE rows share each block's
 * widened codes. */
#define AVX2_TILE 8
/* The codes of the features TILE_PREFETCH x 4 ahead are asked into L2 as a feature streams
 * (0: none). */
#ifndef TILE_PREFETCH
#define TILE_PREFETCH 2
#endif

/* The index of block b's scale among a row's groups (group 16: its first half's). */
static inline int64_t block_group(int64_t b, int64_t group) {
    return group == 32 ? b : group == 16 ? 2 * b : 32 * b / group;
}

/* The four 16-element quarters of a 64-element chunk of 4-bit codes (b even), widened to 16
 * bits: u[0], u[1] block b's first and second half (low nibbles), u[2], u[3] block b + 1's. */
static inline void chunk_codes16(const uint8_t *codes, int64_t b, __m256i u[4]) {
    const __m256i p0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + 16 * b)));
    const __m256i p1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + 16 * b + 16)));
    const __m256i low4 = _mm256_set1_epi16(15);
    u[0] = _mm256_and_si256(p0, low4);
    u[1] = _mm256_and_si256(p1, low4);
    u[2] = _mm256_srli_epi16(p0, 4);
    u[3] = _mm256_srli_epi16(p1, 4);
}

/* One block's sums of 16-bit codes lo (elements 0-15) and hi (16-31) times x16, 8 int32 lanes. */
static inline __m256i block_dot16(__m256i lo, __m256i hi, const int16_t *x) {
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
}

/* acc += dot * scale_dx (a block's scale times its row's dx / 256) */
static inline __m256 block_fma(__m256i dot, float scale_dx, __m256 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale_dx), acc);
}

/* offset_term with F16C's conversion, 8 groups a vector */
static inline float offset_term_avx2(const QWeight *w, int64_t n, const float *xsum, int64_t groups) {
    const void *values = group_row(w, w->offset ? w->offset : w->scale, n, groups);
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
#if defined(__F16C__)
    for (; w->half && g + 8 <= groups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)values + g))),
                              _mm256_loadu_ps(xsum + g), acc);
#endif
    for (; !w->half && g + 8 <= groups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps((const float *)values + g), _mm256_loadu_ps(xsum + g), acc);
    float s = hsum8(acc);
    for (; g < groups; ++g) s += group_value_fast(w, values, g) * xsum[g];
    return w->offset ? s : -(float)w->zero * s;
}

/* The paths below take a weight's group size and scale dtype as arguments, and each caller
 * names the common ones as constants, so that the compiler makes a copy for each without a
 * division or a branch a block (1.6x at one row). */
#define ALWAYS_INLINE inline __attribute__((always_inline))

/* One row's block of 16-bit codes (lo, hi) into its accumulator: one scale for the block, or
 * group 16's two, each over its own half's products. */
static ALWAYS_INLINE __m256 row_block(int64_t group, __m256i lo, __m256i hi, const int16_t *x, float s0, float s1,
                                      float dx, __m256 acc) {
    if (group != 16) return block_fma(block_dot16(lo, hi, x), s0 * dx, acc);
    acc = block_fma(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x)), s0 * dx, acc);
    return block_fma(_mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))), s1 * dx, acc);
}

/* Block b's scales: s[0] for its first 16 elements, s[1] for the next 16 (equal unless group 16). */
static ALWAYS_INLINE float scale_at(const void *scale, int64_t i, int half) {
#if defined(__F16C__)
    if (half) return _cvtsh_ss(((const uint16_t *)scale)[i]);
#endif
    return half ? half_to_float(((const uint16_t *)scale)[i]) : ((const float *)scale)[i];
}

static ALWAYS_INLINE void block_scales(int64_t group, int half, const void *scale, int64_t b, float s[2]) {
    s[0] = scale_at(scale, block_group(b, group), half);
    s[1] = group == 16 ? scale_at(scale, 2 * b + 1, half) : s[0];
}

/* The 16-bit codes of block b of a row of 8-bit codes (less 128 for the signed form, whose
 * products need no offset term). */
static inline __m256i widened_codes(const uint8_t *c, int signed_form) {
    const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)c));
    return signed_form ? _mm256_sub_epi16(u, _mm256_set1_epi16(128)) : u;
}

/* 8-bit codes, feature n against every row of a, AVX2_TILE8 rows at a time, a block's two
 * halves' codes widened as they load (the loop of the day before the 4-bit path's rewrite: the
 * 4-bit path's 8-row tile left a single row's one chain 1.7x slower on a Q8_0 head). */
#define AVX2_TILE8 4

static ALWAYS_INLINE void rows8_avx2(const QWeight *w, const QActs *a, int64_t n, int64_t r0, const int64_t ROWS,
                                     float *out, int64_t ldo, const float *bias) {
    const uint8_t *codes = w->codes + n * row_bytes(w);
    const void *scale = group_row(w, w->scale, n, a->groups);
    const int64_t blocks = a->K / 32;
    const int signed_form = w->zero == 128 && !w->offset;
    __m256 acc[AVX2_TILE8];
#pragma GCC unroll 4
    for (int64_t t = 0; t < ROWS; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const __m256i lo = widened_codes(codes + 32 * b, signed_form), hi = widened_codes(codes + 32 * b + 16, signed_form);
        const float s0 = group_value_fast(w, scale, w->group == 16 ? 2 * b : 32 * b / w->group);
        const float s1 = w->group == 16 ? group_value_fast(w, scale, 2 * b + 1) : s0;
        const int16_t *xb = x16_at(a, r0, b);
        const float *db = a->dxt + b * a->ld + r0;
#pragma GCC unroll 4
        for (int64_t t = 0; t < ROWS; ++t) {
            const int16_t *x = xb + 32 * t;
            const __m256i plo = _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x));
            const __m256i phi = _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16)));
            const float dx = db[t];
            if (w->group == 16) {
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(plo), _mm256_set1_ps(s0 * dx), acc[t]);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(phi), _mm256_set1_ps(s1 * dx), acc[t]);
            } else {
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(plo, phi)), _mm256_set1_ps(s0 * dx), acc[t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int64_t t = 0; t < ROWS; ++t) {
        const int64_t r = r0 + t;
        const float offset = signed_form ? 0.0f : offset_term_avx2(w, n, a->xsum + r * a->groups, a->groups);
        out[r * ldo + n] = hsum8(acc[t]) + offset + (bias ? bias[n] : 0.0f);
    }
}

static void feature8_avx2(const QWeight *w, const QActs *a, int64_t n, float *out, int64_t ldo, const float *bias) {
    int64_t r0 = 0;
    for (; r0 + AVX2_TILE8 <= a->M; r0 += AVX2_TILE8) rows8_avx2(w, a, n, r0, AVX2_TILE8, out, ldo, bias);
    if (r0 + 2 <= a->M) rows8_avx2(w, a, n, r0, 2, out, ldo, bias), r0 += 2;
    if (r0 < a->M) rows8_avx2(w, a, n, r0, 1, out, ldo, bias);
}

/* 4-bit codes, feature n against rows [r0, r0 + ROWS) of a. ROWS is a constant at every call, so
 * the rows' accumulators stay in registers (with a variable count they lived on the stack, and
 * each block's FMA waited on the store of the one before: ~6.5 cycles a row and block). */
static ALWAYS_INLINE void rows_avx2_form(const QWeight *w, const QActs *a, int64_t n, int64_t r0, const int64_t ROWS,
                                         float *out, int64_t ldo, const float *bias, int64_t group, int half) {
    const uint8_t *codes = w->codes + n * row_bytes(w);
    const void *scale = group_row(w, w->scale, n, a->groups);
    const int64_t blocks = a->K / 32;
    __m256 acc[AVX2_TILE];
#pragma GCC unroll 8
    for (int64_t t = 0; t < ROWS; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 2) {
        __m256i u[4];
        if (TILE_PREFETCH && r0 == 0 && (b & 3) == 0)
            _mm_prefetch((const char *)codes + 16 * b + TILE_PREFETCH * 4 * row_bytes(w), _MM_HINT_T1);
        chunk_codes16(codes, b, u);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            float s[2];
            block_scales(group, half, scale, b + h, s);
            const int16_t *xb = x16_at(a, r0, b + h);
            const float *db = a->dxt + (b + h) * a->ld + r0;
#pragma GCC unroll 8
            for (int64_t t = 0; t < ROWS; ++t)
                acc[t] = row_block(group, u[2 * h], u[2 * h + 1], xb + 32 * t, s[0], s[1], db[t], acc[t]);
        }
    }
#pragma GCC unroll 8
    for (int64_t t = 0; t < ROWS; ++t) {
        const int64_t r = r0 + t;
        out[r * ldo + n] = hsum8(acc[t]) + offset_term_avx2(w, n, a->xsum + r * a->groups, a->groups) +
                           (bias ? bias[n] : 0.0f);
    }
}

/* 4-bit codes, feature n against every row of a, AVX2_TILE rows at a time (the rest in tiles of
 * 4, 2 and 1). */
static ALWAYS_INLINE void feature_avx2_form(const QWeight *w, const QActs *a, int64_t n, float *out, int64_t ldo,
                                            const float *bias, int64_t group, int half) {
    int64_t r0 = 0;
    for (; r0 + AVX2_TILE <= a->M; r0 += AVX2_TILE) rows_avx2_form(w, a, n, r0, AVX2_TILE, out, ldo, bias, group, half);
    if (r0 + 4 <= a->M) rows_avx2_form(w, a, n, r0, 4, out, ldo, bias, group, half), r0 += 4;
    if (r0 + 2 <= a->M) rows_avx2_form(w, a, n, r0, 2, out, ldo, bias, group, half), r0 += 2;
    if (r0 < a->M) rows_avx2_form(w, a, n, r0, 1, out, ldo, bias, group, half);
}

/* One activation row (a decode step at batch 1) against FEATURE_TILE features of 4-bit codes: the
 * row's codes and each block's dx are read once for the tile, and the features' sums are
 * independent chains. Each feature's sum is formed exactly as feature_avx2 forms it, so the same floats. */
#define FEATURE_TILE 4

static ALWAYS_INLINE void feature_tile_avx2_form(const QWeight *w, const QActs *a, int64_t n0, float *out,
                                                 const float *bias, int64_t group, int half) {
    const int64_t blocks = a->K / 32;
    const uint8_t *codes[FEATURE_TILE];
    const void *scale[FEATURE_TILE];
    __m256 acc[FEATURE_TILE];
    for (int j = 0; j < FEATURE_TILE; ++j) {
        codes[j] = w->codes + (n0 + j) * row_bytes(w);
        scale[j] = group_row(w, w->scale, n0 + j, a->groups);
        acc[j] = _mm256_setzero_ps();
    }
    const int64_t ahead = TILE_PREFETCH * FEATURE_TILE * row_bytes(w);
    for (int64_t b = 0; b < blocks; b += 2) {
        const float d0 = dxt_at(a, 0, b), d1 = dxt_at(a, 0, b + 1);
        const int16_t *x0 = x16_at(a, 0, b), *x1 = x16_at(a, 0, b + 1);
        for (int j = 0; j < FEATURE_TILE; ++j) {
            if (TILE_PREFETCH && (b & 3) == 0) _mm_prefetch((const char *)codes[j] + 16 * b + ahead, _MM_HINT_T1);
            __m256i u[4];
            float s[2];
            chunk_codes16(codes[j], b, u);
            block_scales(group, half, scale[j], b, s);
            acc[j] = row_block(group, u[0], u[1], x0, s[0], s[1], d0, acc[j]);
            block_scales(group, half, scale[j], b + 1, s);
            acc[j] = row_block(group, u[2], u[3], x1, s[0], s[1], d1, acc[j]);
        }
    }
    for (int j = 0; j < FEATURE_TILE; ++j)
        out[n0 + j] = hsum8(acc[j]) + offset_term_avx2(w, n0 + j, a->xsum, a->groups) + (bias ? bias[n0 + j] : 0.0f);
}

static void feature_avx2(const QWeight *w, const QActs *a, int64_t n, float *out, int64_t ldo, const float *bias) {
    if (w->bits == 8) feature8_avx2(w, a, n, out, ldo, bias);
    else if (w->group == 32 && w->half) feature_avx2_form(w, a, n, out, ldo, bias, 32, 1);
    else if (w->group == 32) feature_avx2_form(w, a, n, out, ldo, bias, 32, 0);
    else if (w->group == 16) feature_avx2_form(w, a, n, out, ldo, bias, 16, (int)w->half);
    else feature_avx2_form(w, a, n, out, ldo, bias, w->group, (int)w->half);
}

static void feature_tile_avx2(const QWeight *w, const QActs *a, int64_t n0, float *out, const float *bias) {
    if (w->group == 32 && w->half) feature_tile_avx2_form(w, a, n0, out, bias, 32, 1);
    else if (w->group == 32) feature_tile_avx2_form(w, a, n0, out, bias, 32, 0);
    else if (w->group == 16) feature_tile_avx2_form(w, a, n0, out, bias, 16, (int)w->half);
    else feature_tile_avx2_form(w, a, n0, out, bias, w->group, (int)w->half);
}
#endif

/* ---- AVX512-VNNI: features across the vector lanes (the `lanes` layout) ---------------- */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HAVE_VNNI 1

/* The lanes layout stores features in blocks of LANES (the last block padded with zero codes,
 * scales and offsets) so that one vpdpbusd multiplies 4 consecutive codes of 16 features by
 * 4 activation codes of one row (broadcast):
 *   8-bit codes  [N / LANES][K / 4][LANES][4]: byte b of feature f at step j is code 4j + b
 *   4-bit codes  [N / LANES][K / 8][LANES][4]: the same byte holds code 8j + b in its low
 *                nibble and code 8j + 4 + b in its high one
 *   scale, offset [N / LANES][K / G][LANES]
 * A lane sums a whole span (the elements that share a group scale and an activation dx: 16
 * for 16-element groups, else 32) in int32 before one widening and one scaling per span: per
 * row, 16 features and 32 elements, 16 vpdpbusd and ~5 more instructions, against ~48 for the
 * same products with 4 elements of one feature a lane (every 64-element chunk mixing groups
 * across the vector). Decode rows and prompt rows take the same tiles. */
#define TILE_ROWS 4
/* How far ahead the tiles ask for codes: a step's weights stream from memory (a 262k head is
 * ~190 MB), and the hardware prefetcher alone left most of the time waiting on loads. */
#ifndef LANES_PREFETCH_BYTES
#define LANES_PREFETCH_BYTES 8192
#endif

static inline int64_t lanes_block_bytes(const QWeight *w) { return w->K * LANES * w->bits / 8; }

/* 16 features' values (scale or offset) at element i of a block's [groups][LANES] array. */
static inline __m512 lane_values(const void *base, int64_t i, int64_t half) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
    return _mm512_loadu_ps((const float *)base + i);
}

/* Rows [m, m + R) times block nb's LANES features (`features` of them real). Per span, one
 * int32 accumulator per row and 16 features: the high codes' dots, shifted by 8 bits, then
 * the residual codes' on top (256 u.xq + u.xr < 2^31 for 32 elements). Two passes over the
 * span's codes (the second from L1) keep a tile of several rows in registers (one pass with
 * two accumulator sets spilled the float sums: 0.9x the time at 8 to 1,152 rows); one row,
 * memory-bound, takes both codes in one pass (the two-pass form: 1.05x its time). */
#define DEFINE_LANES_TILE(R, SPAN, BITS)                                                                          \
    static void lanes_tile_##R##_##SPAN##_##BITS(const QWeight *w, const QActs *a, int64_t nb, int64_t m,          \
                                                 int64_t features, float *out, int64_t ldo, const float *bias) {   \
        const int64_t K = a->K, groups = a->groups, blocks = K / 32;                                              \
        const uint8_t *codes = w->codes + nb * lanes_block_bytes(w);                                              \
        const int64_t vals = nb * groups * LANES;                                                                 \
        const int8_t *xq = a->xq + m * K, *xr = a->xr + m * K;                                                    \
        const __m512i low = _mm512_set1_epi8(15);                                                                 \
        __m512 acc[R][2];                                                                                         \
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                                  \
        for (int64_t k0 = 0; k0 < K; k0 += SPAN) {                                                                \
            __m512i dot[R][2], res[R][2]; /* res: one row's residual dots, in its one pass */                      \
            for (int r = 0; r < R; ++r)                                                                           \
                dot[r][0] = dot[r][1] = res[r][0] = res[r][1] = _mm512_setzero_si512();                           \
            for (int pass = 0; pass < (R == 1 ? 1 : 2); ++pass) { /* high codes, then (dot << 8) residual ones */ \
                const int8_t *x = pass ? xr : xq;                                                                 \
                if (pass)                                                                                         \
                    for (int r = 0; r < R; ++r)                                                                   \
                        dot[r][0] = _mm512_slli_epi32(dot[r][0], 8), dot[r][1] = _mm512_slli_epi32(dot[r][1], 8); \
                _Pragma("GCC unroll 8") for (int64_t k = k0; k < k0 + SPAN; k += 32 / BITS) {                     \
                    const uint8_t *p = codes + k * LANES * BITS / 8;                                              \
                    if (m == 0 && !pass) { /* a block's first row tile streams it; the others find it cached */   \
                        _mm_prefetch((const char *)p + LANES_PREFETCH_BYTES, _MM_HINT_T1);                        \
                        _mm_prefetch((const char *)p + LANES_PREFETCH_BYTES + 64, _MM_HINT_T1);                   \
                    }                                                                                             \
                    const __m512i p0 = _mm512_loadu_si512(p), p1 = _mm512_loadu_si512(p + 64);                    \
                    _Pragma("GCC unroll 2") for (int half = 0; half < 8 / BITS; ++half) {                         \
                        __m512i w0 = p0, w1 = p1;                                                                 \
                        if (BITS == 4) {                                                                          \
                            w0 = _mm512_and_si512(half ? _mm512_srli_epi16(p0, 4) : p0, low);                     \
                            w1 = _mm512_and_si512(half ? _mm512_srli_epi16(p1, 4) : p1, low);                     \
                        }                                                                                         \
                        _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {                                     \
                            int32_t x4;                                                                           \
                            memcpy(&x4, x + r * K + k + 4 * half, 4);                                             \
                            const __m512i b = _mm512_set1_epi32(x4);                                              \
                            dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, b);                                    \
                            dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, b);                                    \
                            if (R == 1) {                                                                         \
                                memcpy(&x4, xr + r * K + k + 4 * half, 4);                                        \
                                const __m512i c = _mm512_set1_epi32(x4);                                          \
                                res[r][0] = _mm512_dpbusd_epi32(res[r][0], w0, c);                                \
                                res[r][1] = _mm512_dpbusd_epi32(res[r][1], w1, c);                                \
                            }                                                                                     \
                        }                                                                                         \
                    }                                                                                             \
                }                                                                                                 \
            }                                                                                                     \
            if (R == 1)                                                                                           \
                for (int h = 0; h < 2; ++h) dot[0][h] = _mm512_add_epi32(_mm512_slli_epi32(dot[0][h], 8), res[0][h]); \
            const int64_t g = k0 / w->group;                                                                      \
            const __m512 s0 = lane_values(w->scale, vals + g * LANES, w->half);                                   \
            const __m512 s1 = lane_values(w->scale, vals + g * LANES + 16, w->half);                              \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {                                                 \
                const __m512 d = _mm512_set1_ps(a->dx[(m + r) * blocks + k0 / 32] * (1.0f / 256.0f));            \
                const __m512 t0 = _mm512_cvtepi32_ps(dot[r][0]), t1 = _mm512_cvtepi32_ps(dot[r][1]);                \
                acc[r][0] = _mm512_fmadd_ps(t0, _mm512_mul_ps(s0, d), acc[r][0]);                                 \
                acc[r][1] = _mm512_fmadd_ps(t1, _mm512_mul_ps(s1, d), acc[r][1]);                                 \
            }                                                                                                     \
            if ((k0 + SPAN) % w->group == 0) { /* the group's offset term: offset * sum of its x^ */             \
                __m512 o0, o1;                                                                                    \
                if (w->offset) {                                                                                  \
                    o0 = lane_values(w->offset, vals + g * LANES, w->half);                                       \
                    o1 = lane_values(w->offset, vals + g * LANES + 16, w->half);                                  \
                } else {                                                                                          \
                    const __m512 z = _mm512_set1_ps(-(float)w->zero);                                             \
                    o0 = _mm512_mul_ps(s0, z), o1 = _mm512_mul_ps(s1, z);                                         \
                }                                                                                                 \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {                                             \
                    const __m512 xs = _mm512_set1_ps(a->xsum[(m + r) * groups + g]);                              \
                    acc[r][0] = _mm512_fmadd_ps(o0, xs, acc[r][0]), acc[r][1] = _mm512_fmadd_ps(o1, xs, acc[r][1]); \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        const int64_t n0 = nb * LANES;                                                                            \
        const __mmask16 k0 = features >= 16 ? 0xFFFF : (__mmask16)((1u << features) - 1);                         \
        const __mmask16 k1 = features >= 32 ? 0xFFFF : features <= 16 ? 0 : (__mmask16)((1u << (features - 16)) - 1); \
        const __m512 b0 = bias ? _mm512_maskz_loadu_ps(k0, bias + n0) : _mm512_setzero_ps();                      \
        const __m512 b1 = bias ? _mm512_maskz_loadu_ps(k1, bias + n0 + 16) : _mm512_setzero_ps();                 \
        for (int r = 0; r < R; ++r) {                                                                             \
            _mm512_mask_storeu_ps(out + (m + r) * ldo + n0, k0, _mm512_add_ps(acc[r][0], b0));                    \
            _mm512_mask_storeu_ps(out + (m + r) * ldo + n0 + 16, k1, _mm512_add_ps(acc[r][1], b1));               \
        }                                                                                                         \
    }
#define DEFINE_LANES_TILES(SPAN, BITS) \
    DEFINE_LANES_TILE(1, SPAN, BITS) DEFINE_LANES_TILE(2, SPAN, BITS) DEFINE_LANES_TILE(3, SPAN, BITS) DEFINE_LANES_TILE(4, SPAN, BITS)
DEFINE_LANES_TILES(16, 4)
DEFINE_LANES_TILES(16, 8)
DEFINE_LANES_TILES(32, 4)
DEFINE_LANES_TILES(32, 8)

typedef void (*LanesTile)(const QWeight *, const QActs *, int64_t, int64_t, int64_t, float *, int64_t, const float *);

/* The tiles for R = 1..TILE_ROWS rows, by the weight's span and bits. */
static const LanesTile *lanes_tiles(const QWeight *w) {
    static const LanesTile tiles[2][2][TILE_ROWS] = {
        {{lanes_tile_1_16_4, lanes_tile_2_16_4, lanes_tile_3_16_4, lanes_tile_4_16_4},
         {lanes_tile_1_16_8, lanes_tile_2_16_8, lanes_tile_3_16_8, lanes_tile_4_16_8}},
        {{lanes_tile_1_32_4, lanes_tile_2_32_4, lanes_tile_3_32_4, lanes_tile_4_32_4},
         {lanes_tile_1_32_8, lanes_tile_2_32_8, lanes_tile_3_32_8, lanes_tile_4_32_8}},
    };
    return tiles[w->group != 16][w->bits == 8];
}

#endif

/* Features [n0, n1) of the product for every row of a (n0 a multiple of LANES for a lanes
 * weight, of FEATURE_TILE elsewhere), on the calling thread: the tiles path `path` chooses
 * (0: the best this build has for the layout; 1: AVX2; 2: scalar; checked by the caller). */
static void product_features(const QWeight *w, const QActs *a, int64_t n0, int64_t n1, float *out, int64_t ldo,
                             const float *bias, int64_t path) {
#if defined(HAVE_VNNI)
    if (w->lanes) {
        const LanesTile *tiles = lanes_tiles(w);
        for (int64_t nb = n0 / LANES; nb * LANES < n1; ++nb) {
            const int64_t features = w->N - nb * LANES < LANES ? w->N - nb * LANES : LANES;
            for (int64_t m = 0; m < a->M; m += TILE_ROWS) {
                const int64_t rows = a->M - m < TILE_ROWS ? a->M - m : TILE_ROWS;
                tiles[rows - 1](w, a, nb, m, features, out, ldo, bias);
            }
        }
        return;
    }
#endif
#if defined(__AVX2__)
    if (path <= 1) {
        int64_t n = n0;
        if (a->M == 1 && w->bits == 4)
            for (; n + FEATURE_TILE <= n1; n += FEATURE_TILE) feature_tile_avx2(w, a, n, out, bias);
        for (; n < n1; ++n) feature_avx2(w, a, n, out, ldo, bias);
        return;
    }
#endif
    for (int64_t n = n0; n < n1; ++n) feature_scalar(w, a, n, out, ldo, bias);
}

/* Features a work item of product_features takes: a lanes block, or a 4-bit row's tile. */
static inline int64_t feature_step(const QWeight *w) {
#if defined(HAVE_VNNI)
    if (w->lanes) return LANES;
#endif
    (void)w;
    return 4;
}

#endif
