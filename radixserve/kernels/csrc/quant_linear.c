/*
 * out = x @ w.T for a weight stored as small unsigned codes in groups (radixserve's one
 * repacked layout for every GGUF block type and for int8/int4 quantized checkpoints,
 * kernels/quant_linear.py):
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
 * Two layouts of the same codes and values: one feature a row (above: what model/gguf_repack.py
 * makes and quantized.safetensors keeps), read by the AVX2 path (codes widened to 16 bits against
 * the 16-bit activations 256 xq + xr, vpmaddwd; up to 8 rows share each load of the codes, and a
 * single row a few features each load of its activations) and the scalar one; and the lanes
 * layout (features across the
 * vector lanes, 32 a block: the AVX512-VNNI section below), into which kernels/quant_linear.py
 * moves every weight once at load on a CPU with AVX512-VNNI, for vpdpbusd's u8 x s8 products
 * at every row count. `path` chooses (0: the best this build has for the layout; 1: AVX2;
 * 2: scalar) so the tests run each one here. float16 scales are widened where they are read:
 * by vcvtph2ps in the vector paths, by half_to_float (exact, portable) in the scalar code.
 *
 * Features are split over OpenMP threads (torch's own workers, see native_build.py).
 */
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "quant_dot.h"

static void quantize_rows(const float *x, int64_t ldx, QActs *a, int64_t group) {
#pragma omp parallel for schedule(static) if (a->M * a->K >= 65536)
    for (int64_t r = 0; r < a->M; ++r) quantize_acts_row(x + r * ldx, a, r, group);
}

/* Many rows, one feature a row: the features in blocks whose codes stay in L2 (a thread's share of
 * the blocks), and in each block the rows a tile at a time, each tile against every feature of
 * the block: a tile's activations stay in L1 while the block's codes pass, where one feature
 * against all the rows read every row's activations from L3 again for each feature (prompt-sized
 * calls ran at a third of the 8-row tile's rate). Each row's result is the one every other
 * order gives (the paths' sums do not depend on the rows beside). */
#define AVX2_ROWS_TILE 8
#define BLOCK_CODE_BYTES (192 * 1024)

static void rows_outer(const QWeight *w, const QActs *a, float *out, int64_t ldo, const float *bias, int64_t path) {
#if defined(_OPENMP)
    const int64_t threads = omp_get_max_threads();
#else
    const int64_t threads = 1;
#endif
    const int64_t step = feature_step(w);
    int64_t per = BLOCK_CODE_BYTES / row_bytes(w); /* features a block */
    const int64_t balanced = (w->N + 4 * threads - 1) / (4 * threads); /* at least 4 blocks a thread */
    per = per < balanced ? per : balanced;
    per = per < step ? step : (per + step - 1) / step * step;
    const int64_t blocks = (w->N + per - 1) / per;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t n0 = blk * per, n1 = n0 + per < w->N ? n0 + per : w->N;
        for (int64_t r0 = 0; r0 < a->M; r0 += AVX2_ROWS_TILE) {
            const QActs tile = acts_rows(a, r0, a->M - r0 < AVX2_ROWS_TILE ? a->M - r0 : AVX2_ROWS_TILE);
            product_features(w, &tile, n0, n1, out + r0 * ldo, ldo, bias, path);
        }
    }
}

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
 * scale and offset float16 where half is 1, float32 where 0; codes, scale and offset in the
 * lanes layout where lanes is 1 (only path 0 of a build with AVX512-VNNI reads it), else one
 * feature a row (path 0: the best of AVX2 and scalar this build has).
 * Returns 0; -1 for shapes or a layout the path refuses, -2 when scratch memory cannot be had,
 * -3 for a path this build lacks. */
int quant_linear_f32(const float *x, int64_t M, int64_t ldx, const uint8_t *codes, const void *scale,
                     const void *offset, int64_t N, int64_t K, int64_t bits, int64_t group, int64_t zero,
                     int64_t half, int64_t lanes, const float *bias, float *out, int64_t ldo, int64_t path) {
    const QWeight w = {codes, scale, offset, N, K, bits, group, zero, half, lanes};
    if (!weight_valid(&w) || M <= 0 || (lanes && path != 0)) return -1;
#if !defined(HAVE_VNNI)
    if (lanes) return -3;
#endif
#if !defined(__AVX2__)
    if (path == 1) return -3;
#endif
    char *scratch = malloc(acts_bytes(M, K, K / group)), *p = scratch;
    if (!scratch) return -2;
    QActs a = acts_at(&p, M, K, group);
    quantize_rows(x, ldx, &a, group);
    if (!lanes && M > AVX2_ROWS_TILE) {
        rows_outer(&w, &a, out, ldo, bias, path);
    } else {
        const int64_t step = feature_step(&w), chunks = (N + step - 1) / step;
#pragma omp parallel for schedule(static)
        for (int64_t c = 0; c < chunks; ++c)
            product_features(&w, &a, c * step, c * step + step < N ? c * step + step : N, out, ldo, bias, path);
    }
    free(scratch);
    return 0;
}

/* Codes k .. k + 15 (k a multiple of 16) of a feature whose codes start at c: one feature a
 * row, or (lanes) c = its block's codes + 4 * its lane. */
static inline void codes16(const QWeight *w, const uint8_t *c, int64_t k, uint8_t u[16]) {
    if (w->lanes && w->bits == 8) {
        for (int s = 0; s < 4; ++s) memcpy(u + 4 * s, c + (k / 4 + s) * 4 * LANES, 4);
    } else if (w->lanes) {
        for (int s = 0; s < 2; ++s) {
            uint32_t d;
            memcpy(&d, c + (k / 8 + s) * 4 * LANES, 4);
            const uint32_t lo = d & 0x0F0F0F0Fu, hi = (d >> 4) & 0x0F0F0F0Fu;
            memcpy(u + 8 * s, &lo, 4), memcpy(u + 8 * s + 4, &hi, 4);
        }
    } else {
        for (int i = 0; i < 16; ++i) u[i] = (uint8_t)code_at(c, k + i, w->bits);
    }
}

/* One weight row into dst [K], 16 values a step (each 16 sharing a group: G >= 16); its group
 * values at s[g * stride], o[g * stride]. */
static void dequantize_row(const QWeight *w, const uint8_t *c, const void *s, const void *o, int64_t stride,
                           float *dst) {
    const int64_t K = w->K, G = w->group;
    for (int64_t k = 0; k < K; k += 16) {
        uint8_t u[16];
        codes16(w, c, k, u);
        const float sg = group_value_fast(w, s, k / G * stride);
        const float og = o ? group_value_fast(w, o, k / G * stride) : -(float)w->zero * sg;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)u)));
        _mm512_storeu_ps(dst + k, _mm512_fmadd_ps(v, _mm512_set1_ps(sg), _mm512_set1_ps(og)));
#else
        for (int i = 0; i < 16; ++i) dst[k + i] = sg * (float)u[i] + og;
#endif
    }
}

/* Row n of the weight into dst [K], in either layout. */
static void dequantize_row_n(const QWeight *w, int64_t n, float *dst) {
    const int64_t groups = w->K / w->group, rb = row_bytes(w), scale_bytes = w->half ? 2 : 4;
    const uint8_t *c = w->codes + n * rb;
    int64_t first = n * groups, stride = 1; /* row n's first group value, and the next one's distance */
    if (w->lanes) {
        const int64_t block = n / LANES, lane = n % LANES;
        c = w->codes + block * rb * LANES + 4 * lane, first = block * groups * LANES + lane, stride = LANES;
    }
    dequantize_row(w, c, (const char *)w->scale + first * scale_bytes,
                   w->offset ? (const char *)w->offset + first * scale_bytes : NULL, stride, dst);
}

/* The float32 weight rows `rows` [count] (or 0..count-1 when NULL) into out [count, K]: the
 * embedding's lookup, and a whole weight for the BLAS at prompt sizes. */
int quant_dequantize_f32(const uint8_t *codes, const void *scale, const void *offset, int64_t N, int64_t K,
                         int64_t bits, int64_t group, int64_t zero, int64_t half, int64_t lanes, const int64_t *rows,
                         int64_t count, float *out) {
    const QWeight w = {codes, scale, offset, N, K, bits, group, zero, half, lanes};
    if (!weight_valid(&w)) return -1;
    for (int64_t i = 0; i < count; ++i)
        if (rows ? rows[i] < 0 || rows[i] >= N : i >= N) return -2;
#pragma omp parallel for schedule(static) if (count * K >= 65536)
    for (int64_t i = 0; i < count; ++i) dequantize_row_n(&w, rows ? rows[i] : i, out + i * K);
    return 0;
}
