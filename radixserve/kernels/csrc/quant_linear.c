/*
 * out = x @ w.T for a weight stored as small unsigned codes in groups (radixserve's one
 * repacked layout for every GGUF block type and for int8/int4 quantized checkpoints,
 * model/quant_weight.py):
 *
 *   w[n, k] = scale[n, k / G] * u[n, k] + offset[n, k / G]
 *
 *   u      4-bit or 8-bit unsigned codes, K a multiple of 64. 8-bit: one byte a code.
 *          4-bit: per 64-element chunk, byte j (0..31) holds code j in its low nibble and
 *          code 32 + j in its high nibble, so one chunk unpacks into two 32-byte halves.
 *   G      16, 32, or a multiple of 64 dividing K (16: Q6_K's sub-blocks; K: per channel)
 *   scale, offset  float32 [N, K / G], or float16 where `half` (both alike: the GGUF types that
 *          store them as float16, exactly); offset NULL: offset = -zero * scale (a symmetric type
 *          stored with its zero point `zero`: Q4_0's 8, Q8_0's 128, Q6_K's 32)
 *
 * The rows of x are quantized per 32-element block to two int8 codes an element, a high one
 * and the residual it leaves (x^ = dx * (xq + xr / 256), dx = max|x| / 127: about 16 bits;
 * one int8 code alone, as llama.cpp's Q8 activations, measured 98.2% top-1 agreement with the
 * float product on the default model, two 99.5%+). Each row of the product is
 * sum_g scale * dx * (256 u.xq + u.xr) / 256 + offset * sum(x^): exactly w . x^ up to float
 * summation order, so the only error against the float product is the activations' rounding.
 * On AVX512-VNNI the u8 x s8 products are vpdpbusd's, 64 an instruction; an AVX2 path widens
 * to 16 bits (vpmaddwd, no saturation for 8-bit codes), and a scalar one is the plain loop. `path` chooses (0: the best this build has; 1: AVX2;
 * 2: scalar) so the tests run each one here. float16 scales are widened where they are read:
 * by vcvtph2ps in the vector paths, by half_to_float (exact, portable) in the scalar code.
 *
 * Features are split over OpenMP threads (torch's own workers, see native_build.py).
 */
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
} QWeight;

/* The activations of one call: per row, int8 codes, each 32-block's dx, and per weight group
 * the sum of the dequantized activations. */
typedef struct {
    int8_t *xq;      /* [M, K] high codes */
    int8_t *xr;      /* [M, K] residual codes, in 1/256ths of dx */
    float *dx;       /* [M, K / 32] */
    float *xsum;     /* [M, K / G] */
    int64_t M, K, groups;
} QActs;

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

static void quantize_rows(const float *x, int64_t ldx, QActs *a, int64_t group) {
    const int64_t K = a->K, blocks = K / 32;
#pragma omp parallel for schedule(static) if (a->M * K >= 65536)
    for (int64_t r = 0; r < a->M; ++r) {
        const float *xr = x + r * ldx;
        int8_t *q = a->xq + r * K, *res = a->xr + r * K;
        float *dx = a->dx + r * blocks, *xs = a->xsum + r * a->groups;
        memset(xs, 0, sizeof(float) * a->groups);
        for (int64_t b = 0; b < blocks; ++b) {
            float amax = 0.0f;
            for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(xr[32 * b + i]));
            const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            dx[b] = d;
            float half[2] = {0.0f, 0.0f}; /* each 16 elements' sum of x^ / dx, in registers (a sum
                                             kept in xs[] made every element wait on the last store) */
            for (int i = 0; i < 32; ++i) {
                const float v = xr[32 * b + i] * inv;
                const int hi = (int)lrintf(v), clamped = hi > 127 ? 127 : hi < -127 ? -127 : hi;
                const int lo = (int)lrintf((v - (float)clamped) * 256.0f), low = lo > 127 ? 127 : lo < -127 ? -127 : lo;
                q[32 * b + i] = (int8_t)clamped;
                res[32 * b + i] = (int8_t)low;
                half[i / 16] += (float)clamped + (float)low * (1.0f / 256.0f);
            }
            if (group == 16) {
                xs[2 * b] += d * half[0], xs[2 * b + 1] += d * half[1];
            } else {
                xs[32 * b / group] += d * (half[0] + half[1]);
            }
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

/* 32 codes of block b (elements 32b..32b+31) as bytes. */
static inline __m256i block_codes_avx2(const uint8_t *codes, int64_t b, int64_t bits) {
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)(codes + 32 * b));
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(codes + 32 * (b / 2)));
    const __m256i nib = b % 2 ? _mm256_srli_epi16(packed, 4) : packed;
    return _mm256_and_si256(nib, _mm256_set1_epi8(15));
}

/* Per 16-element half of a block: the int32 dot products as 8 lanes (4 per half: lanes
 * 0-3 elements 0-15, lanes 4-7 elements 16-31 after the permute below). */
static inline __m256i block_dot_avx2(__m256i u, const int8_t *q) {
    const __m256i xq = _mm256_loadu_si256((const __m256i *)q);  /* no saturation: s16 products, s32 sums */
    const __m256i lo = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(u)),
                                         _mm256_cvtepi8_epi16(_mm256_castsi256_si128(xq)));
    const __m256i hi = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1)),
                                         _mm256_cvtepi8_epi16(_mm256_extracti128_si256(xq, 1)));
    /* lo: 8 pair sums of elements 0-15, hi: of 16-31; fold each to 4 lanes: [lo0..3 | hi0..3] */
    const __m256i folded = _mm256_hadd_epi32(lo, hi);  /* [lo01 lo23 hi01 hi23 | lo45 lo67 hi45 hi67] */
    return _mm256_permutevar8x32_epi32(folded, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

static void feature_avx2(const QWeight *w, const QActs *a, int64_t n, float *out, int64_t ldo, const float *bias) {
    const uint8_t *codes = w->codes + n * row_bytes(w);
    const void *scale = group_row(w, w->scale, n, a->groups);
    const int64_t blocks = a->K / 32;
    for (int64_t r = 0; r < a->M; ++r) {
        const int8_t *q = a->xq + r * a->K, *res = a->xr + r * a->K;
        const float *dx = a->dx + r * blocks;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
            const __m256i u = block_codes_avx2(codes, b, w->bits);
            const __m256i hi = _mm256_slli_epi32(block_dot_avx2(u, q + 32 * b), 8);
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(hi, block_dot_avx2(u, res + 32 * b)));
            __m256 s;
            if (w->group == 16)
                s = _mm256_setr_m128(_mm_set1_ps(group_value_fast(w, scale, 2 * b)),
                                     _mm_set1_ps(group_value_fast(w, scale, 2 * b + 1)));
            else
                s = _mm256_set1_ps(group_value_fast(w, scale, 32 * b / w->group));
            acc = _mm256_fmadd_ps(dot, _mm256_mul_ps(s, _mm256_set1_ps(dx[b] * (1.0f / 256.0f))), acc);
        }
        out[r * ldo + n] = hsum8(acc) + offset_term(w, n, a->xsum + r * a->groups, a->groups) + (bias ? bias[n] : 0.0f);
    }
}
#endif

/* ---- AVX512-VNNI: a 64-element chunk a vpdpbusd, 4 features x up to 4 rows a tile ------ */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HAVE_VNNI 1

/* The 64 codes of chunk c as bytes in element order. */
static inline __m512i chunk_codes(const uint8_t *codes, int64_t c, int64_t bits) {
    if (bits == 8) return _mm512_loadu_si512(codes + 64 * c);
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(codes + 32 * c));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(packed), _mm256_srli_epi16(packed, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(15));
}

typedef struct {
    __m512i index;     /* lane l (elements 4l..4l+3 of a chunk) -> its group among those loaded */
    __mmask16 load;    /* how many group scales one chunk spans */
    int64_t per_chunk; /* groups advanced per chunk, 0 when a group spans several chunks */
} ScaleLanes;

static ScaleLanes scale_lanes(int64_t group) {
    ScaleLanes s;
    if (group == 16) {
        s.index = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), s.load = 0xF, s.per_chunk = 4;
    } else if (group == 32) {
        s.index = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), s.load = 0x3, s.per_chunk = 2;
    } else {
        s.index = _mm512_setzero_si512(), s.load = 0x1, s.per_chunk = 0;
    }
    return s;
}

/* The `load` group values at base[i] (float16 where HALF) widened into a vector's low lanes. */
static inline __m512 group_values(const void *base, int64_t i, __mmask16 load, int half) {
    if (half) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(load, (const uint16_t *)base + i));
    return _mm512_maskz_loadu_ps(load, (const float *)base + i);
}

/* Per row and 64-element chunk, 16 lanes (lane l: elements 4l..4l+3, of 32-block 2c + l / 8)
 * into dx_lanes [M, K / 64, 16]: dx / 256; and where z_lanes is given, [M, K / 64, 16] as well:
 * -zero * the sum of the lane's four dequantized activations, so that a symmetric weight's
 * zero point is folded into each chunk's product (s * (dx/256 * dot + z)) instead of a pass
 * over the groups per feature. Made once a call instead of once a feature quad. */
static void expand_lanes(const QActs *a, int64_t zero, float *dx_lanes, float *z_lanes) {
    const __m512i index = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512 unit = _mm512_set1_ps(1.0f / 256.0f);
    const __m512i ones = _mm512_set1_epi8(1);
    const int64_t chunks = a->K / 64;
    for (int64_t i = 0; i < a->M * chunks; ++i) {
        const __m512 dx = _mm512_mul_ps(unit, _mm512_permutexvar_ps(index, _mm512_maskz_loadu_ps(0x3, a->dx + 2 * i)));
        _mm512_storeu_ps(dx_lanes + 16 * i, dx);
        if (!z_lanes) continue;
        const int64_t r = i / chunks, c = i % chunks;
        const __m512i xq = _mm512_loadu_si512(a->xq + r * a->K + 64 * c);
        const __m512i xr = _mm512_loadu_si512(a->xr + r * a->K + 64 * c);
        const __m512i sq = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, xq);  /* 4 codes a lane */
        const __m512i sr = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, xr);
        const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(sq, 8), sr);      /* in 1/256ths */
        _mm512_storeu_ps(z_lanes + 16 * i, _mm512_mul_ps(_mm512_set1_ps(-(float)zero),
                                                         _mm512_mul_ps(dx, _mm512_cvtepi32_ps(sum))));
    }
}

/* How far ahead the tiles ask for weight rows (in rows of the weight): the head of a large
 * vocabulary streams ~190 MB a step, and one quad ahead (the first version) left most of the
 * time waiting on loads. */
#ifndef QUANT_PREFETCH_ROWS
#define QUANT_PREFETCH_ROWS 16
#endif

/* A tile of 4 features x R rows. SYM: a symmetric weight (offset NULL) whose zero point comes
 * in with z_lanes; otherwise the offsets' term (offset . xsum over the groups) is added into
 * the accumulators at the end. HALF: float16 scales and offsets. */
#define DEFINE_QTILE(R, SYM, HALF)                                                                               \
    static void qtile4x##R##_##SYM##HALF(const QWeight *w, const QActs *a, const float *dx_lanes,                 \
                                         const float *z_lanes, int64_t n, int64_t m, float *out, int64_t ldo,    \
                                         const float *bias, ScaleLanes lanes) {                                  \
        const int64_t rb = row_bytes(w), groups = a->groups, chunks = a->K / 64, cb = w->bits * 8;              \
        __m512 acc[R][4];                                                                                        \
        for (int r = 0; r < R; ++r)                                                                              \
            for (int f = 0; f < 4; ++f) acc[r][f] = _mm512_setzero_ps();                                         \
        const uint8_t *base = w->codes + n * rb;                                                                 \
        const void *sbase = group_row(w, w->scale, n, groups);                                                   \
        for (int64_t c = 0; c < chunks; ++c) {                                                                   \
            __m512i u[4];                                                                                        \
            __m512 s[4];                                                                                         \
            const int64_t g = lanes.per_chunk ? c * lanes.per_chunk : 64 * c / w->group;                         \
            _Pragma("GCC unroll 4") for (int f = 0; f < 4; ++f) {                                                \
                const uint8_t *row = base + f * rb;                                                              \
                u[f] = chunk_codes(row, c, w->bits);                                                             \
                _mm_prefetch((const char *)(row + QUANT_PREFETCH_ROWS * rb + c * cb), _MM_HINT_T1);             \
                s[f] = _mm512_permutexvar_ps(lanes.index, group_values(sbase, f * groups + g, lanes.load, HALF)); \
            }                                                                                                    \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {                                                \
                const __m512i xq = _mm512_loadu_si512(a->xq + (m + r) * a->K + 64 * c);                          \
                const __m512i xr = _mm512_loadu_si512(a->xr + (m + r) * a->K + 64 * c);                          \
                const __m512 dx = _mm512_loadu_ps(dx_lanes + 16 * ((m + r) * chunks + c));                       \
                __m512 z = _mm512_setzero_ps();                                                                  \
                if (SYM) z = _mm512_loadu_ps(z_lanes + 16 * ((m + r) * chunks + c));                             \
                _Pragma("GCC unroll 4") for (int f = 0; f < 4; ++f) {                                            \
                    const __m512i hi = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[f], xq), 8); \
                    const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(hi, u[f], xr));                    \
                    if (SYM)                                                                                     \
                        acc[r][f] = _mm512_fmadd_ps(s[f], _mm512_fmadd_ps(dot, dx, z), acc[r][f]);               \
                    else                                                                                         \
                        acc[r][f] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s[f], dx), acc[r][f]);                    \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        for (int r = 0; r < R; ++r) {                                                                            \
            const float *xs = a->xsum + (m + r) * groups;                                                        \
            if (!SYM) /* the offsets' term into the same lanes, so that one sum4 reduces both */                 \
                for (int64_t g = 0; g < groups; g += 16) {                                                       \
                    const __mmask16 mk = groups - g >= 16 ? 0xFFFF : (__mmask16)((1u << (groups - g)) - 1);      \
                    const __m512 x16 = _mm512_maskz_loadu_ps(mk, xs + g);                                        \
                    for (int f = 0; f < 4; ++f)                                                                  \
                        acc[r][f] = _mm512_fmadd_ps(group_values(w->offset, (n + f) * groups + g, mk, HALF),     \
                                                    x16, acc[r][f]);                                             \
                }                                                                                                \
            float sums[4];                                                                                       \
            _mm_storeu_ps(sums, sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));                               \
            for (int f = 0; f < 4; ++f) out[(m + r) * ldo + n + f] = sums[f] + (bias ? bias[n + f] : 0.0f);      \
        }                                                                                                        \
    }
#define DEFINE_QTILES(SYM, HALF) \
    DEFINE_QTILE(1, SYM, HALF) DEFINE_QTILE(2, SYM, HALF) DEFINE_QTILE(3, SYM, HALF) DEFINE_QTILE(4, SYM, HALF)
DEFINE_QTILES(0, 0)
DEFINE_QTILES(1, 0)
DEFINE_QTILES(0, 1)
DEFINE_QTILES(1, 1)

#define QUAD_VNNI(SYM, HALF)                                                                                     \
    static void quad_vnni_##SYM##HALF(const QWeight *w, const QActs *a, const float *dx_lanes,                    \
                                      const float *z_lanes, int64_t n, float *out, int64_t ldo,                   \
                                      const float *bias) {                                                       \
        const ScaleLanes lanes = scale_lanes(w->group);                                                          \
        int64_t m = 0;                                                                                           \
        for (; m + 4 <= a->M; m += 4) qtile4x4_##SYM##HALF(w, a, dx_lanes, z_lanes, n, m, out, ldo, bias, lanes); \
        switch (a->M - m) {                                                                                      \
            case 3: qtile4x3_##SYM##HALF(w, a, dx_lanes, z_lanes, n, m, out, ldo, bias, lanes); break;           \
            case 2: qtile4x2_##SYM##HALF(w, a, dx_lanes, z_lanes, n, m, out, ldo, bias, lanes); break;           \
            case 1: qtile4x1_##SYM##HALF(w, a, dx_lanes, z_lanes, n, m, out, ldo, bias, lanes); break;           \
            default: break;                                                                                      \
        }                                                                                                        \
    }
QUAD_VNNI(0, 0)
QUAD_VNNI(1, 0)
QUAD_VNNI(0, 1)
QUAD_VNNI(1, 1)
#endif

#if defined(HAVE_VNNI)
/* ---- AVX512-VNNI for prompt-sized M: features across the lanes ------------------------- */

/* quant_linear's tiles above put 4 elements of one feature in each lane, so every 64-element
 * chunk mixes two or four groups (scales) across the vector, and each chunk's int32 dots are
 * widened to float and scaled: ~6 instructions per 64 multiply-adds, slower than float32 FMAs
 * once M is large enough to reuse each weight load over many rows (measured 54-69 GFLOP/s
 * against oneDNN's 80-98 on the dequantized weight, 1 thread, 128-512 rows).
 *
 * Here a lane is a feature: a block of GEMM_FEATURES features is repacked (per call, into
 * one thread's scratch; no copy of the weights is kept) as [K / 4][GEMM_FEATURES][4] codes,
 * so that one vpdpbusd multiplies 4 consecutive codes of 16 features by 4 activation codes of
 * one row (broadcast), and a lane sums a whole span (the elements that share a group scale
 * and an activation dx: 16 for 16-element groups, else 32) in int32 before one widening and
 * one scaling per span. Per row and 16 features: 16 vpdpbusd + ~5 instructions per 512
 * multiply-adds (a group's offset term adds one FMA). The activations are quantized exactly
 * as quant_linear_f32 quantizes them (quantize_rows), so both paths multiply the same x^ by
 * the same weights; only the order of the float sums differs. */
#define GEMM_FEATURES 32
#define GEMM_ROWS 4
#define GEMM_BLOCK 64 /* features repacked at a time: each row tile's activations serve them from L1 */

/* 16 x 16 dwords transposed: r[i] lane j <- r[j] lane i. */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512 a[16], b[16], c[16];
    for (int i = 0; i < 16; ++i) c[i] = _mm512_castsi512_ps(r[i]);
    for (int i = 0; i < 16; i += 2)
        a[i] = _mm512_unpacklo_ps(c[i], c[i + 1]), a[i + 1] = _mm512_unpackhi_ps(c[i], c[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        b[i] = _mm512_shuffle_ps(a[i], a[i + 2], 0x44), b[i + 1] = _mm512_shuffle_ps(a[i], a[i + 2], 0xEE);
        b[i + 2] = _mm512_shuffle_ps(a[i + 1], a[i + 3], 0x44), b[i + 3] = _mm512_shuffle_ps(a[i + 1], a[i + 3], 0xEE);
    }
    for (int j = 0; j < 4; ++j) {
        const __m512 c_lo = _mm512_shuffle_f32x4(b[j], b[4 + j], 0x44), c_hi = _mm512_shuffle_f32x4(b[j], b[4 + j], 0xEE);
        const __m512 d_lo = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0x44);
        const __m512 d_hi = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0xEE);
        c[j] = _mm512_shuffle_f32x4(c_lo, d_lo, 0x88), c[4 + j] = _mm512_shuffle_f32x4(c_lo, d_lo, 0xDD);
        c[8 + j] = _mm512_shuffle_f32x4(c_hi, d_hi, 0x88), c[12 + j] = _mm512_shuffle_f32x4(c_hi, d_hi, 0xDD);
    }
    for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(c[i]);
}

/* Features [n0, n0 + GEMM_FEATURES) into the block's scratch: codes [K / 4][GEMM_FEATURES][4],
 * scales and offsets [groups][GEMM_FEATURES] as float32 (offset: the weight's, or -zero * scale);
 * features past N get zero codes, scales and offsets. */
static void gemm_repack(const QWeight *w, int64_t n0, uint8_t *codes, float *sc, float *off) {
    const int64_t K = w->K, groups = K / w->group, rb = row_bytes(w);
    for (int64_t h = 0; h < GEMM_FEATURES; h += 16) {
        for (int64_t c = 0; c < K / 64; ++c) {
            __m512i r[16];
            for (int64_t f = 0; f < 16; ++f) {
                const int64_t n = n0 + h + f;
                r[f] = n < w->N ? chunk_codes(w->codes + n * rb, c, w->bits) : _mm512_setzero_si512();
            }
            transpose16_epi32(r); /* r[j]: dword j of the chunk (elements 64c + 4j ..) of the 16 features */
            for (int64_t j = 0; j < 16; ++j)
                _mm512_storeu_si512(codes + ((16 * c + j) * GEMM_FEATURES + h) * 4, r[j]);
        }
    }
    for (int64_t f = 0; f < GEMM_FEATURES; ++f) {
        const int64_t n = n0 + f;
        for (int64_t g = 0; g < groups; ++g) {
            float s = 0.0f, o = 0.0f;
            if (n < w->N) {
                s = group_value_fast(w, group_row(w, w->scale, n, groups), g);
                o = w->offset ? group_value_fast(w, group_row(w, w->offset, n, groups), g) : -(float)w->zero * s;
            }
            sc[g * GEMM_FEATURES + f] = s, off[g * GEMM_FEATURES + f] = o;
        }
    }
}

/* Rows [m, m + GEMM_ROWS) (the activations padded with zero rows to a multiple of GEMM_ROWS)
 * times the block's features; `rows` of them real, `features` of the block real. A span's
 * high codes are summed first, the sum shifted by 8 bits, then its residual codes summed on
 * (one int32 accumulator per row and 16 features: 256 * u.xq + u.xr, < 2^31 for 32 elements). */
static inline __attribute__((always_inline)) void gemm_tile_in(const uint8_t *codes, const float *sc,
                                                              const float *off, const QActs *a, int64_t m,
                                                              int64_t rows, int64_t group, int64_t n0,
                                                              int64_t features, float *out, int64_t ldo,
                                                              const float *bias, const int64_t span) {
    const int64_t K = a->K, blocks = K / 32;
    __m512 acc[GEMM_ROWS][2];
    for (int r = 0; r < GEMM_ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int8_t *xq = a->xq + m * K, *xr = a->xr + m * K;
    for (int64_t k0 = 0; k0 < K; k0 += span) {
        __m512i dot[GEMM_ROWS][2];
        for (int r = 0; r < GEMM_ROWS; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
        for (int pass = 0; pass < 2; ++pass) {
            const int8_t *x = pass ? xr : xq;
            if (pass)
                for (int r = 0; r < GEMM_ROWS; ++r)
                    dot[r][0] = _mm512_slli_epi32(dot[r][0], 8), dot[r][1] = _mm512_slli_epi32(dot[r][1], 8);
            _Pragma("GCC unroll 8") for (int64_t k = k0; k < k0 + span; k += 4) {
                const __m512i w0 = _mm512_loadu_si512(codes + k * GEMM_FEATURES);
                const __m512i w1 = _mm512_loadu_si512(codes + k * GEMM_FEATURES + 64);
                _Pragma("GCC unroll 4") for (int r = 0; r < GEMM_ROWS; ++r) {
                    int32_t x4;
                    memcpy(&x4, x + r * K + k, 4);
                    const __m512i b = _mm512_set1_epi32(x4);
                    dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, b), dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, b);
                }
            }
        }
        const int64_t g = k0 / group;
        const __m512 s0 = _mm512_loadu_ps(sc + g * GEMM_FEATURES), s1 = _mm512_loadu_ps(sc + g * GEMM_FEATURES + 16);
        _Pragma("GCC unroll 4") for (int r = 0; r < GEMM_ROWS; ++r) {
            const __m512 d = _mm512_set1_ps(a->dx[(m + r) * blocks + k0 / 32] * (1.0f / 256.0f));
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][0]), _mm512_mul_ps(s0, d), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][1]), _mm512_mul_ps(s1, d), acc[r][1]);
        }
        if ((k0 + span) % group == 0) { /* the group's offset term: offset * sum of its x^ */
            const __m512 o0 = _mm512_loadu_ps(off + g * GEMM_FEATURES);
            const __m512 o1 = _mm512_loadu_ps(off + g * GEMM_FEATURES + 16);
            _Pragma("GCC unroll 4") for (int r = 0; r < GEMM_ROWS; ++r) {
                const __m512 xs = _mm512_set1_ps(a->xsum[(m + r) * a->groups + g]);
                acc[r][0] = _mm512_fmadd_ps(o0, xs, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(o1, xs, acc[r][1]);
            }
        }
    }
    const __mmask16 k0 = features >= 16 ? 0xFFFF : (__mmask16)((1u << features) - 1);
    const __mmask16 k1 = features >= 32 ? 0xFFFF : features <= 16 ? 0 : (__mmask16)((1u << (features - 16)) - 1);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(k0, bias + n0) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(k1, bias + n0 + 16) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
        _mm512_mask_storeu_ps(out + (m + r) * ldo + n0, k0, _mm512_add_ps(acc[r][0], b0));
        _mm512_mask_storeu_ps(out + (m + r) * ldo + n0 + 16, k1, _mm512_add_ps(acc[r][1], b1));
    }
}

/* gemm_tile_in compiled apart for 16- and 32-element spans (a constant: the span's loop unrolled). */
static void gemm_tile(const uint8_t *codes, const float *sc, const float *off, const QActs *a, int64_t m,
                      int64_t rows, int64_t group, int64_t n0, int64_t features, float *out, int64_t ldo,
                      const float *bias) {
    if (group == 16) gemm_tile_in(codes, sc, off, a, m, rows, group, n0, features, out, ldo, bias, 16);
    else gemm_tile_in(codes, sc, off, a, m, rows, group, n0, features, out, ldo, bias, 32);
}
#endif

/* ---- entry points --------------------------------------------------------------------- */

int quant_linear_best_path(void) {
#if defined(HAVE_VNNI)
    return 0;
#elif defined(__AVX2__)
    return 1;
#else
    return 2;
#endif
}

/* x [M, K] rows `ldx` floats apart -> out [M, N] rows `ldo` floats apart (+ bias [N] or NULL);
 * scale and offset float16 where half is 1, float32 where 0.
 * Returns 0; -1 for shapes the layout refuses, -2 when scratch memory cannot be had, -3 for a
 * path this build lacks. */
int quant_linear_f32(const float *x, int64_t M, int64_t ldx, const uint8_t *codes, const void *scale,
                     const void *offset, int64_t N, int64_t K, int64_t bits, int64_t group, int64_t zero,
                     int64_t half, const float *bias, float *out, int64_t ldo, int64_t path) {
    const QWeight w = {codes, scale, offset, N, K, bits, group, zero, half};
    if (!weight_valid(&w) || M <= 0) return -1;
    if (path == 0) path = quant_linear_best_path();
#if !defined(__AVX2__)
    if (path == 1) return -3;
#endif
    QActs a = {NULL, NULL, NULL, NULL, M, K, K / group};
    /* xq, xr, then dx, xsum and the VNNI path's dx and zero-point lanes (M * K / 4 floats each) */
    void *scratch = malloc((size_t)(2 * M * K) + sizeof(float) * (size_t)(M * (K / 32 + K / group + K / 2)) + 64);
    if (!scratch) return -2;
    a.xq = (int8_t *)scratch;
    a.xr = a.xq + M * K;
    a.dx = (float *)(((uintptr_t)(a.xr + M * K) + 63) & ~(uintptr_t)63);
    a.xsum = a.dx + M * (K / 32);
    quantize_rows(x, ldx, &a, group);
    int64_t done = 0;
#if defined(HAVE_VNNI)
    if (path == 0) {
        float *dx_lanes = a.xsum + M * (K / group);
        float *z_lanes = offset ? NULL : dx_lanes + M * (K / 4);
        expand_lanes(&a, zero, dx_lanes, z_lanes);
        const int64_t quads = N / 4;
        void (*const quad)(const QWeight *, const QActs *, const float *, const float *, int64_t, float *, int64_t,
                           const float *) = z_lanes ? (half ? quad_vnni_11 : quad_vnni_10)
                                                    : (half ? quad_vnni_01 : quad_vnni_00);
#pragma omp parallel for schedule(static)
        for (int64_t q = 0; q < quads; ++q) quad(&w, &a, dx_lanes, z_lanes, 4 * q, out, ldo, bias);
        done = 4 * quads;
    }
#endif
#if defined(__AVX2__)
    if (path <= 1) {
#pragma omp parallel for schedule(static)
        for (int64_t n = done; n < N; ++n) feature_avx2(&w, &a, n, out, ldo, bias);
        done = N;
    }
#endif
#pragma omp parallel for schedule(static)
    for (int64_t n = done; n < N; ++n) feature_scalar(&w, &a, n, out, ldo, bias);
    free(scratch);
    return 0;
}

/* quant_linear_f32's product for prompt-sized M (the features-across-lanes kernel above):
 * the same arguments but `path`. Returns 0; -1 for shapes the layout refuses, -2 when scratch
 * memory cannot be had, -3 where this build has no AVX512-VNNI (callers keep their float path). */
int quant_gemm_f32(const float *x, int64_t M, int64_t ldx, const uint8_t *codes, const void *scale,
                   const void *offset, int64_t N, int64_t K, int64_t bits, int64_t group, int64_t zero,
                   int64_t half, const float *bias, float *out, int64_t ldo) {
#if defined(HAVE_VNNI)
    const QWeight w = {codes, scale, offset, N, K, bits, group, zero, half};
    if (!weight_valid(&w) || M <= 0) return -1;
    const int64_t padded = (M + GEMM_ROWS - 1) / GEMM_ROWS * GEMM_ROWS, groups = K / group;
    QActs a = {NULL, NULL, NULL, NULL, M, K, groups};
    void *scratch = malloc((size_t)(2 * padded * K) + sizeof(float) * (size_t)(padded * (K / 32 + groups)) + 64);
    if (!scratch) return -2;
    a.xq = (int8_t *)scratch;
    a.xr = a.xq + padded * K;
    a.dx = (float *)(((uintptr_t)(a.xr + padded * K) + 63) & ~(uintptr_t)63);
    a.xsum = a.dx + padded * (K / 32);
    quantize_rows(x, ldx, &a, group);
    const int64_t pad = padded - M; /* zero rows: computed, never stored */
    memset(a.xq + M * K, 0, (size_t)(pad * K)), memset(a.xr + M * K, 0, (size_t)(pad * K));
    memset(a.dx + M * (K / 32), 0, sizeof(float) * (size_t)(pad * (K / 32)));
    memset(a.xsum + M * groups, 0, sizeof(float) * (size_t)(pad * groups));
    const int64_t nblocks = (N + GEMM_BLOCK - 1) / GEMM_BLOCK, subs = GEMM_BLOCK / GEMM_FEATURES;
    const int64_t sub_bytes = K * GEMM_FEATURES + (int64_t)sizeof(float) * 2 * groups * GEMM_FEATURES;
    int failed = 0;
#pragma omp parallel
    {
        uint8_t *block = (uint8_t *)malloc((size_t)(subs * sub_bytes));
        if (!block) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t nb = 0; nb < nblocks; ++nb) {
            if (!block) continue;
            for (int64_t s = 0; s < subs; ++s) {
                uint8_t *codes = block + s * sub_bytes;
                float *sc = (float *)(codes + K * GEMM_FEATURES);
                gemm_repack(&w, nb * GEMM_BLOCK + s * GEMM_FEATURES, codes, sc, sc + groups * GEMM_FEATURES);
            }
            for (int64_t m = 0; m < M; m += GEMM_ROWS)
                for (int64_t s = 0; s < subs; ++s) {
                    const int64_t n0 = nb * GEMM_BLOCK + s * GEMM_FEATURES;
                    if (n0 >= N) break;
                    const uint8_t *codes = block + s * sub_bytes;
                    const float *sc = (const float *)(codes + K * GEMM_FEATURES);
                    gemm_tile(codes, sc, sc + groups * GEMM_FEATURES, &a, m, M - m < GEMM_ROWS ? M - m : GEMM_ROWS,
                              group, n0, N - n0 < GEMM_FEATURES ? N - n0 : GEMM_FEATURES, out, ldo, bias);
                }
        }
        free(block);
    }
    free(scratch);
    return failed ? -2 : 0;
#else
    (void)x, (void)M, (void)ldx, (void)codes, (void)scale, (void)offset, (void)N, (void)K, (void)bits, (void)group;
    (void)zero, (void)half, (void)bias, (void)out, (void)ldo;
    return -3;
#endif
}

/* One weight row into dst [K]: 16 values a step, each 16 sharing a group (G >= 16). */
static void dequantize_row(const QWeight *w, const uint8_t *c, const void *s, const void *o, float *dst) {
    const int64_t K = w->K, G = w->group;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (int64_t k = 0; k < K; k += 16) {
        __m128i bytes;
        if (w->bits == 8) {
            bytes = _mm_loadu_si128((const __m128i *)(c + k));
        } else {
            const __m128i packed = _mm_loadu_si128((const __m128i *)(c + (k / 64) * 32 + (k % 32)));
            bytes = _mm_and_si128(k % 64 < 32 ? packed : _mm_srli_epi16(packed, 4), _mm_set1_epi8(15));
        }
        const __m512 u = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
        const float sg = group_value_fast(w, s, k / G);
        const float og = o ? group_value_fast(w, o, k / G) : -(float)w->zero * sg;
        _mm512_storeu_ps(dst + k, o ? _mm512_fmadd_ps(u, _mm512_set1_ps(sg), _mm512_set1_ps(og))
                                    : _mm512_mul_ps(_mm512_sub_ps(u, _mm512_set1_ps((float)w->zero)), _mm512_set1_ps(sg)));
    }
#else
    for (int64_t k = 0; k < K; ++k) {
        const float u = (float)code_at(c, k, w->bits), sg = group_value(w, s, k / G);
        dst[k] = o ? sg * u + group_value(w, o, k / G) : sg * (u - (float)w->zero);
    }
#endif
}

/* The float32 weight rows `rows` [count] (or 0..count-1 when NULL) into out [count, K]: the
 * embedding's lookup, and a whole weight for the BLAS at prompt sizes. */
int quant_dequantize_f32(const uint8_t *codes, const void *scale, const void *offset, int64_t N, int64_t K,
                         int64_t bits, int64_t group, int64_t zero, int64_t half, const int64_t *rows, int64_t count,
                         float *out) {
    const QWeight w = {codes, scale, offset, N, K, bits, group, zero, half};
    if (!weight_valid(&w)) return -1;
    for (int64_t i = 0; i < count; ++i)
        if (rows ? rows[i] < 0 || rows[i] >= N : i >= N) return -2;
    const int64_t groups = K / group, rb = row_bytes(&w);
#pragma omp parallel for schedule(static) if (count * K >= 65536)
    for (int64_t i = 0; i < count; ++i) {
        const int64_t n = rows ? rows[i] : i;
        const uint8_t *c = codes + n * rb;
        dequantize_row(&w, c, group_row(&w, scale, n, groups), offset ? group_row(&w, offset, n, groups) : NULL,
                       out + i * K);
    }
    return 0;
}
