/*
 * out = x @ w.T for the few rows of a decode step (or a speculative verify), on CPU in
 * float32, straight from the weight's own [N, K] row-major layout.
 *
 * A BLAS packs the weight into its panel format on every call; at a few dozen rows that
 * copy costs as much as the multiply (measured: MKL spent 23% of a decode step in its
 * packing copy and 27% in its kernel). Here each output feature is a dot product along
 * K, which the weight's rows already hold contiguously. Every weight row is read from
 * memory once per call; features are split over OpenMP threads (torch's own workers,
 * see native_build.py).
 *
 * AVX-512 (the default build here): a tile is 4 features x up to 6 rows (2 features x up
 * to 12 rows for 7-16 rows, see pair_rows), up to 24 vector
 * accumulators over K (masked loads take K's tail), the 4 features' sums reduced
 * together and stored as one vector. While the first row block of a weight quad is
 * multiplied, the quad two ahead is prefetched into L2: without it the multiply and the
 * weight stream took turns (measured on the 2-core dev machine, cold weights, the default
 * model's 121 matmuls: 8 rows 47 -> 29 ms, 32 rows 97 -> 57 ms; 6-row tiles over 4-row ones
 * another 3-8% at 5 rows and more). Into L2, not L1: prefetching into L1 evicted the rows
 * of x and the quad in use (`python -m bench.bench_matmul --against` the L1 version: 1.5x
 * at 4-8 rows, 1.4x at 16, 1.2x at 32). The first row block also pulls its own quad four
 * lines ahead from L2 into L1 (while it prefetches the quad two ahead, i.e. not in a call's
 * last two quads): its weight loads had waited on L2 (3-12% faster at 3-12 rows, unchanged
 * from 24 up). At 1-3 rows a pass per feature with two FMA chains per row
 * streams the weight fastest (memory-bound: ~17 ms at 1 row, 14-17 at 2 on a slow day;
 * at 3 rows 0.85x the quads' time on 2026-12-01).
 * AVX2 + FMA only: 3-feature x 4-row tiles with 8-lane accumulators.
 *
 * Requires K % 8 == 0; the caller uses torch elsewhere.
 *   x   [M, K] rows `ldx` floats apart      w [N, K] contiguous
 *   out [M, N] rows `ldo` floats apart      bias [N] or NULL
 */
#include <stdint.h>

#include "reduce.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* One feature for R <= 3 rows: its weight row read once, two FMA chains per row (one chain
 * waits on the FMA latency: at 2-3 rows that, not the weight stream, set the pace). */
static inline __attribute__((always_inline)) void feature_rows(const float *x, int64_t ldx, const float *w, int64_t K,
                                                              float bias, float *out, int64_t ldo, const int R) {
    __m256 a[3][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 v0 = _mm256_loadu_ps(w + k), v1 = _mm256_loadu_ps(w + k + 8);
        for (int r = 0; r < R; ++r) {
            a[r][0] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(x + r * ldx + k), a[r][0]);
            a[r][1] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(x + r * ldx + k + 8), a[r][1]);
        }
    }
    if (k < K) {  /* K % 16 == 8 */
        const __m256 v0 = _mm256_loadu_ps(w + k);
        for (int r = 0; r < R; ++r) a[r][0] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(x + r * ldx + k), a[r][0]);
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = hsum8(_mm256_add_ps(a[r][0], a[r][1])) + bias;
}

/* Features [from, to) of every row, three rows at a time. */
static inline void dots(const float *x, int64_t M, int64_t ldx, const float *w, int64_t from, int64_t to, int64_t K,
                        const float *bias, float *out, int64_t ldo) {
    for (int64_t i = from; i < to; ++i) {
        const float b = bias ? bias[i] : 0.0f;
        for (int64_t m = 0; m < M; m += 3) {
            const float *xm = x + m * ldx, *wi = w + i * K;
            float *om = out + m * ldo + i;
            switch (M - m) {
                case 1: feature_rows(xm, ldx, wi, K, b, om, ldo, 1); break;
                case 2: feature_rows(xm, ldx, wi, K, b, om, ldo, 2); break;
                default: feature_rows(xm, ldx, wi, K, b, om, ldo, 3); break;
            }
        }
    }
}
#endif

int skinny_linear_available(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* The most rows for which this build beats MKL on the default model's shapes (measured on the
 * 2-core dev machine: AVX-512 1.07-1.3x up to 128 rows, 0.86x at 192; AVX2 1.2x at 32). */
int skinny_linear_max_rows(void) {
#if defined(__AVX512F__)
    return 128;
#else
    return 32;
#endif
}

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)

/* One K step of a tile: the quad's 16 lanes times R rows (R <= 6: 24 accumulators, 4 weight
 * vectors and the row's vector fit AVX-512's 32 registers). */
#define TILE_STEP(LOAD, R)                                                                                     \
    do {                                                                                                     \
        __m512 v[4];                                                                                         \
        _Pragma("GCC unroll 4") for (int f = 0; f < 4; ++f) v[f] = LOAD(w + f * K + k);                     \
        if (next) {                                                                                          \
            _Pragma("GCC unroll 4") for (int f = 0; f < 4; ++f)                                              \
                _mm_prefetch((const char *)(next + f * K + k), _MM_HINT_T1);                                 \
            _Pragma("GCC unroll 4") for (int f = 0; f < 4; ++f)                                              \
                _mm_prefetch((const char *)(w + f * K + k + 64), _MM_HINT_T0);                               \
        }                                                                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {                                                \
            const __m512 u = LOAD(x + r * ldx + k);                                                          \
            _Pragma("GCC unroll 4") for (int f = 0; f < 4; ++f) acc[r][f] = _mm512_fmadd_ps(v[f], u, acc[r][f]); \
        }                                                                                                    \
    } while (0)

#define LOAD_FULL(p) _mm512_loadu_ps(p)
#define LOAD_TAIL(p) _mm512_maskz_loadu_ps(tail, p)

/* Features n..n+3 (w points at n's row) for rows m..m+R-1; prefetches `next` (or not, NULL). */
#define DEFINE_TILE(R)                                                                                       \
    static void tile4x##R(const float *x, int64_t ldx, const float *w, int64_t K, float *out, int64_t ldo,  \
                          const float *bias, const float *next) {                                            \
        __m512 acc[R][4];                                                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)                                                  \
            _Pragma("GCC unroll 4") for (int f = 0; f < 4; ++f) acc[r][f] = _mm512_setzero_ps();             \
        int64_t k = 0;                                                                                       \
        for (; k + 16 <= K; k += 16) TILE_STEP(LOAD_FULL, R);                                                \
        if (k < K) {                                                                                         \
            const __mmask16 tail = (__mmask16)((1u << (K - k)) - 1);                                         \
            TILE_STEP(LOAD_TAIL, R);                                                                         \
        }                                                                                                    \
        const __m128 b = bias ? _mm_loadu_ps(bias) : _mm_setzero_ps();                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)                                                  \
            _mm_storeu_ps(out + r * ldo, _mm_add_ps(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), b));   \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)

/* One K step of a pair tile: 2 features times R <= 12 rows (up to 24 accumulators). */
#define PAIR_STEP(LOAD, R)                                                                                     \
    do {                                                                                                     \
        const __m512 v0 = LOAD(w + k), v1 = LOAD(w + K + k);                                                 \
        if (next) {                                                                                          \
            _mm_prefetch((const char *)(next + k), _MM_HINT_T1);                                             \
            _mm_prefetch((const char *)(next + K + k), _MM_HINT_T1);                                         \
            _mm_prefetch((const char *)(w + k + 64), _MM_HINT_T0);                                           \
            _mm_prefetch((const char *)(w + K + k + 64), _MM_HINT_T0);                                       \
        }                                                                                                    \
        _Pragma("GCC unroll 12") for (int r = 0; r < R; ++r) {                                               \
            const __m512 u = LOAD(x + r * ldx + k);                                                          \
            acc[r][0] = _mm512_fmadd_ps(v0, u, acc[r][0]);                                                   \
            acc[r][1] = _mm512_fmadd_ps(v1, u, acc[r][1]);                                                   \
        }                                                                                                    \
    } while (0)

/* Features n, n+1 (w points at n's row) for rows m..m+R-1 in one pass over the weight. */
#define DEFINE_PAIR(R)                                                                                       \
    static void tile2x##R(const float *x, int64_t ldx, const float *w, int64_t K, float *out, int64_t ldo,  \
                          const float *bias, const float *next) {                                            \
        __m512 acc[R][2];                                                                                    \
        _Pragma("GCC unroll 12") for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();    \
        int64_t k = 0;                                                                                       \
        for (; k + 16 <= K; k += 16) PAIR_STEP(LOAD_FULL, R);                                                \
        if (k < K) {                                                                                         \
            const __mmask16 tail = (__mmask16)((1u << (K - k)) - 1);                                         \
            PAIR_STEP(LOAD_TAIL, R);                                                                         \
        }                                                                                                    \
        const float b0 = bias ? bias[0] : 0.0f, b1 = bias ? bias[1] : 0.0f;                                  \
        _Pragma("GCC unroll 12") for (int r = 0; r < R; ++r) {                                               \
            out[r * ldo] = _mm512_reduce_add_ps(acc[r][0]) + b0;                                             \
            out[r * ldo + 1] = _mm512_reduce_add_ps(acc[r][1]) + b1;                                         \
        }                                                                                                    \
    }
DEFINE_PAIR(1)
DEFINE_PAIR(2)
DEFINE_PAIR(3)
DEFINE_PAIR(4) /* 1-4: what a second pass over 13-16 rows leaves */
DEFINE_PAIR(7)
DEFINE_PAIR(8)
DEFINE_PAIR(9)
DEFINE_PAIR(10)
DEFINE_PAIR(11)
DEFINE_PAIR(12)

/* 7-16 rows: pairs of features, up to 12 rows a pass. A quad's second row block re-read its
 * weights from L2 (24 KB at K = 1536 with 9 rows of x did not stay in L1); a pair's first
 * pass takes up to 12 rows and what is left re-reads only half as much. Measured with
 * bench_matmul --against the quads-only kernel: 0.72x the time at 8 rows, 0.67x at 9,
 * 0.73x at 12, 0.76x at 13, 0.85x at 16; 0.96x at 20 and 1.15x at 24 (so quads from 17 up),
 * 1.04-1.10x at 3-5 rows (so quads at 4-6). 7-9 rows are a speculative verify's. */
static void pair_rows(const float *x, int64_t M, int64_t ldx, const float *w, int64_t N, int64_t K,
                      const float *bias, float *out, int64_t ldo) {
    const int64_t pairs = N / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t n = 2 * p;
        const float *wp = w + n * K, *bp = bias ? bias + n : 0, *next = p + 4 < pairs ? wp + 8 * K : 0;
        for (int64_t m = 0; m < M; m += 12, next = 0) {
            const float *xm = x + m * ldx;
            float *op = out + m * ldo + n;
            switch (M - m < 12 ? M - m : 12) {
                case 1: tile2x1(xm, ldx, wp, K, op, ldo, bp, next); break;
                case 2: tile2x2(xm, ldx, wp, K, op, ldo, bp, next); break;
                case 3: tile2x3(xm, ldx, wp, K, op, ldo, bp, next); break;
                case 4: tile2x4(xm, ldx, wp, K, op, ldo, bp, next); break;
                case 7: tile2x7(xm, ldx, wp, K, op, ldo, bp, next); break;
                case 8: tile2x8(xm, ldx, wp, K, op, ldo, bp, next); break;
                case 9: tile2x9(xm, ldx, wp, K, op, ldo, bp, next); break;
                case 10: tile2x10(xm, ldx, wp, K, op, ldo, bp, next); break;
                case 11: tile2x11(xm, ldx, wp, K, op, ldo, bp, next); break;
                default: tile2x12(xm, ldx, wp, K, op, ldo, bp, next); break;
            }
        }
    }
    dots(x, M, ldx, w, 2 * pairs, N, K, bias, out, ldo);
}

int skinny_linear_f32(const float *x, int64_t M, int64_t ldx, const float *w, int64_t N, int64_t K,
                      const float *bias, float *out, int64_t ldo) {
    if (K % 8) return -1;
    if (M >= 7 && M <= 16) {
        pair_rows(x, M, ldx, w, N, K, bias, out, ldo);
        return 0;
    }
    const int64_t quads = M <= 3 ? 0 : N / 4;
    if (quads == 0) {  /* the weight stream is the whole cost: one pass per feature */
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < N; ++i) dots(x, M, ldx, w, i, i + 1, K, bias, out, ldo);
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < quads; ++q) {
        const int64_t n = 4 * q;
        const float *wq = w + n * K, *bq = bias ? bias + n : 0;
        const float *next = q + 2 < quads ? wq + 8 * K : 0;  /* for the first row block only */
        int64_t m = 0;
        for (; m + 6 <= M; m += 6, next = 0) tile4x6(x + m * ldx, ldx, wq, K, out + m * ldo + n, ldo, bq, next);
        const float *xm = x + m * ldx;
        float *om = out + m * ldo + n;
        switch (M - m) {
            case 5: tile4x5(xm, ldx, wq, K, om, ldo, bq, next); break;
            case 4: tile4x4(xm, ldx, wq, K, om, ldo, bq, next); break;
            case 3: tile4x3(xm, ldx, wq, K, om, ldo, bq, next); break;
            case 2: tile4x2(xm, ldx, wq, K, om, ldo, bq, next); break;
            case 1: tile4x1(xm, ldx, wq, K, om, ldo, bq, next); break;
            default: break;
        }
    }
    dots(x, M, ldx, w, 4 * quads, N, K, bias, out, ldo);
    return 0;
}

#elif defined(__AVX2__) && defined(__FMA__)

/* One feature for one row, 8 lanes at a time. */
static float dot8(const float *a, const float *b, int64_t K) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 t = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(t, t));
}


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
            for (int64_t i = n; i < n + 3; ++i) out[m * ldo + i] = dot8(x + m * ldx, w + i * K, K) + (bias ? bias[i] : 0.0f);
    }
    for (int64_t i = 3 * triples; i < N; ++i)
        for (int64_t m = 0; m < M; ++m) out[m * ldo + i] = dot8(x + m * ldx, w + i * K, K) + (bias ? bias[i] : 0.0f);
    return 0;
}
#else
int skinny_linear_f32(const float *x, int64_t M, int64_t ldx, const float *w, int64_t N, int64_t K,
                      const float *bias, float *out, int64_t ldo) {
    (void)x, (void)M, (void)ldx, (void)w, (void)N, (void)K, (void)bias, (void)out, (void)ldo;
    return -1; /* no vector units to beat the BLAS with: the caller falls back to torch */
}
#endif
