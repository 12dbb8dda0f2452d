/*
 * Paged decode attention on CPU: one query token per request, reading K and V straight
 * out of the block pool through each request's block table (no gather, no copy).
 *
 * Work unit: one request. Its context is walked token by token in the pool's own order,
 * so each K/V row (all KV heads of one token, contiguous) is read once, whole. Pass 1
 * computes every query head's scores, pass 2 turns them into softmax weights, pass 3
 * accumulates the weighted V rows. Query head h reads KV head h / (num_heads / num_kv_heads).
 * The caller splits the requests across threads.
 *
 * Layouts (float32, contiguous):
 *   q, out           [num_requests, num_heads, head_dim]
 *   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables     [num_requests, table_stride] int32
 *   seq_lens         [num_requests] int32 (context length, >= 1)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(_mm_hadd_ps(lo, lo));
}
static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    float s = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}
#else
static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}
#endif
static inline void axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}
static void attend_request(const float *q, const float *k_cache, const float *v_cache,
                           const int32_t *table, int64_t len, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale, float *scores, float *out) {
    const int64_t row = num_kv_heads * head_dim, group = num_heads / num_kv_heads;
    for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
        const float *k = k_cache + slot * row;
        for (int64_t h = 0; h < num_heads; ++h)
            scores[h * len + t] = dot(q + h * head_dim, k + (h / group) * head_dim, head_dim) * scale;
    }
    float *inv = scores + num_heads * len;
    for (int64_t h = 0; h < num_heads; ++h) {
        float *s = scores + h * len, m = s[0], sum = 0.0f;
        for (int64_t t = 1; t < len; ++t) m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < len; ++t) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        inv[h] = 1.0f / sum;
    }
    memset(out, 0, sizeof(float) * num_heads * head_dim);
    for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
        const float *v = v_cache + slot * row;
        for (int64_t h = 0; h < num_heads; ++h)
            axpy(out + h * head_dim, scores[h * len + t], v + (h / group) * head_dim, head_dim);
    }
    for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t i = 0; i < head_dim; ++i) out[h * head_dim + i] *= inv[h];
}
/* Attend for requests [begin, end); returns 0, or -1 when scratch memory cannot be had. */
int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t table_stride,
                               const int32_t *seq_lens, float *out, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                               float scale, int64_t begin, int64_t end) {
    int64_t longest = 1;
    for (int64_t r = begin; r < end; ++r) longest = seq_lens[r] > longest ? seq_lens[r] : longest;
    float *scores = (float *)malloc(sizeof(float) * num_heads * (longest + 1));
    if (!scores) return -1;
    for (int64_t r = begin; r < end; ++r)
        attend_request(q + r * num_heads * head_dim, k_cache, v_cache, block_tables + r * table_stride,
                       seq_lens[r], num_heads, num_kv_heads, head_dim, block_size, scale, scores,
                       out + r * num_heads * head_dim);
    free(scores);
    return 0;
}
