/*
 * Paged KV on CPU, float32: writing a step's new K/V rows into their pool slots, and
 * decode attention (one query row per request row) reading K and V straight out of the
 * block pool through each row's block table (no gather, no copy).
 *
 * Rows are taken in groups: neighbours whose block tables start with the same physical
 * block (the rows of one request in a speculative verify or a small prompt chunk, each
 * with its own causal length; prefix-cache hits on one system prompt; forks of one
 * program). A group walks the leading blocks that all its rows still reading them hold
 * at the same place together ("joint" blocks): each K/V tile of a KV head is read from
 * memory once and then serves, from L1, every query head of that KV head in every row,
 * each row taking the block's keys up to its own length. Then each row walks its own
 * remaining blocks alone. The caller puts rows that share a prefix next to each other (the
 * runner orders decodes by block table; a chunk's rows are consecutive). Groups are spread
 * over OpenMP threads (torch's own workers, see native_build.py).
 *
 * Softmax is online (flash-decoding style): every query row keeps its running max m,
 * running sum l and an unnormalised output acc; each group of VW keys rescales them once.
 * Scores are in log2 units (q is pre-scaled by scale * log2(e)), so weights are exp2. The
 * VW scores of a key group are VW dot products reduced together (v_sums), the weighted sum
 * of V rows runs over head_dim in vectors, and nothing of either is per-element scalar work.
 * Query head h reads KV head h / (num_heads / num_kv_heads).
 *
 * Sliding window (window W > 0): a row of context len sees keys [len - W, len) only. Each
 * row then walks alone (no groups: neighbours' windows start apart) from the first block its
 * window reaches, its keys before the window masked in the first group that holds them;
 * the table entries before that block are neither read nor checked (a hybrid KV layout frees
 * those pages), and the cost is O(W), not O(len).
 *
 * Attention sinks (gpt-oss; `sinks` non-NULL, one logit per query head): each head's softmax
 * denominator takes one more term, exp(sink), that no value row goes with. It is folded in
 * once per row after the last key, from the row's final (m, l), so the key loops are unchanged.
 *
 * Draft trees (`masks` non-NULL; attention/metadata.py's tree_masks): a row with a nonzero
 * mask M is a tree node: bit j stands for slot base + j, base = len - 1 - (M's highest bit, the
 * row's own slot); the row sees every slot before base, and of those from base on the ones whose
 * bit is set (its ancestors and itself). Its position is base + popcount(M) - 1, and a window
 * counts positions: the slots before base from position + 1 - W on, bit j while
 * popcount(M >> j) <= W. The row walks its table (grouped, windowed) as a row of context base,
 * so a tree's rows share their prefix as a chain's do; its tree keys (at most 64) are then
 * gathered into the tile, a block's worth at a time, and folded in by the float path.
 *
 * Layouts (float32, contiguous):
 *   q, out           [num_rows, num_heads, head_dim]
 *   k, v (new rows)  [tokens, num_kv_heads, head_dim]
 *   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables     [num_rows, table_stride] int32
 *   seq_lens         [num_rows] int32 (context length, >= 1)
 *   slots            [tokens] int64 (block * block_size + offset)
 *
 * int8 pages (the _i8 entry points; kernels/quantized_pages.py): k_pages, v_pages are
 * [num_blocks, page_bytes] bytes, each page int8 codes [block_size, num_kv_heads, head_dim]
 * then, from code_bytes on, float32 scales [block_size, num_kv_heads]. The store quantizes
 * each token's head (scale = max|x| / 127, codes rounded half away from zero). Decode
 * converts a block's codes of one KV head to floats once per group (int8 -> int32 -> float
 * in registers, unscaled), and folds each token's scales in once per query row: the K
 * scale into the token's score, the V scale into its softmax weight. On AVX-512 it takes
 * attend_block_i8 (below), which converts K transposed and folds a KV head's query heads
 * together; elsewhere the float path's attend_block over a converted tile.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec.h"

#define MAX_GROUP 64 /* rows per group: their running state stays in L2 */
#define PREFETCH_BLOCKS 2
#define PANEL 4 /* vectors of a row's output accumulated at once */
#define LOG2E 1.4426950408889634f
#define MASKED (-1e30f) /* a score no key reaches; finite, as -ffast-math wants */
#define INLINE static inline __attribute__((always_inline))

typedef struct {
    const char *k_pages, *v_pages; /* block b's K/V start at b * page_bytes */
    int64_t page_bytes, code_bytes; /* code_bytes: where an int8 page's scales start */
    int int8;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int64_t window; /* sliding window, 0: the whole context */
    const float *sinks; /* [num_heads] natural-log logits, or NULL: no sinks */
    const uint64_t *masks; /* [num_rows] draft-tree masks (0: an ordinary row), or NULL: none */
    int64_t kv_first, kv_last; /* the KV heads (and their query heads) a decode work item attends; kv_last 0: all */
} Shape;

static inline int64_t kv_end(const Shape *sh) { return sh->kv_last > 0 ? sh->kv_last : sh->num_kv_heads; }

static Shape float_shape(const float *k_cache, const float *v_cache, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale) {
    const int64_t bytes = block_size * num_kv_heads * head_dim * (int64_t)sizeof(float);
    const Shape sh = {(const char *)k_cache, (const char *)v_cache, bytes, bytes, 0,
                      num_heads, num_kv_heads, head_dim, block_size, scale};
    return sh;
}

/* x [head_dim] -> codes and their scale (kernels/quantized_pages.py's quantize). */
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

static int64_t vectors_of(int64_t n) { return (n + VW - 1) / VW; }

/* A group's query rows, [row][head] (row i's head h at i * num_heads + h), and their state. */
typedef struct {
    float *q, *acc; /* [rows][padded]: q pre-scaled, zeros past head_dim; acc unnormalised */
    float *m, *l;   /* [rows] */
    int64_t padded; /* head_dim rounded up to whole vectors */
} Rows;

/* One block of one KV head as the rows read it: token t's head_dim floats at k + t * stride
 * (the tail vector holds `tail` of them); with int8 pages the codes as floats in a tile
 * (padded with zeros, tail = VW) and the tokens' scales (ks, vs), else ks = vs = NULL. */
typedef struct {
    const float *k, *v, *ks, *vs;
    int64_t stride, vectors, tail;
} Keys;

/* Per-thread scratch for an int8 block: K and V codes as floats, their scales. */
typedef struct {
    float *k, *v; /* [block_size][padded] */
    float *ks, *vs; /* [block_size rounded up to VW] */
} Tile;

/* Vector c of a token's head_dim floats at x: the last of nv holds `tail` floats. */
INLINE vf load_vector(const float *x, int64_t c, int64_t nv, int64_t tail) {
    return c + 1 < nv || tail == VW ? v_load(x + c * VW) : v_load_n(x + c * VW, tail);
}

/* Lane t: q . key t for the g (<= VW) keys at k, `stride` floats apart, of nv vectors
 * each; lanes past g are 0. */
INLINE vf key_scores(const float *q, const float *k, int64_t stride, int64_t nv, int64_t tail, int64_t g) {
    vf a[VW];
    for (int t = 0; t < VW; ++t) {
        a[t] = v_set1(0.0f);
        if (t < g)
            for (int64_t c = 0; c < nv; ++c) a[t] = v_fma(v_load(q + c * VW), load_vector(k + t * stride, c, nv, tail), a[t]);
    }
    return v_sums(a);
}

/* o[nv (<= PANEL) vectors] = o * alpha + sum_t w[t] v[t] over g value rows `stride` floats
 * apart. Two accumulators per vector hide the FMA latency. */
INLINE void value_panel(float *o, vf alpha, const float *w, const float *v, int64_t stride, int64_t nv,
                        int64_t tail, int64_t g) {
    vf even[PANEL], odd[PANEL];
    for (int i = 0; i < PANEL; ++i) even[i] = i < nv ? v_mul(v_load(o + i * VW), alpha) : v_set1(0.0f), odd[i] = v_set1(0.0f);
    int64_t t = 0;
    for (; t + 2 <= g; t += 2) {
        const vf w0 = v_set1(w[t]), w1 = v_set1(w[t + 1]);
        for (int i = 0; i < PANEL; ++i)
            if (i < nv) {
                even[i] = v_fma(w0, load_vector(v + t * stride, i, nv, tail), even[i]);
                odd[i] = v_fma(w1, load_vector(v + (t + 1) * stride, i, nv, tail), odd[i]);
            }
    }
    for (int i = 0; i < PANEL; ++i)
        if (i < nv && t < g) even[i] = v_fma(v_set1(w[t]), load_vector(v + t * stride, i, nv, tail), even[i]);
    for (int i = 0; i < PANEL; ++i)
        if (i < nv) v_store(o + i * VW, v_add(even[i], odd[i]));
}

/* Fold keys [t0, t0 + g) (g <= VW) into one query row's running (m, l, acc); the rows have
 * nv vectors, the last holding `tail` floats. */
INLINE void fold_keys(const float *q, float *acc, float *m, float *l, const Keys *keys, int64_t t0, int64_t g,
                      int64_t skip, int64_t nv, int64_t tail) {
    const int64_t stride = keys->stride;
    vf s = key_scores(q, keys->k + t0 * stride, stride, nv, tail, g);
    if (keys->ks) s = v_mul(s, v_load(keys->ks + t0));
    s = v_drop(v_keep(s, g, MASKED), skip, MASKED);
    const float m_old = *m, top = v_hmax(s), m_new = top > m_old ? top : m_old;
    const vf p = v_drop(v_keep(v_exp2(v_sub(s, v_set1(m_new))), g, 0.0f), skip, 0.0f);
    const vf alpha = v_exp2(v_set1(m_old - m_new)); /* 0 on the first keys, where m_old is MASKED */
    *l = *l * v_first(alpha) + v_hsum(p);
    *m = m_new;
    float w[VW];
    v_store(w, keys->vs ? v_mul(p, v_load(keys->vs + t0)) : p);
    const float *v = keys->v + t0 * stride;
    for (int64_t c = 0; c < nv; c += PANEL) {
        const int64_t n = nv - c < PANEL ? nv - c : PANEL;
        value_panel(acc + c * VW, alpha, w, v + c * VW, stride, n, c + n < nv ? VW : tail, g);
    }
}

/* A sliding window's first key group of one query row: keys [from, the group's end) of the
 * block's first n; returns where the next group starts. Apart from attend_row, whose loop
 * stays as it is for every other group. */
static __attribute__((noinline)) int64_t attend_first_group(const Rows *rows, int64_t i, const Keys *keys,
                                                            int64_t from, int64_t n) {
    const int64_t t0 = from - from % VW, g = n - t0 < VW ? n - t0 : VW;
    fold_keys(rows->q + i * rows->padded, rows->acc + i * rows->padded, rows->m + i, rows->l + i, keys, t0, g,
              from - t0, keys->vectors, keys->tail);
    return t0 + VW;
}

/* One query row against the block's keys [from, n), VW at a time (groups stay aligned to
 * VW: the first masks its keys before `from`). The common shape (whole key groups, rows of
 * PANEL whole vectors: head_dim 64 on AVX-512) is compiled apart. */
static void attend_row(const Rows *rows, int64_t i, const Keys *keys, int64_t from, int64_t n) {
    const float *q = rows->q + i * rows->padded;
    float *acc = rows->acc + i * rows->padded, *m = rows->m + i, *l = rows->l + i;
    const int common = keys->vectors == PANEL && keys->tail == VW;
    int64_t t0 = 0;
    if (from) t0 = from % VW ? attend_first_group(rows, i, keys, from, n) : from;
    for (; t0 + VW <= n; t0 += VW) {
        if (common) fold_keys(q, acc, m, l, keys, t0, VW, 0, PANEL, VW);
        else fold_keys(q, acc, m, l, keys, t0, VW, 0, keys->vectors, keys->tail);
    }
    if (t0 < n) fold_keys(q, acc, m, l, keys, t0, n - t0, 0, keys->vectors, keys->tail);
}

/* KV head j's first n tokens of an int8 page: codes as floats into out [n][padded], zeros
 * past head_dim; their scales into scales [n rounded up to VW], zeros past n. */
static void convert_codes(const Shape *sh, const char *page, int64_t j, int64_t n, int64_t padded, float *out,
                          float *scales) {
    const int64_t h = sh->num_kv_heads, d = sh->head_dim, tail = d - (vectors_of(d) - 1) * VW;
    const int8_t *codes = (const int8_t *)page + j * d;
    const float *sc = (const float *)(page + sh->code_bytes) + j;
    for (int64_t t = 0; t < n; ++t) {
        const int8_t *c = codes + t * h * d;
        float *o = out + t * padded;
        int64_t x = 0;
        for (; x + VW <= d; x += VW) v_store(o + x, v_load_i8(c + x));
        if (x < d) v_store(o + x, v_load_i8_n(c + x, tail));
        scales[t] = sc[t * h];
    }
    for (int64_t t = n; t < vectors_of(n) * VW; ++t) scales[t] = 0.0f;
}

/* KV head j of the block whose pages start at kp, vp, for its first n tokens. */
static Keys block_keys(const Shape *sh, const char *kp, const char *vp, int64_t j, int64_t n, int64_t padded,
                       Tile *tile) {
    const int64_t d = sh->head_dim, vectors = vectors_of(d);
    if (!sh->int8) {
        const Keys keys = {(const float *)kp + j * d, (const float *)vp + j * d, NULL, NULL,
                           sh->num_kv_heads * d, vectors, d - (vectors - 1) * VW};
        return keys;
    }
    convert_codes(sh, kp, j, n, padded, tile->k, tile->ks);
    convert_codes(sh, vp, j, n, padded, tile->v, tile->vs);
    const Keys keys = {tile->k, tile->v, tile->ks, tile->vs, padded, vectors, VW};
    return keys;
}

/* How many of block b's tokens a row of context `len` sees. */
static int64_t tokens_in(int64_t len, int64_t b, int64_t block_size) {
    const int64_t n = len - b * block_size;
    return n < 0 ? 0 : n < block_size ? n : block_size;
}

/* Lines [part, part + 1) / parts of block `ahead`'s K and V pages into L2 (nothing for ahead < 0). */
static inline void prefetch_part(const Shape *sh, int64_t ahead, int64_t part, int64_t parts) {
    if (ahead < 0) return;
    const int64_t lines = (sh->page_bytes + 63) / 64, from = lines * part / parts, to = lines * (part + 1) / parts;
    const char *k = sh->k_pages + ahead * sh->page_bytes, *v = sh->v_pages + ahead * sh->page_bytes;
    for (int64_t o = from * 64; o < to * 64; o += 64) {
        v_prefetch(k + o);
        v_prefetch(v + o);
    }
}

/* Fold block `block` (position b of their tables) into every query head of rows [0, count),
 * each up to its own length lens[i], from the block's token `from` on (> 0 only in the first
 * block of a sliding window, count 1); rows' state is theirs from row 0 on. Block `ahead`, read
 * PREFETCH_BLOCKS later, is asked into L2 a slice per query head: a request's blocks lie
 * anywhere in the pool, so the hardware's stream prefetcher starts over at every block, and a
 * whole block's prefetches at once fill the core's miss buffers and stall the loads behind
 * them (decode kernel alone, 8 requests x 6k tokens, cold 1 GiB pool, one thread, int8:
 * 5.9 ms with the whole block at once, 3.3 ms sliced). */
static void attend_block(const Shape *sh, const Rows *rows, const int32_t *lens, int64_t count, int64_t block,
                         int64_t b, int64_t from, int64_t ahead, Tile *tile) {
    const int64_t bs = sh->block_size, group = sh->num_heads / sh->num_kv_heads;
    int64_t most = 0;
    for (int64_t i = 0; i < count; ++i) most = tokens_in(lens[i], b, bs) > most ? tokens_in(lens[i], b, bs) : most;
    const char *kp = sh->k_pages + block * sh->page_bytes, *vp = sh->v_pages + block * sh->page_bytes;
    for (int64_t j = sh->kv_first; j < kv_end(sh); ++j) {
        const Keys keys = block_keys(sh, kp, vp, j, most, rows->padded, tile);
        for (int64_t h = j * group; h < (j + 1) * group; ++h) {
            prefetch_part(sh, ahead, h, sh->num_heads);
            for (int64_t i = 0; i < count; ++i)
                if (tokens_in(lens[i], b, bs))
                    attend_row(rows, i * sh->num_heads + h, &keys, from, tokens_in(lens[i], b, bs));
        }
    }
}

#if VW == 16 && defined(__AVX512BW__)
/* int8 pages on AVX-512 (attend_block_i8). A block's tokens are taken 16 at a time (a
 * sub-block), lane t = token t. Per KV head the K codes go through a 16 x 16 dword transpose
 * in registers, so that dim x of the 16 tokens is one vector and a query head's 16 scores are
 * head_dim FMAs of a broadcast q[x] against it, with no reduction across lanes. Up to
 * GROUP_MAX query heads of the KV head are folded together: every K and V vector converted
 * feeds all of them, and their scores and output panels stay in registers. A row walking its
 * blocks alone converts straight from the page (block_codes: no tile stored and reloaded);
 * several rows (joint blocks), or more than GROUP_MAX heads a KV head, convert a sub-block
 * once into a tile and read it from there (fold_tile).
 *
 * A K dim is converted with its code in the top byte of an int32, so its float is code * 2^24
 * exactly; the scores take the 2^-24 back after the K scale. Scaling by a power of two
 * changes no rounding (short of overflow: |q . k| past ~1e31), so the scores are those of the
 * codes themselves. */
#define FAST_I8 1
#define GROUP_MAX 4
#define TOP_BYTE 16777216.0f /* 2^24 */

/* c + *a * b, *a broadcast from memory inside the FMA (GCC would broadcast into a register and
 * take b from memory at every use). */
INLINE vf fma_bcast(const float *a, vf b, vf c) {
    __asm__("vfmadd231ps %1%{1to16%}, %2, %0" : "+v"(c) : "m"(*a), "v"(b));
    return c;
}

/* c + a * b with both in registers. */
INLINE vf fma_reg(vf a, vf b, vf c) {
    __asm__("vfmadd231ps %1, %2, %0" : "+v"(c) : "v"(a), "v"(b));
    return c;
}

/* r[c] lane t = dims [4c, 4c + 4) of token t's w (<= 64) codes at codes + t * stride, for
 * t < n; zeros elsewhere. A masked-off row reads nothing (past n may be past the page). */
INLINE void key_columns(const int8_t *codes, int64_t stride, int64_t n, int64_t w, vf r[16]) {
    if (n == 16 && w == 64)
        for (int t = 0; t < 16; ++t) r[t] = v_load((const float *)(codes + t * stride));
    else {
        const __mmask64 bytes = w >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << w) - 1);
        for (int t = 0; t < 16; ++t)
            r[t] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi8(t < n ? bytes : 0, codes + t * stride));
    }
    v_transpose(r);
}

/* Dim k of every token's dword in column dw, as code * 2^24: the byte moved to the top. */
INLINE vf key_dim(__m512i dw, int k) {
    const __m512i to_top = _mm512_set4_epi32((int)(0x0C808080u + (unsigned)k * 0x01000000u),
                                             (int)(0x08808080u + (unsigned)k * 0x01000000u),
                                             (int)(0x04808080u + (unsigned)k * 0x01000000u),
                                             (int)(0x00808080u + (unsigned)k * 0x01000000u));
    return _mm512_cvtepi32_ps(_mm512_shuffle_epi8(dw, to_top));
}

/* 16 V codes (or the first `left` < 16) at p as floats. */
INLINE vf value_codes(const int8_t *p, int64_t left) {
    if (left >= 16) return v_load_i8(p);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8((__mmask16)((1u << left) - 1), p)));
}

/* Tokens [t0, t0 + n) of KV head j's scales in the page at pg into out [16], zeros past n. */
static void sub_scales(const Shape *sh, const char *pg, int64_t j, int64_t t0, int64_t n, float *out) {
    const float *sc = (const float *)(pg + sh->code_bytes) + t0 * sh->num_kv_heads + j;
    for (int64_t t = 0; t < 16; ++t) out[t] = t < n ? sc[t * sh->num_kv_heads] : 0.0f;
}

/* One softmax step for g heads from their raw scores s (4 partial sums each, K codes * 2^24):
 * scale, mask past n, running max, weights w[h] (times the V scales) and alpha[h]; a head
 * whose max stays keeps alpha = 1 (exp2(0)). */
INLINE void softmax_step(vf s[GROUP_MAX][4], const int g, const float *ks, const float *vs, int64_t n, float *m,
                         float *l, float w[GROUP_MAX][16], float alpha[GROUP_MAX]) {
    const vf kscale = v_load(ks), vscale = v_load(vs), down = v_set1(1.0f / TOP_BYTE);
    for (int h = 0; h < g; ++h) {
        const vf raw = v_add(v_add(s[h][0], s[h][1]), v_add(s[h][2], s[h][3]));
        const vf sc = v_keep(v_mul(v_mul(raw, kscale), down), n, MASKED);
        const float top = v_hmax(sc);
        alpha[h] = 1.0f;
        if (top > m[h]) { /* 2^-126 (times zeros) on the first keys, where m is MASKED */
            alpha[h] = v_first(v_exp2(v_set1(m[h] - top)));
            m[h] = top;
        }
        const vf p = v_keep(v_exp2(v_sub(sc, v_set1(m[h]))), n, 0.0f);
        l[h] = l[h] * alpha[h] + v_hsum(p);
        v_store(w[h], v_mul(p, vscale));
    }
}

/* acc[h] = acc[h] * alpha[h] + sum_t w[h][t] v[t] for g heads (acc `padded` floats apart), V
 * rows of nv vectors read by value(t, c), PANEL vectors of all g heads at a time in registers. */
#define VALUE_PANELS(g, acc, padded, alpha, w, nv, n, value)                                        \
    for (int64_t c = 0; c < (nv); c += PANEL) {                                                    \
        const int64_t np = (nv) - c < PANEL ? (nv) - c : PANEL;                                    \
        vf o[GROUP_MAX][PANEL];                                                                    \
        for (int h = 0; h < (g); ++h)                                                              \
            for (int i = 0; i < PANEL; ++i)                                                        \
                if (i < np) o[h][i] = v_mul(v_load((acc) + h * (padded) + (c + i) * 16), v_set1((alpha)[h])); \
        for (int64_t t = 0; t < (n); ++t) {                                                        \
            vf wt[GROUP_MAX];                                                                      \
            for (int h = 0; h < (g); ++h) wt[h] = v_set1((w)[h][t]);                               \
            for (int i = 0; i < PANEL; ++i)                                                        \
                if (i < np) {                                                                      \
                    const vf vv = value(t, c + i);                                                 \
                    for (int h = 0; h < (g); ++h) o[h][i] = fma_reg(wt[h], vv, o[h][i]);           \
                }                                                                                  \
        }                                                                                          \
        for (int h = 0; h < (g); ++h)                                                              \
            for (int i = 0; i < PANEL; ++i)                                                        \
                if (i < np) v_store((acc) + h * (padded) + (c + i) * 16, o[h][i]);                 \
    }

/* Raw scores s (4 partial sums per head, K codes * 2^24) of g query heads (q `padded` floats
 * apart) against the n (<= 16) tokens whose K codes are at kc (token t at t * stride),
 * converted as they are read. */
INLINE void score_codes(const float *q, int64_t padded, const int8_t *kc, int64_t stride, int64_t d, int64_t n,
                        const int g, vf s[GROUP_MAX][4]) {
    for (int h = 0; h < g; ++h)
        for (int k = 0; k < 4; ++k) s[h][k] = v_set1(0.0f);
    for (int64_t x = 0; x < d; x += 64) {
        const int64_t w = d - x < 64 ? d - x : 64;
        vf r[16];
        key_columns(kc + x, stride, n, w, r);
#pragma GCC unroll 16
        for (int c = 0; c < 16; ++c)
            if (4 * c < w) {
                const __m512i dw = _mm512_castps_si512(r[c]);
                for (int k = 0; k < 4; ++k) {
                    const vf kv = key_dim(dw, k);
                    for (int h = 0; h < g; ++h) s[h][k] = fma_bcast(q + h * padded + x + 4 * c + k, kv, s[h][k]);
                }
            }
    }
}

/* The tokens [t0, t0 + n) (n <= 16) of a block (pages at kp, vp) folded into one row's query
 * heads (run 0 of rows, g per KV head), converting from the pages as they are read. The KV
 * heads are software-pipelined: KV head j's scores are issued between KV head j - 1's softmax
 * step and its values, so that the step's latency chain (max, exp2, weights) runs under them. */
INLINE void block_codes(const Shape *sh, const Rows *rows, const char *kp, const char *vp, int64_t t0, int64_t n,
                        int64_t ahead, const int g, const int64_t d, const int64_t padded) {
    const int64_t h = sh->num_kv_heads, stride = h * d, nv = (d + 15) / 16;
    const int8_t *kc = (const int8_t *)kp + t0 * stride, *vc = (const int8_t *)vp + t0 * stride;
    float ks[16] __attribute__((aligned(64))), vs[2][16] __attribute__((aligned(64)));
    float wts[2][GROUP_MAX][16] __attribute__((aligned(64))), alpha[2][GROUP_MAX];
    vf s[GROUP_MAX][4];
    for (int64_t j = 0; j <= h; ++j) {
        const int cur = (int)(j & 1), prev = cur ^ 1;
        if (j < h) {
            if (t0 == 0) prefetch_part(sh, ahead, j, h);
            sub_scales(sh, kp, j, t0, n, ks);
            sub_scales(sh, vp, j, t0, n, vs[cur]);
            score_codes(rows->q + j * g * padded, padded, kc + j * d, stride, d, n, g, s);
        }
        if (j > 0) {
            const int8_t *v = vc + (j - 1) * d;
            float *acc = rows->acc + (j - 1) * g * padded;
#define FROM_CODES(t, c) value_codes(v + (t) * stride + (c) * 16, d - (c) * 16)
            VALUE_PANELS(g, acc, padded, alpha[prev], wts[prev], nv, n, FROM_CODES)
#undef FROM_CODES
        }
        if (j < h) softmax_step(s, g, ks, vs[cur], n, rows->m + j * g, rows->l + j * g, wts[cur], alpha[cur]);
    }
}

/* One row's g heads against a converted tile: kt [d rounded up to 4][16] (dims as code * 2^24),
 * v [16][padded]. */
INLINE void fold_tile(const float *q, float *acc, float *m, float *l, int64_t padded, const float *kt,
                      const float *ks, const float *v, const float *vs, int64_t d4, int64_t nv, int64_t n,
                      const int g) {
    vf s[GROUP_MAX][4];
    for (int h = 0; h < g; ++h)
        for (int k = 0; k < 4; ++k) s[h][k] = v_set1(0.0f);
    for (int64_t x = 0; x < d4; x += 4)
        for (int k = 0; k < 4; ++k) {
            const vf kv = v_load(kt + (x + k) * 16);
            for (int h = 0; h < g; ++h) s[h][k] = fma_bcast(q + h * padded + x + k, kv, s[h][k]);
        }
    float wts[GROUP_MAX][16] __attribute__((aligned(64)));
    float alpha[GROUP_MAX];
    softmax_step(s, g, ks, vs, n, m, l, wts, alpha);
#define FROM_TILE(t, c) v_load(v + (t) * padded + (c) * 16)
    VALUE_PANELS(g, acc, padded, alpha, wts, nv, n, FROM_TILE)
#undef FROM_TILE
}

/* Tokens [t0, t0 + n) (n <= 16) of KV head j in the pages at kp, vp into the tile: K as
 * kt [d rounded up to 4][16], V as [n][padded] (zeros past head_dim). */
static void convert_tile(const Shape *sh, const char *kp, const char *vp, int64_t j, int64_t t0, int64_t n,
                         int64_t padded, Tile *tile) {
    const int64_t h = sh->num_kv_heads, d = sh->head_dim, stride = h * d;
    const int8_t *kc = (const int8_t *)kp + (t0 * h + j) * d, *vc = (const int8_t *)vp + (t0 * h + j) * d;
    for (int64_t x = 0; x < d; x += 64) {
        const int64_t w = d - x < 64 ? d - x : 64;
        vf r[16];
        key_columns(kc + x, stride, n, w, r);
        for (int c = 0; 4 * c < w; ++c)
            for (int k = 0; k < 4; ++k) v_store(tile->k + (x + 4 * c + k) * 16, key_dim(_mm512_castps_si512(r[c]), k));
    }
    for (int64_t t = 0; t < n; ++t)
        for (int64_t x = 0; x < d; x += 16) v_store(tile->v + t * padded + x, value_codes(vc + t * stride + x, d - x));
}

#define FOLD_G(FOLD)                                                                               \
    switch (g) {                                                                                   \
    case 1: FOLD(1); break;                                                                        \
    case 2: FOLD(2); break;                                                                        \
    case 3: FOLD(3); break;                                                                        \
    default: FOLD(4); break;                                                                       \
    }

/* FOLD_G of FOLD64 (head_dim 64, its shape compiled in) where d is 64, else of FOLD. */
#define FOLD_BY_DIM(d, FOLD64, FOLD) \
    if ((d) == 64) {                 \
        FOLD_G(FOLD64)               \
    } else {                         \
        FOLD_G(FOLD)                 \
    }

/* block_codes compiled per g in [1, GROUP_MAX], and apart for head_dim 64. */
static void direct_run(const Shape *sh, const Rows *rows, const char *kp, const char *vp, int64_t t0, int64_t n,
                       int64_t ahead, int64_t g) {
    const int64_t d = sh->head_dim, p = rows->padded;
#define FOLD64(G) block_codes(sh, rows, kp, vp, t0, n, ahead, G, 64, 64)
#define FOLD(G) block_codes(sh, rows, kp, vp, t0, n, ahead, G, d, p)
    FOLD_BY_DIM(d, FOLD64, FOLD)
#undef FOLD
#undef FOLD64
}

/* fold_tile likewise. */
static void tile_run(const Rows *rows, int64_t i, int64_t g, const Tile *tile, int64_t d, int64_t n) {
    const int64_t p = rows->padded, nv = vectors_of(d), d4 = (d + 3) / 4 * 4;
    const float *q = rows->q + i * p;
    float *acc = rows->acc + i * p, *m = rows->m + i, *l = rows->l + i;
#define FOLD64(G) fold_tile(q, acc, m, l, 64, tile->k, tile->ks, tile->v, tile->vs, 64, 4, n, G)
#define FOLD(G) fold_tile(q, acc, m, l, p, tile->k, tile->ks, tile->v, tile->vs, d4, nv, n, G)
    FOLD_BY_DIM(d, FOLD64, FOLD)
#undef FOLD
#undef FOLD64
}

/* attend_block for int8 pages. */
static void attend_block_i8(const Shape *sh, const Rows *rows, const int32_t *lens, int64_t count, int64_t block,
                            int64_t b, int64_t from, int64_t ahead, Tile *tile) {
    const int64_t bs = sh->block_size, group = sh->num_heads / sh->num_kv_heads, d = sh->head_dim;
    const int64_t h = sh->num_kv_heads, chunks = (group + GROUP_MAX - 1) / GROUP_MAX;
    const int direct = count == 1 && chunks == 1; /* the codes are read once either way */
    int64_t most = 0;
    for (int64_t i = 0; i < count; ++i) most = tokens_in(lens[i], b, bs) > most ? tokens_in(lens[i], b, bs) : most;
    const char *kp = sh->k_pages + block * sh->page_bytes, *vp = sh->v_pages + block * sh->page_bytes;
    if (direct) {
        for (int64_t t0 = from; t0 < most; t0 += 16)
            direct_run(sh, rows, kp, vp, t0, most - t0 < 16 ? most - t0 : 16, ahead, group);
        return;
    }
    for (int64_t j = 0; j < h; ++j)
        for (int64_t t0 = from; t0 < most; t0 += 16) {
            const int64_t n = most - t0 < 16 ? most - t0 : 16;
            if (t0 == from) prefetch_part(sh, ahead, j, h);
            sub_scales(sh, kp, j, t0, n, tile->ks);
            sub_scales(sh, vp, j, t0, n, tile->vs);
            convert_tile(sh, kp, vp, j, t0, n, rows->padded, tile);
            for (int64_t c = 0; c < chunks; ++c) {
                const int64_t h0 = j * group + group * c / chunks, h1 = j * group + group * (c + 1) / chunks;
                for (int64_t i = 0; i < count; ++i) {
                    const int64_t left = tokens_in(lens[i], b, bs) - t0;
                    if (left > 0) tile_run(rows, i * sh->num_heads + h0, h1 - h0, tile, d, left < 16 ? left : 16);
                }
            }
        }
}
#undef FOLD_G
#endif

/* Block `block` into the rows: attend_block_i8 where it is compiled and the pages are int8. */
static void attend_pages(const Shape *sh, const Rows *rows, const int32_t *lens, int64_t count, int64_t block,
                         int64_t b, int64_t from, int64_t ahead, Tile *tile) {
#ifdef FAST_I8
    if (sh->int8) {
        attend_block_i8(sh, rows, lens, count, block, b, from, ahead, tile);
        return;
    }
#endif
    attend_block(sh, rows, lens, count, block, b, from, ahead, tile);
}

/* The first key a row of context len sees: len - window under a sliding window, else 0. */
static int64_t first_key(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* A tree row's base: the slot of its mask's bit 0. */
static int64_t tree_base(int64_t len, uint64_t mask) { return len - 1 - (63 - __builtin_clzll(mask)); }

/* The slots [first, walk) row r (context len) reads through its table: all its context, or a
 * tree row's slots before its base from its window's first position on. */
static void row_span(const Shape *sh, int64_t r, int64_t len, int64_t *first, int64_t *walk) {
    const uint64_t mask = sh->masks ? sh->masks[r] : 0;
    if (!mask) {
        *first = first_key(len, sh->window), *walk = len;
        return;
    }
    *walk = tree_base(len, mask);
    const int64_t next = *walk + __builtin_popcountll(mask); /* the row's position + 1 */
    *first = sh->window > 0 && next > sh->window ? next - sh->window : 0;
    if (*first > *walk) *first = *walk;
}

/* Block PREFETCH_BLOCKS after position b of a table for context len, or -1 past its end. */
static int64_t block_ahead(const int32_t *table, int64_t len, int64_t b, int64_t block_size) {
    return (b + PREFETCH_BLOCKS) * block_size < len ? table[b + PREFETCH_BLOCKS] : -1;
}

/* How many leading blocks the rows [first, last) walk together: at every such position, every
 * row whose context reaches it holds the same block there (and some row does). */
static int64_t joint_blocks(const int32_t *tables, int64_t stride, const int32_t *seq_lens, int64_t first,
                            int64_t last, int64_t block_size) {
    for (int64_t b = 0;; ++b) {
        int64_t id = -1;
        for (int64_t r = first; r < last; ++r) {
            if (seq_lens[r] <= b * block_size) continue;
            if (id < 0) id = tables[r * stride + b];
            else if (tables[r * stride + b] != id) return b;
        }
        if (id < 0) return b;
    }
}

/* The rows of the group that starts at `first`: up to `cap` neighbours sharing its first block. */
static int64_t group_end(const int32_t *tables, int64_t stride, int64_t first, int64_t end, int64_t cap) {
    int64_t last = first + 1;
    while (last < end && last - first < cap && tables[last * stride] == tables[first * stride]) ++last;
    return last;
}

/* Row r's query heads into rows->q [i] pre-scaled and padded; its state reset. */
static void load_rows(const Shape *sh, const float *q, int64_t count, const Rows *rows) {
    const int64_t d = sh->head_dim, p = rows->padded;
    const float scale = sh->scale * LOG2E;
    for (int64_t i = 0; i < count * sh->num_heads; ++i) {
        for (int64_t x = 0; x < p; ++x) rows->q[i * p + x] = x < d ? q[i * d + x] * scale : 0.0f;
        for (int64_t x = 0; x < p; ++x) rows->acc[i * p + x] = 0.0f;
        rows->m[i] = MASKED, rows->l[i] = 0.0f;
    }
}

/* Blocks at positions [from, to) (from the block of its first key `first` on) of one row (table,
 * length len), walked alone. */
static void attend_rest(const Shape *sh, const Rows *rows, const int32_t *table, const int32_t *len, int64_t from,
                        int64_t to, int64_t first, Tile *tile) {
    const int64_t bs = sh->block_size;
    if (first >= *len) return;
    for (int64_t b = from > first / bs ? from : first / bs; b < to && b * bs < *len; ++b) {
        const int64_t skip = first > b * bs ? first - b * bs : 0;
        attend_pages(sh, rows, len, 1, table[b], b, skip, block_ahead(table, *len, b, bs), tile);
    }
}

/* What a row's unnormalised output multiplies by when its softmax also counts a sink: its
 * keys' running max m and sum l (log2 units) joined with exp(sink), under a common max so
 * neither term overflows. */
static float with_sink(float m, float l, float sink) {
    const float s = sink * LOG2E, top = s > m ? s : m, keep = exp2f(m - top);
    return keep / (l * keep + exp2f(s - top));
}

/* Tree row's keys from its base on, the slots its mask lets it see (row_span's header), folded
 * into its query heads (rows: the row's own): gathered a block's worth at a time into the tile
 * as floats (int8 codes unscaled, with their scales), as block_keys lays out an int8 block. */
static void fold_tree(const Shape *sh, const Rows *rows, const int32_t *table, int64_t len, uint64_t mask,
                      Tile *tile) {
    const int64_t bs = sh->block_size, d = sh->head_dim, h = sh->num_kv_heads, p = rows->padded;
    const int64_t group = sh->num_heads / h, base = tree_base(len, mask);
    int64_t slots[64], n = 0;
    for (int j = 0; j < 64; ++j)
        if ((mask >> j) & 1 && (sh->window <= 0 || __builtin_popcountll(mask >> j) <= sh->window))
            slots[n++] = base + j;
    for (int64_t c = 0; c < n; c += bs) {
        const int64_t m = n - c < bs ? n - c : bs;
        for (int64_t j = sh->kv_first; j < kv_end(sh); ++j) {
            for (int64_t t = 0; t < m; ++t) {
                const int64_t s = slots[c + t], off = (s % bs) * h + j;
                const char *kp = sh->k_pages + table[s / bs] * sh->page_bytes;
                const char *vp = sh->v_pages + table[s / bs] * sh->page_bytes;
                float *kt = tile->k + t * p, *vt = tile->v + t * p;
                for (int64_t x = 0; x < p; ++x) {
                    if (x >= d) kt[x] = vt[x] = 0.0f;
                    else if (sh->int8) kt[x] = ((const int8_t *)kp)[off * d + x], vt[x] = ((const int8_t *)vp)[off * d + x];
                    else kt[x] = ((const float *)kp)[off * d + x], vt[x] = ((const float *)vp)[off * d + x];
                }
                if (sh->int8) {
                    tile->ks[t] = ((const float *)(kp + sh->code_bytes))[off];
                    tile->vs[t] = ((const float *)(vp + sh->code_bytes))[off];
                }
            }
            for (int64_t t = m; t < vectors_of(m) * VW; ++t) tile->ks[t] = tile->vs[t] = 0.0f;
            const Keys keys = {tile->k, tile->v, sh->int8 ? tile->ks : NULL, sh->int8 ? tile->vs : NULL, p,
                               vectors_of(d), VW};
            for (int64_t head = j * group; head < (j + 1) * group; ++head) attend_row(rows, head, &keys, 0, m);
        }
    }
}

/* A row's context is folded a chunk of SPLIT_KEYS keys (whole blocks: chunk_blocks) at a time,
 * each chunk from a fresh softmax state, and the chunks' states merged in order. Every row is
 * chunked the same way at every batch size and thread count, so its result depends on neither;
 * at a small batch the chunks of a long context are spread over the threads, where a group's
 * KV heads alone left threads idle or uneven (Gemma 3's one KV head: one thread attended while
 * the other waited; three KV heads on two threads: one read two thirds of the pages). */
#define SPLIT_KEYS 128

static int64_t chunk_blocks(int64_t block_size) { return block_size >= SPLIT_KEYS ? 1 : SPLIT_KEYS / block_size; }

/* The rows [first, last) of one group and what walking them takes. */
typedef struct {
    const int32_t *tables, *walk, *seq_lens; /* walk: row_span's lengths (tables are read to) */
    int64_t stride, first, last;
    int64_t joint;          /* leading blocks the rows walk together */
    int64_t longest;        /* the row with the longest walk (prefetches follow its table) */
    int64_t chunk0, chunks; /* the chunks [chunk0, chunks) that hold keys some row sees */
} Group;

static Group group_at(const Shape *sh, const int32_t *tables, int64_t stride, const int32_t *walk,
                      const int32_t *seq_lens, int64_t first, int64_t last) {
    const int64_t bs = sh->block_size, span = chunk_blocks(bs) * bs;
    Group g = {tables, walk, seq_lens, stride, first, last, 0, first, 0, 0};
    g.joint = last - first > 1 ? joint_blocks(tables, stride, walk, first, last, bs) : 0;
    int64_t lowest = -1;
    for (int64_t r = first; r < last; ++r) {
        g.longest = walk[r] > walk[g.longest] ? r : g.longest;
        int64_t first_slot, walked;
        row_span(sh, r, seq_lens[r], &first_slot, &walked);
        if (first_slot < walked && (lowest < 0 || first_slot < lowest)) lowest = first_slot;
    }
    g.chunks = (walk[g.longest] + span - 1) / span;
    g.chunk0 = lowest < 0 ? g.chunks : lowest / span;
    return g;
}

/* Row r's own view of a group's state (its query heads), r counted from the group's first. */
static Rows row_state(const Shape *sh, const Rows *rows, int64_t r) {
    const int64_t h = sh->num_heads, p = rows->padded;
    const Rows own = {rows->q + r * h * p, rows->acc + r * h * p, rows->m + r * h, rows->l + r * h, p};
    return own;
}

/* Whether query head i (of any row) reads a KV head of sh's range. */
static int in_heads(const Shape *sh, int64_t i) {
    const int64_t kv = i % sh->num_heads / (sh->num_heads / sh->num_kv_heads);
    return kv >= sh->kv_first && kv < kv_end(sh);
}

/* Chunk c of the group's rows into `rows`, whose state is fresh: the chunk's joint blocks
 * together, then each row's own. */
static void attend_chunk(const Shape *sh, const Group *g, int64_t c, const Rows *rows, Tile *tile) {
    const int64_t bs = sh->block_size, b0 = c * chunk_blocks(bs), b1 = b0 + chunk_blocks(bs);
    for (int64_t b = b0; b < b1 && b < g->joint; ++b) {
        const int64_t ahead = block_ahead(g->tables + g->longest * g->stride, g->walk[g->longest], b, bs);
        attend_pages(sh, rows, g->walk + g->first, g->last - g->first, g->tables[g->first * g->stride + b], b, 0,
                     ahead, tile);
    }
    for (int64_t r = g->first; r < g->last; ++r) {
        const Rows own = row_state(sh, rows, r - g->first);
        int64_t first_slot, walked;
        row_span(sh, r, g->seq_lens[r], &first_slot, &walked);
        attend_rest(sh, &own, g->tables + r * g->stride, g->walk + r, b0 > g->joint ? b0 : g->joint, b1, first_slot,
                    tile);
    }
}

/* The state of query heads [0, n) (those of sh's KV heads) reset: no key seen. */
static void reset_state(const Shape *sh, const Rows *s, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        if (in_heads(sh, i)) {
            memset(s->acc + i * s->padded, 0, sizeof(float) * s->padded);
            s->m[i] = MASKED, s->l[i] = 0.0f;
        }
}

/* A later chunk's state (m2, l2, acc2) into a head's running one: both under the larger max.
 * Into a state that has seen no key it is a copy (the factors are 0 and 1). */
static void merge_state(float *acc, float *m, float *l, const float *acc2, float m2, float l2, int64_t p) {
    const float top = m2 > *m ? m2 : *m, a = exp2f(*m - top), b = exp2f(m2 - top);
    for (int64_t x = 0; x < p; ++x) acc[x] = acc[x] * a + acc2[x] * b;
    *l = *l * a + l2 * b;
    *m = top;
}

/* The group's rows done: each tree row's own keys folded in, then the outputs normalised. */
static void finish_group(const Shape *sh, const Group *g, float *out, const Rows *rows, Tile *tile) {
    const int64_t d = sh->head_dim, p = rows->padded, n = (g->last - g->first) * sh->num_heads;
    for (int64_t r = g->first; r < g->last; ++r)
        if (sh->masks && sh->masks[r]) {
            const Rows own = row_state(sh, rows, r - g->first);
            fold_tree(sh, &own, g->tables + r * g->stride, g->seq_lens[r], sh->masks[r], tile);
        }
    float *o = out + g->first * sh->num_heads * d;
    for (int64_t i = 0; i < n; ++i) {
        if (!in_heads(sh, i)) continue;
        const float inv = sh->sinks ? with_sink(rows->m[i], rows->l[i], sh->sinks[i % sh->num_heads])
                                    : 1.0f / rows->l[i];
        for (int64_t x = 0; x < d; ++x) o[i * d + x] = rows->acc[i * p + x] * inv;
    }
}

/* One group whole on this thread: its chunks in order, each into `chunk` (fresh) and merged into
 * `rows` (the first straight into rows: merging it into an empty state gives the same floats). */
static void attend_group(const Shape *sh, const float *q, const Group *g, float *out, const Rows *rows,
                         const Rows *chunk, Tile *tile) {
    const int64_t n = (g->last - g->first) * sh->num_heads, p = rows->padded;
    load_rows(sh, q + g->first * sh->num_heads * sh->head_dim, g->last - g->first, rows);
    for (int64_t c = g->chunk0; c < g->chunks; ++c) {
        if (c == g->chunk0) {
            attend_chunk(sh, g, c, rows, tile);
            continue;
        }
        reset_state(sh, chunk, n);
        attend_chunk(sh, g, c, chunk, tile);
        for (int64_t i = 0; i < n; ++i)
            if (in_heads(sh, i))
                merge_state(rows->acc + i * p, rows->m + i, rows->l + i, chunk->acc + i * p, chunk->m[i], chunk->l[i], p);
    }
    finish_group(sh, g, out, rows, tile);
}
static int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Every context length >= 1 and covered by its table row, every tree mask's highest bit
 * within it, every block id it reads (from the first its window reaches) in the pool. */
static int tables_valid(const int32_t *tables, int64_t stride, int64_t width, const int32_t *seq_lens,
                        int64_t num_requests, int64_t block_size, int64_t num_blocks, int64_t window,
                        const uint64_t *masks) {
    Shape sh = {0};
    sh.window = window, sh.masks = masks;
    for (int64_t r = 0; r < num_requests; ++r) {
        const int64_t blocks = ((int64_t)seq_lens[r] + block_size - 1) / block_size;
        if (seq_lens[r] < 1 || blocks > width) return 0;
        if (masks && masks[r] && 63 - __builtin_clzll(masks[r]) >= seq_lens[r]) return 0;
        int64_t first, walk;
        row_span(&sh, r, seq_lens[r], &first, &walk);
        for (int64_t b = first / block_size; b < blocks; ++b)
            if (tables[r * stride + b] < 0 || tables[r * stride + b] >= num_blocks) return 0;
    }
    return 1;
}

/* How a decode's rows are walked: each row's walk length (row_span's: a tree row's base, else its
 * context), the groups, how many parts each group's KV heads are split into, and whether each
 * chunk of the groups' contexts is a work item of its own (`chunked`: their states go to
 * `partial`, then each group and part merges its chunks in order). The caller's memory: walk
 * and groups [rows], item0 and offset [rows + 1]; partial is plan_partial's. */
typedef struct {
    int32_t *walk;
    Group *groups;
    int64_t *item0, *offset; /* chunked: a group's first item, and its first float in partial */
    int64_t num_groups, splits, cap; /* cap: rows a group holds at most */
    int64_t chunked;
    float *partial;
    int64_t partial_floats; /* partial's size */
} DecodePlan;

static void plan_decode(const Shape *sh, const int32_t *tables, int64_t stride, const int32_t *seq_lens,
                        int64_t num_requests, int64_t threads, DecodePlan *plan) {
    for (int64_t r = 0; r < num_requests; ++r) {
        int64_t first, length;
        row_span(sh, r, seq_lens[r], &first, &length);
        plan->walk[r] = (int32_t)length;
    }
    /* Small enough groups that every thread gets one, large enough to share a prefix; under
     * a window every row alone (group_end then reads no table entry). */
    const int64_t per_thread = (num_requests + threads - 1) / threads;
    plan->cap = sh->window > 0 ? 1 : per_thread < MAX_GROUP ? (per_thread > 0 ? per_thread : 1) : MAX_GROUP;
    int64_t chunks = 0;
    plan->num_groups = 0;
    for (int64_t first = 0; first < num_requests; ++plan->num_groups) {
        const int64_t last = group_end(tables, stride, first, num_requests, plan->cap);
        const Group g = group_at(sh, tables, stride, plan->walk, seq_lens, first, last);
        plan->groups[plan->num_groups] = g;
        chunks += g.chunks - g.chunk0;
        first = last;
    }
    /* Fewer groups than threads (a batch of one): each group's KV heads are split between
     * threads too, and where that still leaves fewer than two items a thread, the chunks are
     * items too (then the heads stay whole where the chunks alone give two items a thread).
     * The int8 path of AVX-512 walks every head at once. */
    int64_t splits = plan->num_groups < threads ? threads / plan->num_groups : 1;
#ifdef FAST_I8
    if (sh->int8) splits = 1;
#endif
    splits = splits > sh->num_kv_heads ? sh->num_kv_heads : splits;
    plan->chunked = plan->num_groups * splits < 2 * threads && chunks > plan->num_groups;
    plan->splits = plan->chunked && chunks >= 2 * threads ? 1 : splits;
    if (!plan->chunked) return;
    const int64_t entry = vectors_of(sh->head_dim) * VW + 2; /* a head's acc, m and l */
    plan->item0[0] = plan->offset[0] = 0;
    for (int64_t g = 0; g < plan->num_groups; ++g) {
        const Group *grp = plan->groups + g;
        const int64_t n = grp->chunks - grp->chunk0;
        plan->item0[g + 1] = plan->item0[g] + n * plan->splits;
        plan->offset[g + 1] = plan->offset[g] + n * (grp->last - grp->first) * sh->num_heads * entry;
    }
}

/* partial made large enough for a chunked plan; where it cannot be had the plan walks each
 * group whole instead (the same floats, on fewer threads). */
static void plan_partial(DecodePlan *plan) {
    if (!plan->chunked) return;
    const int64_t need = plan->offset[plan->num_groups];
    if (need <= plan->partial_floats) return;
    free(plan->partial);
    plan->partial = (float *)malloc(sizeof(float) * need);
    plan->partial_floats = plan->partial ? need : 0;
    if (!plan->partial) plan->chunked = 0;
}

/* Per-thread scratch of a decode whose groups hold at most cap rows: their query rows and running
 * state, a chunk's state, an int8 block's tile; NULL memory when it cannot be had. */
typedef struct {
    Rows rows, chunk;
    Tile tile;
    float *memory;
} DecodeScratch;

static DecodeScratch decode_scratch(const Shape *sh, int64_t cap) {
    const int64_t n = cap * sh->num_heads, p = vectors_of(sh->head_dim) * VW;
    /* A tile holds at least VW tokens: attend_block_i8 converts 16 at a time. */
    const int64_t tile = (sh->block_size > VW ? sh->block_size : VW) * p, scales = vectors_of(sh->block_size) * VW;
    float *f = (float *)malloc(sizeof(float) * (n * (3 * p + 4) + 2 * (tile + scales)));
    DecodeScratch s = {{0}, {0}, {0}, f};
    if (!f) return s;
    const Rows rows = {f, f + n * p, f + 2 * n * p, f + 2 * n * p + n, p};
    const Rows chunk = {f, f + 2 * n * p + 2 * n, f + 3 * n * p + 2 * n, f + 3 * n * p + 3 * n, p};
    float *t = f + n * (3 * p + 4);
    const Tile block = {t, t + tile, t + 2 * tile, t + 2 * tile + scales};
    s.rows = rows, s.chunk = chunk, s.tile = block;
    return s;
}

/* Shape sh restricted to part `part` of `parts` of its KV heads. */
static Shape heads_part(const Shape *sh, int64_t part, int64_t parts) {
    Shape heads = *sh;
    heads.kv_first = sh->num_kv_heads * part / parts, heads.kv_last = sh->num_kv_heads * (part + 1) / parts;
    return heads;
}

/* Chunk item `item` of a chunked plan: its state into partial. */
static void chunk_item(const Shape *sh, const float *q, const DecodePlan *plan, int64_t item, DecodeScratch *s) {
    int64_t g = 0;
    while (plan->item0[g + 1] <= item) ++g;
    const Group *grp = plan->groups + g;
    const int64_t k = (item - plan->item0[g]) / plan->splits, h = sh->num_heads;
    const int64_t n = (grp->last - grp->first) * h, p = s->rows.padded, entry = p + 2;
    const Shape heads = heads_part(sh, (item - plan->item0[g]) % plan->splits, plan->splits);
    load_rows(&heads, q + grp->first * h * sh->head_dim, grp->last - grp->first, &s->rows);
    attend_chunk(&heads, grp, grp->chunk0 + k, &s->rows, &s->tile);
    float *dst = plan->partial + plan->offset[g] + k * n * entry;
    for (int64_t i = 0; i < n; ++i)
        if (in_heads(&heads, i)) {
            memcpy(dst + i * entry, s->rows.acc + i * p, sizeof(float) * p);
            dst[i * entry + p] = s->rows.m[i], dst[i * entry + p + 1] = s->rows.l[i];
        }
}

/* A group and part of a chunked plan: its chunks' states merged in order as attend_group merges
 * them, then finished. */
static void merge_item(const Shape *sh, const float *q, const DecodePlan *plan, int64_t item, float *out,
                       DecodeScratch *s) {
    const Group *grp = plan->groups + item / plan->splits;
    const Shape heads = heads_part(sh, item % plan->splits, plan->splits);
    const int64_t n = (grp->last - grp->first) * sh->num_heads, p = s->rows.padded, entry = p + 2;
    load_rows(&heads, q + grp->first * sh->num_heads * sh->head_dim, grp->last - grp->first, &s->rows);
    for (int64_t k = 0; k < grp->chunks - grp->chunk0; ++k) {
        const float *src = plan->partial + plan->offset[item / plan->splits] + k * n * entry;
        for (int64_t i = 0; i < n; ++i)
            if (in_heads(&heads, i))
                merge_state(s->rows.acc + i * p, s->rows.m + i, s->rows.l + i, src + i * entry, src[i * entry + p],
                            src[i * entry + p + 1], p);
    }
    finish_group(&heads, grp, out, &s->rows, &s->tile);
}

/* The plan's work items shared among the threads of the enclosing parallel region (orphaned
 * worksharing loops: every thread of the team calls this; it ends in a loop's barrier), each
 * thread with its own scratch, sized for at least the plan's cap. */
static void attend_items(const Shape *sh, const float *q, const DecodePlan *plan, float *out, DecodeScratch *s) {
    if (!plan->chunked) {
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < plan->num_groups * plan->splits; ++item) {
            const Shape heads = heads_part(sh, item % plan->splits, plan->splits);
            attend_group(&heads, q, plan->groups + item / plan->splits, out, &s->rows, &s->chunk, &s->tile);
        }
        return;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < plan->item0[plan->num_groups]; ++item) chunk_item(sh, q, plan, item, s);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < plan->num_groups * plan->splits; ++item) merge_item(sh, q, plan, item, out, s);
}

/* A plan's memory for up to `rows` rows (partial apart: plan_partial's); 0 when it cannot be had. */
static int plan_memory(DecodePlan *plan, int64_t rows) {
    const int64_t n = rows > 0 ? rows : 1;
    memset(plan, 0, sizeof(*plan));
    plan->walk = (int32_t *)malloc(sizeof(int32_t) * n);
    plan->groups = (Group *)malloc(sizeof(Group) * n);
    plan->item0 = (int64_t *)malloc(sizeof(int64_t) * 2 * (n + 1));
    plan->offset = plan->item0 ? plan->item0 + n + 1 : NULL;
    return plan->walk && plan->groups && plan->item0;
}

static void plan_free(DecodePlan *plan) {
    free(plan->walk), free(plan->groups), free(plan->item0), free(plan->partial);
}

/* Attend for every request; returns 0, -1 when scratch memory cannot be had, -2 (nothing
 * read) when a length or block id is out of range. */
static int decode_pages(const Shape *shape, const float *q, int64_t num_blocks, const int32_t *block_tables,
                        int64_t table_stride, int64_t table_width, const int32_t *seq_lens, float *out,
                        int64_t num_requests) {
    const Shape sh = *shape;
    if (!tables_valid(block_tables, table_stride, table_width, seq_lens, num_requests, sh.block_size, num_blocks,
                      sh.window, sh.masks))
        return -2;
    DecodePlan plan;
    if (!plan_memory(&plan, num_requests)) {
        plan_free(&plan);
        return -1;
    }
    plan_decode(&sh, block_tables, table_stride, seq_lens, num_requests, max_threads(), &plan);
    plan_partial(&plan);
    int failed = 0;
#pragma omp parallel
    {
        DecodeScratch scratch = decode_scratch(&sh, plan.cap);
        if (!scratch.memory) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) attend_items(&sh, q, &plan, out, &scratch);
        free(scratch.memory);
    }
    plan_free(&plan);
    return failed ? -1 : 0;
}

int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache, int64_t num_blocks,
                               const int32_t *block_tables, int64_t table_stride, int64_t table_width,
                               const int32_t *seq_lens, float *out, int64_t num_requests,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, float scale, int64_t window, const float *sinks,
                               const uint64_t *masks) {
    Shape sh = float_shape(k_cache, v_cache, num_heads, num_kv_heads, head_dim, block_size, scale);
    sh.window = window;
    sh.sinks = sinks;
    sh.masks = masks;
    return decode_pages(&sh, q, num_blocks, block_tables, table_stride, table_width, seq_lens, out, num_requests);
}

/* The same over int8 pages of page_bytes, scales from code_bytes on. */
int paged_decode_attention_i8(const float *q, const void *k_pages, const void *v_pages, int64_t num_blocks,
                              int64_t page_bytes, int64_t code_bytes, const int32_t *block_tables,
                              int64_t table_stride, int64_t table_width, const int32_t *seq_lens, float *out,
                              int64_t num_requests, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, float scale, int64_t window, const float *sinks,
                              const uint64_t *masks) {
    const Shape sh = {(const char *)k_pages, (const char *)v_pages, page_bytes, code_bytes, 1,
                      num_heads, num_kv_heads, head_dim, block_size, scale, window, sinks, masks};
    return decode_pages(&sh, q, num_blocks, block_tables, table_stride, table_width, seq_lens, out, num_requests);
}

/* k_cache/v_cache row slots[t] = k/v row t, for every new token t; returns 0, or -2 (and
 * writes nothing) when a slot is outside the pool's num_slots rows. */
static int slots_valid(const int64_t *slots, int64_t tokens, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return 0;
    return 1;
}

/* k and v's token rows are `ld` floats apart (views of a fused qkv row: ld >= row). */
int paged_store_f32(const float *k, const float *v, int64_t ld, float *k_cache, float *v_cache, const int64_t *slots,
                    int64_t tokens, int64_t row, int64_t num_slots) {
    if (!slots_valid(slots, tokens, num_slots)) return -2;
#pragma omp parallel for schedule(static) if (tokens >= 256)
    for (int64_t t = 0; t < tokens; ++t) {
        memcpy(k_cache + slots[t] * row, k + t * ld, sizeof(float) * row);
        memcpy(v_cache + slots[t] * row, v + t * ld, sizeof(float) * row);
    }
    return 0;
}

/* One token's K and V rows (every KV head) quantized into their int8 pages at `slot`. */
static void store_heads_i8(const Shape *sh, const float *k, const float *v, char *k_pages, char *v_pages,
                           int64_t slot, int64_t first, int64_t end) {
    const int64_t h = sh->num_kv_heads, d = sh->head_dim, off = slot % sh->block_size;
    char *kp = k_pages + (slot / sh->block_size) * sh->page_bytes, *vp = v_pages + (slot / sh->block_size) * sh->page_bytes;
    for (int64_t j = first; j < end; ++j) {
        quantize_row(k + j * d, d, (int8_t *)kp + (off * h + j) * d, (float *)(kp + sh->code_bytes) + off * h + j);
        quantize_row(v + j * d, d, (int8_t *)vp + (off * h + j) * d, (float *)(vp + sh->code_bytes) + off * h + j);
    }
}

/* A token's K and V rows of every KV head into their int8 pages at `slot`. */
static void store_token_i8(const Shape *sh, const float *k, const float *v, char *k_pages, char *v_pages,
                           int64_t slot) {
    store_heads_i8(sh, k, v, k_pages, v_pages, slot, 0, sh->num_kv_heads);
}

/* k and v's token rows are `ld` floats apart, as in paged_store_f32. */
int paged_store_i8(const float *k, const float *v, int64_t ld, void *k_pages, void *v_pages, const int64_t *slots,
                   int64_t tokens, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                   int64_t page_bytes, int64_t code_bytes, int64_t num_slots) {
    if (!slots_valid(slots, tokens, num_slots)) return -2;
    const Shape sh = {(const char *)k_pages, (const char *)v_pages, page_bytes, code_bytes, 1,
                      num_kv_heads, num_kv_heads, head_dim, block_size, 1.0f};
#pragma omp parallel for schedule(static) if (tokens >= 256)
    for (int64_t t = 0; t < tokens; ++t)
        store_token_i8(&sh, k + t * ld, v + t * ld, (char *)k_pages, (char *)v_pages, slots[t]);
    return 0;
}
