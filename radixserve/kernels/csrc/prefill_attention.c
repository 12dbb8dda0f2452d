/*
 * Causal attention of a step's prompt chunks (whole prompts, and extends over a cached
 * prefix) on CPU in float32 (or with bf16 dot products, bf16_dots below), reading K and V straight out of the paged pool through each
 * chunk's block table: the tiled kernel of tiled_attention.h, instantiated for float pools
 * and for int8 pages (a page's codes, then its float32 scales per token and KV head, from
 * code_bytes on: kernels/quantized_pages.py), whose rows are dequantized as a tile is packed.
 * The step's new K/V are already in the pool (the store kernel runs first), so a chunk's
 * own tokens are read like its prefix.
 *
 * Work items (chunk, KV head, block of query positions) go to OpenMP threads (torch's own
 * workers, see native_build.py), the costliest first: a causal item's cost grows with the
 * position of its last row.
 *
 * Layouts (float32, contiguous but for q's rows):
 *   q, out           [num_rows, num_heads, head_dim]; chunk c owns rows query_start[c] ..
 *                    query_start[c + 1] - 1, and only those rows of out are written; q's token
 *                    rows are q_stride floats apart (a view of the fused qkv rows), out's dense
 *   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables     [num_chunks, table_stride] int32
 *   query_start      [num_chunks + 1] int32
 *   seq_lens         [num_chunks] int32: context length after the step, its new tokens included
 *
 * With a sliding window (window > 0) a chunk's table is read (and checked) only from the
 * block of its first row's first key on.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define KV_T float
#define KV_SUFFIX f32
#define KV_ROW(cache, block, offset, head, sh, tmp) \
    ((cache) + (((block) * (sh)->block_size + (offset)) * (sh)->num_kv_heads + (head)) * (sh)->head_dim)
#include "tiled_attention.h"
#undef KV_T
#undef KV_SUFFIX
#undef KV_ROW

/* One token's head of an int8 page, dequantized into tmp (head_dim floats). */
static inline const float *int8_row(const char *pages, int64_t block, int64_t offset, int64_t head,
                                    const TileShape *sh, float *tmp) {
    const char *page = pages + block * sh->page_bytes;
    const int64_t at = offset * sh->num_kv_heads + head;
    const int8_t *codes = (const int8_t *)page + at * sh->head_dim;
    const float scale = ((const float *)(page + sh->code_bytes))[at];
    for (int64_t x = 0; x < sh->head_dim; ++x) tmp[x] = (float)codes[x] * scale;
    return tmp;
}

#define KV_T char
#define KV_SUFFIX i8
#define KV_ROW(cache, block, offset, head, sh, tmp) int8_row((cache), (block), (offset), (head), (sh), (tmp))
#include "tiled_attention.h"

/* Query rows (positions x the heads of a group) per work item: each K/V tile is packed once
 * per item (single thread, 4k-token prompt: 96 rows 162 GFLOP/s, 192 rows 167, 384 rows 179;
 * Gemma 3's 8 x 144-token extends, two threads: 576 rows 1.03-1.04x 384's). */
#define Q_ROWS 576
#define MIN_POSITIONS 8

typedef struct {
    int64_t chunk, head, r0, r1, cost;
} WorkItem;

static int costlier_first(const void *a, const void *b) {
    const int64_t x = ((const WorkItem *)a)->cost, y = ((const WorkItem *)b)->cost;
    return (x < y) - (x > y);
}

/* The first key that row r of a chunk with `prefix` cached tokens sees. */
static int64_t first_key_of(int64_t prefix, int64_t r, int64_t window) {
    return window > 0 && prefix + r + 1 > window ? prefix + r + 1 - window : 0;
}

/* Rows of each chunk nonempty, inside q, and within their context; every context covered
 * by its table row, every block id it reads inside the pool. */
static int chunks_valid(const int32_t *tables, int64_t stride, int64_t width, const int32_t *starts,
                        const int32_t *seq_lens, int64_t num_chunks, int64_t num_rows, int64_t block_size,
                        int64_t num_blocks, int64_t window) {
    if (num_chunks > 0 && (starts[0] < 0 || starts[num_chunks] > num_rows)) return 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t n = (int64_t)starts[c + 1] - starts[c];
        const int64_t blocks = ((int64_t)seq_lens[c] + block_size - 1) / block_size;
        if (n < 1 || n > seq_lens[c] || blocks > width) return 0;
        for (int64_t b = first_key_of(seq_lens[c] - n, 0, window) / block_size; b < blocks; ++b)
            if (tables[c * stride + b] < 0 || tables[c * stride + b] >= num_blocks) return 0;
    }
    return 1;
}

/* How many items each chunk's rows split into (parts[c], rows shared out evenly): at most
 * `positions` positions an item, and at least `threads` items in all where the rows allow it
 * (MIN_POSITIONS an item), so that a lone small extend keeps every thread busy; returns the
 * count of items. */
static int64_t split_chunks(const int32_t *starts, int64_t num_chunks, int64_t num_kv_heads, int64_t positions,
                            int64_t threads, int64_t *parts) {
    int64_t total = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
        parts[c] = (starts[c + 1] - starts[c] + positions - 1) / positions;
        total += parts[c] * num_kv_heads;
    }
    while (total < threads) {
        int64_t best = -1, most = 0;
        for (int64_t c = 0; c < num_chunks; ++c) {
            const int64_t each = (starts[c + 1] - starts[c]) / (parts[c] + 1);
            if (each >= MIN_POSITIONS && each > most) best = c, most = each;
        }
        if (best < 0) break;
        parts[best] += 1, total += num_kv_heads;
    }
    return total;
}

/* Every chunk's (KV head, query block) items, costliest first; NULL without memory. */
static WorkItem *plan_items(const int32_t *starts, const int32_t *seq_lens, int64_t num_chunks,
                            int64_t num_kv_heads, int64_t positions, int64_t window, int64_t *count) {
#ifdef _OPENMP
    const int64_t threads = omp_get_max_threads();
#else
    const int64_t threads = 1;
#endif
    int64_t *parts = (int64_t *)malloc(sizeof(int64_t) * (num_chunks > 0 ? num_chunks : 1));
    if (!parts) return NULL;
    int64_t n = split_chunks(starts, num_chunks, num_kv_heads, positions, threads, parts);
    WorkItem *items = (WorkItem *)malloc(sizeof(WorkItem) * (n > 0 ? n : 1));
    if (!items) {
        free(parts);
        return NULL;
    }
    n = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t rows = starts[c + 1] - starts[c], prefix = seq_lens[c] - rows;
        for (int64_t j = 0; j < parts[c]; ++j) {
            const int64_t r0 = rows * j / parts[c], r1 = rows * (j + 1) / parts[c];
            for (int64_t h = 0; h < num_kv_heads; ++h)
                items[n++] = (WorkItem){c, h, r0, r1, (r1 - r0) * (prefix + r1 - first_key_of(prefix, r0, window))};
        }
    }
    free(parts);
    qsort(items, n, sizeof(WorkItem), costlier_first);
    *count = n;
    return items;
}

/* One thread's rows and tile (and the bf16 path's pairs), in one allocation; NULL without memory. */
static float *thread_scratch(const TileShape *sh, int64_t max_rows, TileRows *rows, Tile *tile, PairTile *pairs) {
    const int64_t d = sh->head_dim, dp = sh->padded_dim;
    const int64_t floats =
        max_rows * (d + dp + 1 + VW) + d * TILE_KEYS + TILE_KEYS * dp + TILE_ROWS * TILE_KEYS + TILE_ROWS + VW * d;
    const int64_t words = max_rows * (d / 2) + (d / 2) * TILE_KEYS + (TILE_KEYS / 2) * dp + TILE_ROWS * (TILE_KEYS / 2);
    float *base = (float *)malloc(sizeof(float) * floats + sizeof(int64_t) * max_rows + sizeof(uint32_t) * words);
    if (!base) return NULL;
    rows->q = base, rows->o = rows->q + max_rows * d, rows->m = rows->o + max_rows * dp, rows->l = rows->m + max_rows;
    tile->kt = rows->l + max_rows * VW, tile->v = tile->kt + d * TILE_KEYS, tile->p = tile->v + TILE_KEYS * dp;
    tile->alpha = tile->p + TILE_ROWS * TILE_KEYS, tile->tmp = tile->alpha + TILE_ROWS;
    rows->last = (int64_t *)(base + floats);
    pairs->q = (uint32_t *)(rows->last + max_rows), pairs->kt = pairs->q + max_rows * (d / 2);
    pairs->v = pairs->kt + (d / 2) * TILE_KEYS, pairs->p = pairs->v + (TILE_KEYS / 2) * dp;
    return base;
}

/* Whether this build can take bf16 dot products for a head_dim (AVX512_BF16, whole pairs of vectors). */
static int bf16_dots_fit(int64_t head_dim) { return HAVE_BF16_DOTS && head_dim % (2 * VW) == 0; }

int paged_prefill_bf16_available(int64_t head_dim) { return bf16_dots_fit(head_dim); }

/* Returns 0, -1 when scratch memory cannot be had, -2 (nothing read or written) when a
 * chunk's rows, length or block ids are out of range, -3 when bf16 dot products are asked
 * for and this build cannot take them for this head_dim. */
static int prefill_pages(const TileShape *shape, int int8, int bf16, const float *q, int64_t num_blocks,
                         const int32_t *block_tables, int64_t table_stride, int64_t table_width,
                         const int32_t *query_start, const int32_t *seq_lens, int64_t num_chunks, int64_t num_rows,
                         float *out) {
    const TileShape sh = *shape;
    const int64_t num_heads = sh.num_heads, num_kv_heads = sh.num_kv_heads;
    if (bf16 && !bf16_dots_fit(sh.head_dim)) return -3;
    if (!chunks_valid(block_tables, table_stride, table_width, query_start, seq_lens, num_chunks, num_rows,
                      sh.block_size, num_blocks, sh.window))
        return -2;
    const int64_t group = num_heads / num_kv_heads, positions = Q_ROWS / group > 0 ? Q_ROWS / group : 1;
    int64_t count = 0;
    WorkItem *items = plan_items(query_start, seq_lens, num_chunks, num_kv_heads, positions, sh.window, &count);
    if (!items) return -1;
    const int64_t max_rows = (positions * group + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    int failed = 0;
#pragma omp parallel if (count > 1)
    {
        TileRows rows = {0};
        Tile tile = {0};
        PairTile pair_tile = {0};
        float *scratch = thread_scratch(&sh, max_rows, &rows, &tile, &pair_tile);
        PairTile *pairs = bf16 ? &pair_tile : NULL;
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; ++i) {
            if (!scratch) continue;
            const WorkItem *w = items + i;
            const int64_t prefix = seq_lens[w->chunk] - (query_start[w->chunk + 1] - query_start[w->chunk]);
            if (int8)
                tile_item_i8(&sh, q, out, block_tables + w->chunk * table_stride, query_start[w->chunk], prefix,
                             w->r0, w->r1, w->head, &rows, &tile, pairs);
            else
                tile_item_f32(&sh, q, out, block_tables + w->chunk * table_stride, query_start[w->chunk], prefix,
                              w->r0, w->r1, w->head, &rows, &tile, pairs);
        }
        free(scratch);
    }
    free(items);
    return failed ? -1 : 0;
}

static int64_t padded_dim(int64_t head_dim) {
    return (head_dim + TILE_VECS * VW - 1) / (TILE_VECS * VW) * (TILE_VECS * VW);
}

int paged_prefill_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                                int64_t num_blocks,
                                const int32_t *block_tables, int64_t table_stride, int64_t table_width,
                                const int32_t *query_start, const int32_t *seq_lens, int64_t num_chunks,
                                int64_t num_rows, float *out, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t block_size, float scale, int64_t bf16_dots, int64_t window,
                                const float *sinks) {
    const TileShape sh = {k_cache, v_cache, num_heads, num_kv_heads, head_dim, padded_dim(head_dim), block_size,
                          scale * 1.4426950408889634f, 0, 0, window, q_stride, sinks};
    return prefill_pages(&sh, 0, bf16_dots != 0, q, num_blocks, block_tables, table_stride, table_width, query_start, seq_lens,
                         num_chunks, num_rows, out);
}

/* The same over int8 pages of page_bytes, scales from code_bytes on. bf16_dots (both): the
 * two products in bfloat16 (see tiled_attention.h); -3 where paged_prefill_bf16_available is 0.
 * window (both): sliding-window attention over each row's last `window` keys; 0: causal.
 * sinks (both): [num_heads] attention-sink logits (tiled_attention.h), or NULL. */
int paged_prefill_attention_i8(const float *q, int64_t q_stride, const void *k_pages, const void *v_pages,
                               int64_t num_blocks,
                               int64_t page_bytes, int64_t code_bytes, const int32_t *block_tables,
                               int64_t table_stride, int64_t table_width, const int32_t *query_start,
                               const int32_t *seq_lens, int64_t num_chunks, int64_t num_rows, float *out,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                               float scale, int64_t bf16_dots, int64_t window, const float *sinks) {
    const TileShape sh = {k_pages, v_pages, num_heads, num_kv_heads, head_dim, padded_dim(head_dim), block_size,
                          scale * 1.4426950408889634f, page_bytes, code_bytes, window, q_stride, sinks};
    return prefill_pages(&sh, 1, bf16_dots != 0, q, num_blocks, block_tables, table_stride, table_width, query_start, seq_lens,
                         num_chunks, num_rows, out);
}
