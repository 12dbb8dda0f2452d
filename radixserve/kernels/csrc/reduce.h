/*
 * Horizontal sums shared by the matmul kernels (skinny_linear.c, quant_linear.c): one float of
 * an 8-lane vector, and four 16-lane vectors summed into one 4-lane vector at once.
 */
#ifndef RADIXSERVE_REDUCE_H
#define RADIXSERVE_REDUCE_H

#if defined(__AVX2__)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(t, t));
}
#endif

#if defined(__AVX512F__)
/* [sum a, sum b, sum c, sum d] of four 16-lane vectors. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
#endif

#endif
