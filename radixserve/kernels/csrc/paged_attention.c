/*
 * Paged KV on CPU, float32: writing a step's new K/V rows into their pool slots, and
 * decode attention (one query token per request) reading K and V straight out of the
 * block pool through each request's block table (no gather, no copy).
 *
 * Requests are taken in groups: neighbours whose block tables start with the same
 * physical blocks (prefix-cache hits on one system prompt, forks of one program) attend
 * to those shared blocks together, so a shared block is read from memory once per group
 * and then reused from L1 by every query head of every member. Each member then walks
 * its own remaining blocks alone. The caller puts requests that share a prefix next to
 * each other (the runner orders decodes by block table). Groups are spread over OpenMP
 * threads (torch's own workers, see native_build.py).
 *
 * Softmax is online (flash-decoding style): every query row keeps its running max m,
 * running sum l and an unnormalised output acc; each block of keys rescales them once.
 * Query head h reads KV head h / (num_heads / num_kv_heads).
 *
 * Layouts (float32, contiguous):
 *   q, out           [num_requests, num_heads, head_dim]
 *   k, v (new rows)  [tokens, num_kv_heads, head_dim]
 *   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables     [num_requests, table_stride] int32
 *   seq_lens         [num_requests] int32 (context length, >= 1)
 *   slots            [tokens] int64 (block * block_size + offset)
 *
 * int8 pages (the _i8 entry points; kernels/int8_pages.py): k_pages, v_pages are
 * [num_blocks, page_bytes] bytes, each page int8 codes [block_size, num_kv_heads, head_dim]
 * then, from code_bytes on, float32 scales [block_size, num_kv_heads]. The store quantizes
 * each token's head (scale = max|x| / 127, codes rounded half away from zero); decode
 * dequantizes one block's rows of one KV head into an L1 tile, which every query head of
 * the group then reads as float32 rows, so a block is converted once per group.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_GROUP 16 /* members per group: their running state stays in L2 */
#define PREFETCH_BLOCKS 2

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR_PATH 1
/* The 8 dot products of q with 8 key rows `stride` floats apart, as one vector. */
static inline __m256 dot_8_keys(const float *q, const float *k, int64_t stride, int64_t head_dim) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + stride + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * stride + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * stride + d), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 4 * stride + d), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 5 * stride + d), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 6 * stride + d), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 7 * stride + d), a7);
    }
    const __m256 lo4 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 hi4 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(lo4, hi4, 0x20), _mm256_permute2f128_ps(lo4, hi4, 0x31));
}
static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
/* acc = acc * alpha + sum_t p[t] * v[t], head_dim floats, v rows `stride` apart. Eight
 * independent accumulators per pass keep the FMA units busy despite their latency. */
static inline void accumulate(float *acc, float alpha, const float *p, const float *v, int64_t ntok,
                              int64_t stride, int64_t head_dim) {
    const __m256 a = _mm256_set1_ps(alpha);
    int64_t d = 0;
    for (; d + 64 <= head_dim; d += 64) {
        __m256 o[8];
        for (int i = 0; i < 8; ++i) o[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 8 * i), a);
        for (int64_t t = 0; t < ntok; ++t) {
            const __m256 w = _mm256_set1_ps(p[t]);
            const float *x = v + t * stride + d;
            for (int i = 0; i < 8; ++i) o[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * i), o[i]);
        }
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + d + 8 * i, o[i]);
    }
    for (; d < head_dim; d += 8) {
        __m256 even = _mm256_mul_ps(_mm256_loadu_ps(acc + d), a), odd = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 2 <= ntok; t += 2) {
            even = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(v + t * stride + d), even);
            odd = _mm256_fmadd_ps(_mm256_set1_ps(p[t + 1]), _mm256_loadu_ps(v + (t + 1) * stride + d), odd);
        }
        if (t < ntok) even = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(v + t * stride + d), even);
        _mm256_storeu_ps(acc + d, _mm256_add_ps(even, odd));
    }
}
#else
#define VECTOR_PATH 0
static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}
#endif

static void accumulate_scalar(float *acc, float alpha, const float *p, const float *v, int64_t ntok,
                              int64_t stride, int64_t head_dim) {
    for (int64_t d = 0; d < head_dim; ++d) acc[d] *= alpha;
    for (int64_t t = 0; t < ntok; ++t)
        for (int64_t d = 0; d < head_dim; ++d) acc[d] += p[t] * v[t * stride + d];
}

/* One query row against ntok keys/values `stride` floats apart: fold them into the row's
 * running (m, l, acc). s is scratch for ntok scores. */
static void attend_keys(const float *q, const float *k, const float *v, int64_t ntok, int64_t stride,
                        int64_t head_dim, float scale, float *m, float *l, float *acc, float *s) {
    int64_t t = 0;
#if VECTOR_PATH
    const int vector = head_dim % 8 == 0;
    if (vector)
        for (; t + 8 <= ntok; t += 8)
            _mm256_storeu_ps(s + t, _mm256_mul_ps(dot_8_keys(q, k + t * stride, stride, head_dim), _mm256_set1_ps(scale)));
#else
    const int vector = 0;
#endif
    for (; t < ntok; ++t) {
        const float *kt = k + t * stride;
        float x = 0.0f;
        if (vector) x = dot(q, kt, head_dim);
        else
            for (int64_t d = 0; d < head_dim; ++d) x += q[d] * kt[d];
        s[t] = x * scale;
    }
    float top = *m;
    for (t = 0; t < ntok; ++t) top = s[t] > top ? s[t] : top;
    float sum = 0.0f;
    for (t = 0; t < ntok; ++t) {
        s[t] = expf(s[t] - top);
        sum += s[t];
    }
    const float alpha = expf(*m - top); /* 0 on the first block, where *m is -FLT_MAX */
    *l = *l * alpha + sum;
    *m = top;
#if VECTOR_PATH
    if (vector) {
        accumulate(acc, alpha, s, v, ntok, stride, head_dim);
        return;
    }
#endif
    accumulate_scalar(acc, alpha, s, v, ntok, stride, head_dim);
}

typedef struct {
    const char *k_pages, *v_pages; /* block b's K/V start at b * page_bytes */
    int64_t page_bytes, code_bytes; /* code_bytes: where an int8 page's scales start */
    int int8;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} Shape;

static Shape float_shape(const float *k_cache, const float *v_cache, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale) {
    const int64_t bytes = block_size * num_kv_heads * head_dim * (int64_t)sizeof(float);
    const Shape sh = {(const char *)k_cache, (const char *)v_cache, bytes, bytes, 0,
                      num_heads, num_kv_heads, head_dim, block_size, scale};
    return sh;
}

/* x [head_dim] -> codes and their scale (kernels/int8_pages.py's quantize). */
static void quantize_row(const float *x, int64_t head_dim, int8_t *codes, float *scale) {
    float amax = 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const float inv = amax > 0.0f ? 127.0f * (1.0f / amax) : 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) {
        const float y = x[d] * inv, c = floorf(fabsf(y) + 0.5f);
        const int q = (int)(c < 127.0f ? c : 127.0f);
        codes[d] = (int8_t)(y < 0.0f ? -q : q);
    }
    *scale = amax * (1.0f / 127.0f);
}

/* Rows of KV head j of an int8 page, dequantized: out [ntok][head_dim]. */
static void dequantize_rows(const Shape *sh, const char *page, int64_t j, int64_t ntok, float *out) {
    const int64_t h = sh->num_kv_heads, d = sh->head_dim;
    const int8_t *codes = (const int8_t *)page + j * d;
    const float *scales = (const float *)(page + sh->code_bytes) + j;
    for (int64_t t = 0; t < ntok; ++t) {
        const int8_t *c = codes + t * h * d;
        const float sc = scales[t * h];
        float *o = out + t * d;
        for (int64_t i = 0; i < d; ++i) o[i] = (float)c[i] * sc;
    }
}

/* Fold block `block` (its first ntok tokens) into the state of every query row of the
 * members [0, count) of a group; q and the state (m, l, acc) are laid out [count, num_heads].
 * tile: 2 * block_size * head_dim floats of scratch for int8 pages. */
static void attend_block(const Shape *sh, const float *q, int64_t count, int64_t block, int64_t ntok,
                         float *m, float *l, float *acc, float *s, float *tile) {
    const int64_t group = sh->num_heads / sh->num_kv_heads, dim = sh->head_dim;
    const char *kp = sh->k_pages + block * sh->page_bytes, *vp = sh->v_pages + block * sh->page_bytes;
    for (int64_t j = 0; j < sh->num_kv_heads; ++j) {
        const float *k, *v;
        int64_t row = sh->num_kv_heads * dim;
        if (sh->int8) {
            dequantize_rows(sh, kp, j, ntok, tile);
            dequantize_rows(sh, vp, j, ntok, tile + sh->block_size * dim);
            k = tile, v = tile + sh->block_size * dim, row = dim;
        } else {
            k = (const float *)kp + j * dim, v = (const float *)vp + j * dim;
        }
        for (int64_t r = 0; r < count; ++r)
            for (int64_t h = j * group; h < (j + 1) * group; ++h) {
                const int64_t i = r * sh->num_heads + h;
                attend_keys(q + i * dim, k, v, ntok, row, dim, sh->scale, m + i, l + i, acc + i * dim, s);
            }
    }
}

/* Ask for a block's keys and values (every KV head) into L2, PREFETCH_BLOCKS blocks before
 * they are read: a request's blocks lie anywhere in the pool, so the hardware's stream
 * prefetcher starts over at every block (measured on the 2-core dev machine, 8 requests of
 * ~330 tokens, cold pool, 30 layers: 8.9 -> 7.9 ms; into L1 instead of L2: 8.6 ms). */
static inline void prefetch_block(const Shape *sh, int64_t block) {
    const int64_t bytes = sh->page_bytes;
    const char *k = sh->k_pages + block * bytes, *v = sh->v_pages + block * bytes;
    for (int64_t o = 0; o < bytes; o += 64) {
        __builtin_prefetch(k + o, 0, 2);
        __builtin_prefetch(v + o, 0, 2);
    }
}

/* How many leading blocks requests [first, last) all hold, whole and identical. */
static int64_t shared_blocks(const int32_t *tables, int64_t stride, const int32_t *seq_lens, int64_t first,
                             int64_t last, int64_t block_size) {
    int64_t n = seq_lens[first] / block_size;
    for (int64_t r = first + 1; r < last && n > 0; ++r) {
        const int64_t full = seq_lens[r] / block_size;
        n = full < n ? full : n;
        int64_t b = 0;
        while (b < n && tables[first * stride + b] == tables[r * stride + b]) ++b;
        n = b;
    }
    return n;
}

/* The members of the group that starts at `first`: up to `cap` neighbours sharing its first block. */
static int64_t group_end(const int32_t *tables, int64_t stride, const int32_t *seq_lens, int64_t first,
                         int64_t end, int64_t block_size, int64_t cap) {
    int64_t last = first + 1;
    while (last < end && last - first < cap && seq_lens[last] >= block_size &&
           seq_lens[first] >= block_size && tables[last * stride] == tables[first * stride])
        ++last;
    return last;
}

static void attend_group(const Shape *sh, const float *q, const int32_t *tables, int64_t stride,
                         const int32_t *seq_lens, int64_t first, int64_t last, float *out, float *m,
                         float *l, float *acc, float *s, float *tile) {
    const int64_t count = last - first, rows = count * sh->num_heads, bs = sh->block_size;
    const int64_t shared = count > 1 ? shared_blocks(tables, stride, seq_lens, first, last, bs) : 0;
    for (int64_t i = 0; i < rows; ++i) m[i] = -FLT_MAX, l[i] = 0.0f;
    for (int64_t i = 0; i < rows * sh->head_dim; ++i) acc[i] = 0.0f;
    const float *q_group = q + first * sh->num_heads * sh->head_dim;
    for (int64_t b = 0; b < shared; ++b) attend_block(sh, q_group, count, tables[first * stride + b], bs, m, l, acc, s, tile);
    for (int64_t r = 0; r < count; ++r) {
        const int64_t len = seq_lens[first + r], i = r * sh->num_heads;
        for (int64_t b = shared; b * bs < len; ++b) {
            const int64_t ntok = len - b * bs < bs ? len - b * bs : bs;
            if ((b + PREFETCH_BLOCKS) * bs < len) prefetch_block(sh, tables[(first + r) * stride + b + PREFETCH_BLOCKS]);
            attend_block(sh, q_group + i * sh->head_dim, 1, tables[(first + r) * stride + b], ntok, m + i, l + i,
                         acc + i * sh->head_dim, s, tile);
        }
    }
    float *o = out + first * sh->num_heads * sh->head_dim;
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t d = 0; d < sh->head_dim; ++d) o[i * sh->head_dim + d] = acc[i * sh->head_dim + d] / l[i];
}

static int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Every context length >= 1 and covered by its table row, every block id it reads in the pool. */
static int tables_valid(const int32_t *tables, int64_t stride, int64_t width, const int32_t *seq_lens,
                        int64_t num_requests, int64_t block_size, int64_t num_blocks) {
    for (int64_t r = 0; r < num_requests; ++r) {
        const int64_t blocks = ((int64_t)seq_lens[r] + block_size - 1) / block_size;
        if (seq_lens[r] < 1 || blocks > width) return 0;
        for (int64_t b = 0; b < blocks; ++b)
            if (tables[r * stride + b] < 0 || tables[r * stride + b] >= num_blocks) return 0;
    }
    return 1;
}

/* Attend for every request; returns 0, -1 when scratch memory cannot be had, -2 (nothing
 * read) when a length or block id is out of range. */
static int decode_pages(const Shape *shape, const float *q, int64_t num_blocks, const int32_t *block_tables,
                        int64_t table_stride, int64_t table_width, const int32_t *seq_lens, float *out,
                        int64_t num_requests) {
    const Shape sh = *shape;
    const int64_t num_heads = sh.num_heads, head_dim = sh.head_dim, block_size = sh.block_size;
    if (!tables_valid(block_tables, table_stride, table_width, seq_lens, num_requests, block_size, num_blocks))
        return -2;
    /* Small enough groups that every thread gets one, large enough to share a prefix. */
    const int64_t per_thread = (num_requests + max_threads() - 1) / max_threads();
    const int64_t cap = per_thread < MAX_GROUP ? (per_thread > 0 ? per_thread : 1) : MAX_GROUP;
    int64_t *starts = (int64_t *)malloc(sizeof(int64_t) * (num_requests + 1));
    if (!starts) return -1;
    int64_t num_groups = 0;
    for (int64_t first = 0; first < num_requests; ++num_groups) {
        starts[num_groups] = first;
        first = group_end(block_tables, table_stride, seq_lens, first, num_requests, block_size, cap);
    }
    starts[num_groups] = num_requests;
    int failed = 0;
#pragma omp parallel
    {
        const int64_t rows = cap * num_heads;
        float *scratch = (float *)malloc(sizeof(float) * (rows * (head_dim + 2) + block_size * (1 + 2 * head_dim)));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < num_groups; ++g) {
            if (!scratch) continue;
            float *m = scratch, *l = m + rows, *acc = l + rows, *s = acc + rows * head_dim, *tile = s + block_size;
            attend_group(&sh, q, block_tables, table_stride, seq_lens, starts[g], starts[g + 1], out, m, l, acc, s,
                         tile);
        }
        free(scratch);
    }
    free(starts);
    return failed ? -1 : 0;
}

int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache, int64_t num_blocks,
                               const int32_t *block_tables, int64_t table_stride, int64_t table_width,
                               const int32_t *seq_lens, float *out, int64_t num_requests,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, float scale) {
    const Shape sh = float_shape(k_cache, v_cache, num_heads, num_kv_heads, head_dim, block_size, scale);
    return decode_pages(&sh, q, num_blocks, block_tables, table_stride, table_width, seq_lens, out, num_requests);
}

/* The same over int8 pages of page_bytes, scales from code_bytes on. */
int paged_decode_attention_i8(const float *q, const void *k_pages, const void *v_pages, int64_t num_blocks,
                              int64_t page_bytes, int64_t code_bytes, const int32_t *block_tables,
                              int64_t table_stride, int64_t table_width, const int32_t *seq_lens, float *out,
                              int64_t num_requests, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, float scale) {
    const Shape sh = {(const char *)k_pages, (const char *)v_pages, page_bytes, code_bytes, 1,
                      num_heads, num_kv_heads, head_dim, block_size, scale};
    return decode_pages(&sh, q, num_blocks, block_tables, table_stride, table_width, seq_lens, out, num_requests);
}

/* k_cache/v_cache row slots[t] = k/v row t, for every new token t; returns 0, or -2 (and
 * writes nothing) when a slot is outside the pool's num_slots rows. */
static int slots_valid(const int64_t *slots, int64_t tokens, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return 0;
    return 1;
}

int paged_store_f32(const float *k, const float *v, float *k_cache, float *v_cache, const int64_t *slots,
                    int64_t tokens, int64_t row, int64_t num_slots) {
    if (!slots_valid(slots, tokens, num_slots)) return -2;
#pragma omp parallel for schedule(static) if (tokens >= 256)
    for (int64_t t = 0; t < tokens; ++t) {
        memcpy(k_cache + slots[t] * row, k + t * row, sizeof(float) * row);
        memcpy(v_cache + slots[t] * row, v + t * row, sizeof(float) * row);
    }
    return 0;
}

/* One token's K and V rows (every KV head) quantized into their int8 pages at `slot`. */
static void store_token_i8(const Shape *sh, const float *k, const float *v, char *k_pages, char *v_pages,
                           int64_t slot) {
    const int64_t h = sh->num_kv_heads, d = sh->head_dim, off = slot % sh->block_size;
    char *kp = k_pages + (slot / sh->block_size) * sh->page_bytes, *vp = v_pages + (slot / sh->block_size) * sh->page_bytes;
    for (int64_t j = 0; j < h; ++j) {
        quantize_row(k + j * d, d, (int8_t *)kp + (off * h + j) * d, (float *)(kp + sh->code_bytes) + off * h + j);
        quantize_row(v + j * d, d, (int8_t *)vp + (off * h + j) * d, (float *)(vp + sh->code_bytes) + off * h + j);
    }
}

int paged_store_i8(const float *k, const float *v, void *k_pages, void *v_pages, const int64_t *slots,
                   int64_t tokens, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                   int64_t page_bytes, int64_t code_bytes, int64_t num_slots) {
    if (!slots_valid(slots, tokens, num_slots)) return -2;
    const Shape sh = {(const char *)k_pages, (const char *)v_pages, page_bytes, code_bytes, 1,
                      num_kv_heads, num_kv_heads, head_dim, block_size, 1.0f};
    const int64_t row = num_kv_heads * head_dim;
#pragma omp parallel for schedule(static) if (tokens >= 256)
    for (int64_t t = 0; t < tokens; ++t)
        store_token_i8(&sh, k + t * row, v + t * row, (char *)k_pages, (char *)v_pages, slots[t]);
    return 0;
}
