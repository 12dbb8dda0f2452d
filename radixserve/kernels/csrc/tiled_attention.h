/*
 * Tiled causal attention over the paged KV pool (flash-attention style), written once over
 * the pool's element type. The includer defines:
 *   KV_T              the pool's element (float; char for int8 pages of codes and scales)
 *   KV_SUFFIX         the suffix of this instantiation's names (f32, i8)
 *   KV_ROW(cache, block, offset, head, shape, tmp)
 *                     a const float * to the head_dim floats of one token's head: in place,
 *                     or dequantized into tmp (a scratch row of head_dim floats)
 * Packing a tile is the only place that reads the pool, so a quantized pool (codes and
 * their per-token-head scales in one block) changes KV_ROW and nothing else.
 *
 * One work item is a block of query rows of one chunk and one KV head: its rows are the
 * `group` query heads that share the KV head, for each of up to Q_ROWS / group positions,
 * laid out position-major (row i is position i / group, head i % group). The item walks
 * its context in tiles of TILE_KEYS keys; each tile is gathered once from the block table
 * into K^T [head_dim][TILE_KEYS] and V [TILE_KEYS][padded_dim] (no copy of the whole
 * context) and then serves every row of the item, TILE_ROWS rows at a time:
 *
 *   S = Q K^T (TILE_ROWS x TILE_KEYS, in registers) -> mask past each row's last key ->
 *   online softmax (running max m, sum l; the row's O is rescaled once per tile) -> O += P V
 *
 * With bf16 dot products (AVX512_BF16 builds, head_dim a multiple of 2 * VW) the tile is packed
 * as bfloat16 pairs instead (PairTile) and both products run `vdpbf16ps`: q . k over pairs of
 * dims, P V over pairs of keys, each product rounded to bf16 on the way in and summed in float32.
 * The softmax, the masking and O stay float32; only the inputs of the two products lose bits.
 *
 * Scores are in log2 units (q is pre-scaled by scale * log2(e)), so weights are exp2.
 * Query row position r of a chunk whose context is `context` after the step, and which
 * brings n new tokens, sees keys [0, context - n + r]; every row sees key 0, so after the
 * first tile every row's m is finite.
 *
 * Sliding window (window W > 0): that row sees keys [context - n + r - W + 1, context - n + r]
 * only. An item walks its keys from its first row's first key (no table entry of a block before
 * it is read), masks each row's keys before its window, and skips row groups the tile is
 * wholly before; a row that sees none of a tile (its window not reached yet) takes no weight
 * from it, so its m stays MASKED until its first key.
 *
 * Attention sinks (`sinks` non-NULL: one logit per query head, gpt-oss): a row's softmax
 * denominator also counts exp(sink), joined with the row's final (m, l) after its last tile.
 */
#ifndef RADIXSERVE_TILED_ATTENTION_COMMON
#define RADIXSERVE_TILED_ATTENTION_COMMON
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define TILE_VECS 4                 /* vectors per micro-tile row: all TILE_KEYS of S, or 4 VW of O */
#define TILE_KEYS (TILE_VECS * VW)  /* keys per tile */
#define TILE_ROWS (VW == 8 ? 2 : 6) /* rows per micro-tile: TILE_ROWS x TILE_VECS accumulators */
#define MASKED (-1e30f)             /* a score no row can reach; finite, as -ffast-math wants */
#define PASTE_(a, b) a##_##b
#define PASTE(a, b) PASTE_(a, b)

typedef struct {
    const void *k_cache, *v_cache;
    int64_t num_heads, num_kv_heads, head_dim, padded_dim, block_size;
    float scale_log2;
    int64_t page_bytes, code_bytes; /* int8 pages (paged_attention.c): a block's bytes, where its scales start */
    int64_t window;                 /* sliding window, 0: the whole causal context */
    int64_t q_stride;               /* floats between q's token rows (>= num_heads * head_dim) */
    const float *sinks;             /* [num_heads] natural-log logits, or NULL: no sinks */
} TileShape;

/* A row's normaliser: 1 / l, or with a sink (natural-log logit) the sink's exp(sink) joined
 * to the keys' (m, l) (log2 units) under a common max, so neither term overflows. */
static inline float tile_normaliser(float m, float l, const float *sink) {
    if (!sink) return 1.0f / l;
    const float s = *sink * 1.4426950408889634f, top = s > m ? s : m, keep = exp2f(m - top);
    return keep / (l * keep + exp2f(s - top));
}

/* The state of one work item: its query rows and their running softmax. */
typedef struct {
    float *q;      /* [rows][head_dim], pre-scaled */
    float *o;      /* [rows][padded_dim] unnormalised output */
    float *m;      /* [rows] */
    float *l;      /* [rows][VW] each row's sum of weights, in VW partial sums */
    int64_t *last; /* [rows] the last key position each row sees, nondecreasing */
    int64_t rows;  /* a multiple of TILE_ROWS; the padding rows repeat the last real row's `last` */
} TileRows;

/* A tile's packed keys and values, and the micro-tile's weights. */
typedef struct {
    float *kt;    /* [head_dim][TILE_KEYS] */
    float *v;     /* [TILE_KEYS][padded_dim] */
    float *p;     /* [TILE_ROWS][TILE_KEYS] */
    float *alpha; /* [TILE_ROWS] */
    float *tmp;   /* [VW][head_dim] for KV_ROW */
} Tile;

/* S = q[TILE_ROWS rows] k^T into s (TILE_ROWS x TILE_VECS), over the first nv vectors of keys of
 * kt (rows TILE_KEYS floats apart); the other vectors of s are zeros. */
static inline __attribute__((always_inline)) void tile_scores_n(const float *q, const float *kt, int64_t head_dim,
                                                               vf s[TILE_ROWS][TILE_VECS], int nv) {
    for (int i = 0; i < TILE_ROWS; ++i)
        for (int v = 0; v < TILE_VECS; ++v) s[i][v] = v_set1(0.0f);
    for (int64_t d = 0; d < head_dim; ++d) {
        vf k[TILE_VECS];
        for (int v = 0; v < nv; ++v) k[v] = v_load(kt + d * TILE_KEYS + v * VW);
        for (int i = 0; i < TILE_ROWS; ++i) {
            const vf x = v_set1(q[i * head_dim + d]);
            for (int v = 0; v < nv; ++v) s[i][v] = v_fma(x, k[v], s[i][v]);
        }
    }
}

/* tile_scores_n compiled for each count of vectors (1 ... TILE_VECS). */
static inline void tile_scores(const float *q, const float *kt, int64_t head_dim, vf s[TILE_ROWS][TILE_VECS], int nv) {
    switch (nv) {
    case 1: tile_scores_n(q, kt, head_dim, s, 1); break;
    case 2: tile_scores_n(q, kt, head_dim, s, 2); break;
    case 3: tile_scores_n(q, kt, head_dim, s, 3); break;
    default: tile_scores_n(q, kt, head_dim, s, TILE_VECS); break;
    }
}

/* Fold the scores of TILE_ROWS rows (keys k0 ...) into their running m and l: weights into
 * tile->p, each row's rescale of its old O into tile->alpha. A row's m moves only when a score
 * passes it by more than RESCALE_SLACK (log2 units), and then to the tile's max: so m stays
 * within RESCALE_SLACK below every score seen (weights <= 2^RESCALE_SLACK, far from overflow),
 * and once it settles a tile costs no horizontal max, no rescale and no exp2 of alpha. The
 * result is the same softmax: O and l carry the same shift. */
#define RESCALE_SLACK 8.0f
static inline __attribute__((always_inline)) void tile_softmax(vf s[TILE_ROWS][TILE_VECS], const int64_t *last, int64_t k0,
                                                              int64_t nk, int64_t window, float *m, float *l,
                                                              Tile *tile, int for_bf16) {
    for (int i = 0; i < TILE_ROWS; ++i) {
        const int64_t visible = last[i] - k0 + 1 < nk ? last[i] - k0 + 1 : nk;
        if (visible < TILE_KEYS)
            for (int v = 0; v < TILE_VECS; ++v) s[i][v] = v_keep(s[i][v], visible - v * VW, MASKED);
        if (window > 0) {
            const int64_t hidden = last[i] - window + 1 - k0; /* the tile's keys before the row's window */
            if (hidden >= visible || hidden >= TILE_KEYS || visible <= 0) {
                memset(tile->p + i * TILE_KEYS, 0, sizeof(float) * TILE_KEYS);
                tile->alpha[i] = 1.0f;
                continue;
            }
            for (int v = 0; v < TILE_VECS; ++v) s[i][v] = v_drop(s[i][v], hidden - v * VW, MASKED);
        }
        vf top = s[i][0];
        for (int v = 1; v < TILE_VECS; ++v) top = v_max(top, s[i][v]);
        vf sum = v_load(l + i * VW);
        float alpha = 1.0f;
        if (v_any_above(top, m[i] + RESCALE_SLACK)) {
            const float m_new = v_hmax(top);
            alpha = v_first(v_exp2(v_set1(m[i] - m_new))); /* ~0 on the first tile, where m is MASKED */
            sum = v_mul(sum, v_set1(alpha));
            m[i] = m_new;
        }
        tile->alpha[i] = alpha;
        const vf shift = v_set1(m[i]);
        for (int v = 0; v < TILE_VECS; ++v) {
            const vf x = v_sub(s[i][v], shift);
            const vf w = for_bf16 ? v_exp2_coarse(x) : v_exp2(x); /* bf16 keeps 8 bits of w anyway */
            sum = v_add(sum, w);
            v_store(tile->p + i * TILE_KEYS + v * VW, w);
        }
        v_store(l + i * VW, sum);
    }
}

/* o[TILE_ROWS rows] = o * alpha + p v over keys [t0, t1) of p (rows TILE_KEYS floats apart) and
 * v (rows padded_dim floats apart), TILE_VECS vectors of o at a time. */
static inline void tile_accumulate(float *o, const float *p, const float *v, const float *alpha, int64_t t0,
                                   int64_t t1, int64_t padded_dim) {
    for (int64_t d0 = 0; d0 < padded_dim; d0 += TILE_VECS * VW) {
        vf acc[TILE_ROWS][TILE_VECS];
        for (int i = 0; i < TILE_ROWS; ++i) {
            const vf a = v_set1(alpha[i]);
            for (int u = 0; u < TILE_VECS; ++u) acc[i][u] = v_mul(v_load(o + i * padded_dim + d0 + u * VW), a);
        }
        for (int64_t t = t0; t < t1; ++t) {
            vf x[TILE_VECS];
            for (int u = 0; u < TILE_VECS; ++u) x[u] = v_load(v + t * padded_dim + d0 + u * VW);
            for (int i = 0; i < TILE_ROWS; ++i) {
                const vf w = v_set1(p[i * TILE_KEYS + t]);
                for (int u = 0; u < TILE_VECS; ++u) acc[i][u] = v_fma(w, x[u], acc[i][u]);
            }
        }
        for (int i = 0; i < TILE_ROWS; ++i)
            for (int u = 0; u < TILE_VECS; ++u) v_store(o + i * padded_dim + d0 + u * VW, acc[i][u]);
    }
}

/* Whether the row group from row i sees no key of the tile [k0, k0 + nk): all before it, or
 * (sliding window) all after. */
static inline int group_misses(const TileRows *rows, int64_t i, int64_t k0, int64_t nk, int64_t window) {
    return rows->last[i + TILE_ROWS - 1] < k0 || (window > 0 && rows->last[i] - window + 1 >= k0 + nk);
}

/* Every row group of `rows` that sees any key of the tile starting at k0 (nk keys), over only
 * the keys the group sees: its scores from the first to the last vector of keys any of its rows
 * sees (a sub-tile from vector v0 on), its sum over exactly those keys. A key no row of the
 * group sees would take a weight of ~2^-126 (v_exp2's floor), which no sum can see. */
static inline __attribute__((always_inline)) void tile_fold_in(const TileShape *sh, TileRows *rows, Tile *tile,
                                                              int64_t k0, int64_t nk, int64_t window) {
    const int64_t d = sh->head_dim, dp = sh->padded_dim;
    for (int64_t i = 0; i < rows->rows; i += TILE_ROWS) {
        if (group_misses(rows, i, k0, nk, window)) continue;
        const int64_t first = window > 0 && rows->last[i] - window + 1 > k0 ? rows->last[i] - window + 1 - k0 : 0;
        const int64_t end = rows->last[i + TILE_ROWS - 1] - k0 + 1 < nk ? rows->last[i + TILE_ROWS - 1] - k0 + 1 : nk;
        const int64_t v0 = first / VW, sub = v0 * VW;
        vf s[TILE_ROWS][TILE_VECS];
        tile_scores(rows->q + i * d, tile->kt + sub, d, s, (int)((end - sub + VW - 1) / VW));
        tile_softmax(s, rows->last + i, k0 + sub, nk - sub, window, rows->m + i, rows->l + i * VW, tile, 0);
        tile_accumulate(rows->o + i * dp, tile->p, tile->v + sub * dp, tile->alpha, first - sub, end - sub, dp);
    }
}

/* tile_fold_in compiled apart for full causal attention (window 0, a constant) and for a window. */
static void tile_fold(const TileShape *sh, TileRows *rows, Tile *tile, int64_t k0, int64_t nk) {
    if (sh->window > 0) tile_fold_in(sh, rows, tile, k0, nk, sh->window);
    else tile_fold_in(sh, rows, tile, k0, nk, 0);
}

/* The bf16 path's operands: a uint32 holds two bfloat16, the lower-indexed one in its low half. */
typedef struct {
    uint32_t *q;  /* [rows][head_dim / 2] each row's pre-scaled q, dims (2x, 2x + 1) */
    uint32_t *kt; /* [head_dim / 2][TILE_KEYS] dims (2x, 2x + 1) of each key */
    uint32_t *v;  /* [TILE_KEYS / 2][padded_dim] keys (2t, 2t + 1) of each dim */
    uint32_t *p;  /* [TILE_ROWS][TILE_KEYS / 2] weights of keys (2t, 2t + 1) */
} PairTile;

#if defined(__AVX512BF16__) && VW == 16
#define HAVE_BF16_DOTS 1
/* 32 floats (lo: the first 16) as 16 bf16 pairs, in order. */
static inline __m512i to_pairs(vf lo, vf hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

/* Lane j of the result: (a[j], b[j]) as one bf16 pair. */
static inline __m512i interleave_pairs(vf a, vf b) {
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

static inline vf dot_pairs(vf acc, uint32_t a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)a), (__m512bh)b);
}

/* tile_scores over bf16 pairs: half the dot-product instructions. */
static inline void tile_scores_pairs(const uint32_t *q, const uint32_t *kt, int64_t half_dim,
                                     vf s[TILE_ROWS][TILE_VECS]) {
    for (int i = 0; i < TILE_ROWS; ++i)
        for (int v = 0; v < TILE_VECS; ++v) s[i][v] = v_set1(0.0f);
    for (int64_t x = 0; x < half_dim; ++x) {
        __m512i k[TILE_VECS];
        for (int v = 0; v < TILE_VECS; ++v) k[v] = _mm512_loadu_si512(kt + x * TILE_KEYS + v * VW);
        for (int i = 0; i < TILE_ROWS; ++i)
            for (int v = 0; v < TILE_VECS; ++v) s[i][v] = dot_pairs(s[i][v], q[i * half_dim + x], k[v]);
    }
}

/* tile_accumulate over bf16 pairs of keys; the tile's weights are rounded to bf16 first. */
static inline void tile_accumulate_pairs(float *o, const Tile *tile, PairTile *pairs, int64_t nk,
                                         int64_t padded_dim) {
    for (int i = 0; i < TILE_ROWS; ++i)
        for (int v = 0; v < TILE_VECS; v += 2) {
            const float *w = tile->p + i * TILE_KEYS + v * VW;
            _mm512_storeu_si512(pairs->p + i * (TILE_KEYS / 2) + v * (VW / 2), to_pairs(v_load(w), v_load(w + VW)));
        }
    for (int64_t d0 = 0; d0 < padded_dim; d0 += TILE_VECS * VW) {
        vf acc[TILE_ROWS][TILE_VECS];
        for (int i = 0; i < TILE_ROWS; ++i) {
            const vf a = v_set1(tile->alpha[i]);
            for (int v = 0; v < TILE_VECS; ++v) acc[i][v] = v_mul(v_load(o + i * padded_dim + d0 + v * VW), a);
        }
        for (int64_t t = 0; t < (nk + 1) / 2; ++t) {
            __m512i x[TILE_VECS];
            for (int v = 0; v < TILE_VECS; ++v) x[v] = _mm512_loadu_si512(pairs->v + t * padded_dim + d0 + v * VW);
            for (int i = 0; i < TILE_ROWS; ++i) {
                const uint32_t w = pairs->p[i * (TILE_KEYS / 2) + t];
                for (int v = 0; v < TILE_VECS; ++v) acc[i][v] = dot_pairs(acc[i][v], w, x[v]);
            }
        }
        for (int i = 0; i < TILE_ROWS; ++i)
            for (int v = 0; v < TILE_VECS; ++v) v_store(o + i * padded_dim + d0 + v * VW, acc[i][v]);
    }
}

/* tile_fold_in over the pair-packed tile. */
static inline __attribute__((always_inline)) void tile_fold_pairs_in(const TileShape *sh, TileRows *rows, Tile *tile,
                                                                    PairTile *pairs, int64_t k0, int64_t nk,
                                                                    int64_t window) {
    const int64_t half = sh->head_dim / 2, dp = sh->padded_dim;
    for (int64_t i = 0; i < rows->rows; i += TILE_ROWS) {
        if (group_misses(rows, i, k0, nk, window)) continue;
        vf s[TILE_ROWS][TILE_VECS];
        tile_scores_pairs(pairs->q + i * half, pairs->kt, half, s);
        tile_softmax(s, rows->last + i, k0, nk, window, rows->m + i, rows->l + i * VW, tile, 1);
        tile_accumulate_pairs(rows->o + i * dp, tile, pairs, nk, dp);
    }
}

static void tile_fold_pairs(const TileShape *sh, TileRows *rows, Tile *tile, PairTile *pairs, int64_t k0,
                            int64_t nk) {
    if (sh->window > 0) tile_fold_pairs_in(sh, rows, tile, pairs, k0, nk, sh->window);
    else tile_fold_pairs_in(sh, rows, tile, pairs, k0, nk, 0);
}

/* Each row's pre-scaled q as bf16 pairs (head_dim a multiple of 2 * VW). */
static void rows_to_pairs(const TileRows *rows, int64_t head_dim, PairTile *pairs) {
    for (int64_t i = 0; i < rows->rows; ++i)
        for (int64_t x0 = 0; x0 < head_dim; x0 += 2 * VW) {
            const float *q = rows->q + i * head_dim + x0;
            _mm512_storeu_si512(pairs->q + (i * head_dim + x0) / 2, to_pairs(v_load(q), v_load(q + VW)));
        }
}
#else
#define HAVE_BF16_DOTS 0
#endif
#endif

#ifndef KV_SUFFIX
#error "define KV_T, KV_SUFFIX and KV_ROW before including tiled_attention.h"
#endif

/* Keys [k0, k0 + nk) into tile->kt, transposed VW keys x VW dims at a time in registers
 * (head_dim a multiple of VW), else one float at a time. */
static void PASTE(tile_pack_keys, KV_SUFFIX)(const TileShape *sh, const int32_t *table, int64_t head, int64_t k0,
                                              int64_t nk, Tile *tile) {
    const int64_t d = sh->head_dim, bs = sh->block_size;
    const KV_T *cache = (const KV_T *)sh->k_cache;
    if (d % VW) {
        for (int64_t t = 0; t < nk; ++t) {
            const float *k = KV_ROW(cache, table[(k0 + t) / bs], (k0 + t) % bs, head, sh, tile->tmp);
            for (int64_t x = 0; x < d; ++x) tile->kt[x * TILE_KEYS + t] = k[x];
        }
        return;
    }
    for (int64_t t0 = 0; t0 < nk; t0 += VW) {
        const float *k[VW];
        const int64_t n = nk - t0 < VW ? nk - t0 : VW;
        for (int64_t i = 0; i < n; ++i)
            k[i] = KV_ROW(cache, table[(k0 + t0 + i) / bs], (k0 + t0 + i) % bs, head, sh, tile->tmp + i * d);
        for (int64_t x0 = 0; x0 < d; x0 += VW) {
            vf r[VW];
            for (int64_t i = 0; i < VW; ++i) r[i] = i < n ? v_load(k[i] + x0) : v_set1(0.0f);
            v_transpose(r);
            for (int64_t j = 0; j < VW; ++j) v_store(tile->kt + (x0 + j) * TILE_KEYS + t0, r[j]);
        }
    }
}

/* Gather keys and values [k0, k0 + nk) of KV head `head` through `table` into tile->kt
 * (transposed) and tile->v; the columns and rows past nk are zeros. */
static void PASTE(tile_pack, KV_SUFFIX)(const TileShape *sh, const int32_t *table, int64_t head, int64_t k0,
                                         int64_t nk, Tile *tile) {
    const int64_t d = sh->head_dim, dp = sh->padded_dim, bs = sh->block_size;
    const KV_T *v_cache = (const KV_T *)sh->v_cache;
    if (nk < TILE_KEYS) {
        memset(tile->kt, 0, sizeof(float) * d * TILE_KEYS);
        memset(tile->v + nk * dp, 0, sizeof(float) * (TILE_KEYS - nk) * dp);
    }
    PASTE(tile_pack_keys, KV_SUFFIX)(sh, table, head, k0, nk, tile);
    for (int64_t t = 0; t < nk; ++t) {
        const float *v = KV_ROW(v_cache, table[(k0 + t) / bs], (k0 + t) % bs, head, sh, tile->tmp);
        float *dst = tile->v + t * dp;
        memcpy(dst, v, sizeof(float) * d);
        for (int64_t x = d; x < dp; ++x) dst[x] = 0.0f;
    }
}

#if HAVE_BF16_DOTS
/* Keys and values [k0, k0 + nk) of KV head `head` as bf16 pairs: pairs->kt (dims paired, keys
 * transposed as in tile_pack_keys) and pairs->v (keys paired); the keys and values past nk are zeros. */
static void PASTE(tile_pack_pairs, KV_SUFFIX)(const TileShape *sh, const int32_t *table, int64_t head, int64_t k0,
                                               int64_t nk, Tile *tile, PairTile *pairs) {
    const int64_t d = sh->head_dim, dp = sh->padded_dim, bs = sh->block_size;
    const KV_T *k_cache = (const KV_T *)sh->k_cache, *v_cache = (const KV_T *)sh->v_cache;
    if (nk < TILE_KEYS) memset(pairs->kt, 0, sizeof(uint32_t) * (d / 2) * TILE_KEYS);
    for (int64_t t0 = 0; t0 < nk; t0 += VW) {
        const float *k[VW];
        const int64_t n = nk - t0 < VW ? nk - t0 : VW;
        for (int64_t i = 0; i < n; ++i)
            k[i] = KV_ROW(k_cache, table[(k0 + t0 + i) / bs], (k0 + t0 + i) % bs, head, sh, tile->tmp + i * d);
        for (int64_t x0 = 0; x0 < d; x0 += 2 * VW) {
            vf r[VW];
            for (int64_t i = 0; i < VW; ++i)
                r[i] = i < n ? _mm512_castsi512_ps(to_pairs(v_load(k[i] + x0), v_load(k[i] + x0 + VW))) : v_set1(0.0f);
            v_transpose(r);
            for (int64_t j = 0; j < VW; ++j)
                _mm512_storeu_si512(pairs->kt + (x0 / 2 + j) * TILE_KEYS + t0, _mm512_castps_si512(r[j]));
        }
    }
    for (int64_t t = 0; t < nk; t += 2) {
        const float *a = KV_ROW(v_cache, table[(k0 + t) / bs], (k0 + t) % bs, head, sh, tile->tmp);
        const float *b = t + 1 < nk ? KV_ROW(v_cache, table[(k0 + t + 1) / bs], (k0 + t + 1) % bs, head, sh,
                                             tile->tmp + d)
                                    : NULL;
        for (int64_t x0 = 0; x0 < dp; x0 += VW) {
            const vf lo = x0 < d ? v_load(a + x0) : v_set1(0.0f);
            const vf hi = b && x0 < d ? v_load(b + x0) : v_set1(0.0f);
            _mm512_storeu_si512(pairs->v + (t / 2) * dp + x0, interleave_pairs(lo, hi));
        }
    }
}
#endif

/* Attention of one work item: rows [r0, r1) of a chunk (its first query row at q_row in
 * q and out) for KV head `head`, over the chunk's context through `table`. */
static void PASTE(tile_item, KV_SUFFIX)(const TileShape *sh, const float *q, float *out, const int32_t *table,
                                         int64_t q_row, int64_t prefix, int64_t r0, int64_t r1, int64_t head,
                                         TileRows *rows, Tile *tile, PairTile *pairs) {
    const int64_t d = sh->head_dim, dp = sh->padded_dim, group = sh->num_heads / sh->num_kv_heads;
    const int64_t real = (r1 - r0) * group;
    rows->rows = (real + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    for (int64_t i = 0; i < rows->rows; ++i) {
        const int64_t r = i < real ? r0 + i / group : r1 - 1;
        const float *src = q + (q_row + r) * sh->q_stride + (head * group + i % group) * d;
        for (int64_t x = 0; x < d; ++x) rows->q[i * d + x] = i < real ? src[x] * sh->scale_log2 : 0.0f;
        rows->last[i] = prefix + r;
        rows->m[i] = MASKED;
        v_store(rows->l + i * VW, v_set1(0.0f));
    }
    memset(rows->o, 0, sizeof(float) * rows->rows * dp);
    const int64_t end = prefix + r1; /* keys the last row sees */
    const int64_t start = sh->window > 0 && prefix + r0 + 1 > sh->window ? prefix + r0 + 1 - sh->window : 0;
#if HAVE_BF16_DOTS
    if (pairs) {
        rows_to_pairs(rows, d, pairs);
        for (int64_t k0 = start; k0 < end; k0 += TILE_KEYS) {
            const int64_t nk = end - k0 < TILE_KEYS ? end - k0 : TILE_KEYS;
            PASTE(tile_pack_pairs, KV_SUFFIX)(sh, table, head, k0, nk, tile, pairs);
            tile_fold_pairs(sh, rows, tile, pairs, k0, nk);
        }
    } else
#else
    (void)pairs;
#endif
    for (int64_t k0 = start; k0 < end; k0 += TILE_KEYS) {
        const int64_t nk = end - k0 < TILE_KEYS ? end - k0 : TILE_KEYS;
        PASTE(tile_pack, KV_SUFFIX)(sh, table, head, k0, nk, tile);
        tile_fold(sh, rows, tile, k0, nk);
    }
    for (int64_t i = 0; i < real; ++i) {
        float *dst = out + ((q_row + r0 + i / group) * sh->num_heads + head * group + i % group) * d;
        const float *sink = sh->sinks ? sh->sinks + head * group + i % group : NULL;
        const float inv = tile_normaliser(rows->m[i], v_hsum(v_load(rows->l + i * VW)), sink);
        for (int64_t x = 0; x < d; ++x) dst[x] = rows->o[i * dp + x] * inv;
    }
}
