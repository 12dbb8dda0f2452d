/*
 * out = x @ w.T for the few rows of a decode step, on CPU in float32, straight from the
 * weight's own [N, K] row-major layout.
 *
 * A BLAS packs the weight into its panel format on every call; at a few dozen rows that
 * copy costs as much as the multiply (measured: MKL spent 23% of a decode step in its
 * packing copy and 27% in its kernel). Here each output feature is a dot product along
 * K, which the weight's rows already hold contiguously: a 3-feature x 4-row tile keeps
 * 12 vector accumulators over K (3 weight rows in L1, 4 input rows in L1/L2), and sums
 * each accumulator's 8 lanes at the end. Every weight row is read from memory once, and
 * asked for one triple ahead (measured: 65 -> 80 GFLOPS at 32 rows, the loads of cold
 * weights were the stall). Features are split over OpenMP threads (torch's own workers,
 * see native_build.py).
 *
 * Requires AVX2 + FMA and K % 8 == 0; the caller uses torch elsewhere.
 *   x   [M, K] rows `ldx` floats apart      w [N, K] contiguous
 *   out [M, N] rows `ldo` floats apart      bias [N] or NULL
 */
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The 4 lane-sums of a, b, c, d as one vector. */
static inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

static inline void store4(float *out, int64_t ldo, __m128 v, float bias) {
    float s[4];
    _mm_storeu_ps(s, v);
    for (int j = 0; j < 4; ++j) out[j * ldo] = s[j] + bias;
}

/* Features n..n+2 for rows m..m+3. */
static void tile_3x4(const float *x, int64_t ldx, const float *w, int64_t K, float *out, int64_t ldo,
                     const float *bias) {
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K;
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (int64_t k = 0; k < K; k += 8) {
        const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k), v2 = _mm256_loadu_ps(w2 + k);
        __m256 u = _mm256_loadu_ps(x0 + k);
        a00 = _mm256_fmadd_ps(v0, u, a00), a10 = _mm256_fmadd_ps(v1, u, a10), a20 = _mm256_fmadd_ps(v2, u, a20);
        u = _mm256_loadu_ps(x1 + k);
        a01 = _mm256_fmadd_ps(v0, u, a01), a11 = _mm256_fmadd_ps(v1, u, a11), a21 = _mm256_fmadd_ps(v2, u, a21);
        u = _mm256_loadu_ps(x2 + k);
        a02 = _mm256_fmadd_ps(v0, u, a02), a12 = _mm256_fmadd_ps(v1, u, a12), a22 = _mm256_fmadd_ps(v2, u, a22);
        u = _mm256_loadu_ps(x3 + k);
        a03 = _mm256_fmadd_ps(v0, u, a03), a13 = _mm256_fmadd_ps(v1, u, a13), a23 = _mm256_fmadd_ps(v2, u, a23);
    }
    store4(out, ldo, sum4(a00, a01, a02, a03), bias ? bias[0] : 0.0f);
    store4(out + 1, ldo, sum4(a10, a11, a12, a13), bias ? bias[1] : 0.0f);
    store4(out + 2, ldo, sum4(a20, a21, a22, a23), bias ? bias[2] : 0.0f);
}

/* One feature for one row: the edges the 3x4 tiles leave. */
static float dot(const float *a, const float *b, int64_t K) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 t = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(t, t));
}

int skinny_linear_available(void) { return 1; }

int skinny_linear_f32(const float *x, int64_t M, int64_t ldx, const float *w, int64_t N, int64_t K,
                      const float *bias, float *out, int64_t ldo) {
    if (K % 8) return -1;
    const int64_t triples = N / 3, full_rows = M - M % 4;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < triples; ++t) {
        const int64_t n = 3 * t;
        /* The next triple's weights come from memory while this one is multiplied: each
         * row block asks for its share of them before its tile. */
        const float *next = w + (n + 3) * K;
        const int64_t share = t + 1 < triples && full_rows ? (3 * K + full_rows / 4 - 1) / (full_rows / 4) : 0;
        for (int64_t m = 0; m < full_rows; m += 4) {
            for (int64_t i = (m / 4) * share; i < (m / 4 + 1) * share && i < 3 * K; i += 16) __builtin_prefetch(next + i);
            tile_3x4(x + m * ldx, ldx, w + n * K, K, out + m * ldo + n, ldo, bias ? bias + n : 0);
        }
        for (int64_t m = full_rows; m < M; ++m)
            for (int64_t i = n; i < n + 3; ++i) out[m * ldo + i] = dot(x + m * ldx, w + i * K, K) + (bias ? bias[i] : 0.0f);
    }
    for (int64_t i = 3 * triples; i < N; ++i)
        for (int64_t m = 0; m < M; ++m) out[m * ldo + i] = dot(x + m * ldx, w + i * K, K) + (bias ? bias[i] : 0.0f);
    return 0;
}
#else
int skinny_linear_available(void) { return 0; }

int skinny_linear_f32(const float *x, int64_t M, int64_t ldx, const float *w, int64_t N, int64_t K,
                      const float *bias, float *out, int64_t ldo) {
    (void)x, (void)M, (void)ldx, (void)w, (void)N, (void)K, (void)bias, (void)out, (void)ldo;
    return -1; /* no vector units to beat the BLAS with: the caller falls back to torch */
}
#endif
