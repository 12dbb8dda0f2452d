/*
 * Every decoder layer of a step whose rows are all single-query attention rows (decodes,
 * the rows of speculative drafts, and prompt chunks that the runner lays out one row per
 * token), on CPU in float32, in one call.
 *
 * The per-layer work is the same kernels the model otherwise calls one by one from Python
 * (rms_norm_f32, skinny_linear_f32 or quant_linear_f32 by each weight's storage, rope_f32, hadamard_heads_f32 for quantized pages, the paged store, paged_decode_attention_f32,
 * silu_mul_f32) in the same order on the same data, so the result is bit for bit the
 * model's. What goes is the Python between them: at decode sizes each of the ~15 calls of a
 * layer costs 10-25 us of interpreter and dispatch (more once the weight stream has pushed
 * the interpreter out of the caches), 6-8 ms of a 27-40 ms step on the 2-core dev machine.
 *
 * Llama layers as transformers computes them, with optional biases on the fused qkv, o,
 * gate_up and down projections and optional q/k norms (Qwen3); and Gemma 3's: q/k norms, a
 * norm on the attention block's output and on the MLP's before each residual add, the
 * GELU-tanh gate (shape->activation), and window layers with a RoPE table of their own; a
 * layer may hold a mixture of experts in place of the dense MLP (Qwen3-MoE: the router's
 * logits, then moe_experts_f32, the call model/moe.py makes at these sizes).
 *   x          [rows, hidden] the residual stream, updated in place (written first from `embed` where given)
 *   cos, sin   [rope_rows, head_dim / 2] RoPE tables by position, each angle once (rope_table_f32)
 *   positions  [rows] each row's position (< rope_rows, and < the second table's rope_rows)
 *   slots      [rows] flat pool slot of each row's new K/V (float32 caches, or int8 pages: shape->kv_int8)
 *   tables     [rows, table_stride] int32 block table of each row's request
 *   seq_lens   [rows] int32 context length of each row, this row's token included (a layer with a
 *              sliding window reads only the table entries its window reaches)
 *   masks      [rows] draft-tree masks (paged_attention.c), or NULL: none
 *   workspace  rows * (2 hidden + qkv + 2 q + 3 intermediate + experts) floats: normed x, qkv, q,
 *              attention out, projection out, gate_up, activation (qkv = q + 2 kv), the router's
 *              logits (experts: the most of any layer)
 *   embed      NULL (x holds the rows), or the embedding and the step's token ids: x is written from them
 *   second     NULL, or the step's second RoPE table (layers with alt_rope: Gemma 3's window layers)
 *              and second set of pages (layers with alt_pages: a hybrid pool's window layers, whose
 *              pages have tables and slots of their own; the same rows and lengths)
 *   head       NULL, or the final norm and the quantized head: the logits of some rows after the
 *              layers, as the model's norm and logits give them (rms_norm_f32, then the head's
 *              product by the weight's kernel)
 * Returns 0; -1 when a kernel refuses its shapes or scratch memory cannot be had (x is then
 * unchanged only if the refusal came before the first layer: the caller checks shapes
 * first); -2 (nothing changed) for a slot, length or block id outside the pool, or a logits
 * row outside the step's rows.
 */
#include "layer_ops.c"
#include "moe_experts.c"
#include "paged_attention.c"
#include "quant_linear.c"
#include "skinny_linear.c"

/* A projection's weight: float32 [N, K] (w), or quantized codes (quant_linear.c's layouts:
 * one feature a row, or lanes; scale and offset float16 where half). */
typedef struct {
    const float *w;
    const uint8_t *codes;
    const void *scale, *offset;
    int64_t bits, group, zero, half, lanes;
} LayerWeight;

typedef struct {
    const float *input_norm;
    LayerWeight qkv;
    const float *qkv_bias;
    LayerWeight o;
    const float *o_bias, *post_norm;
    LayerWeight gate_up;
    const float *gate_up_bias;
    LayerWeight down;
    const float *down_bias;
    char *k_cache, *v_cache; /* float [num_blocks, block_size, num_kv_heads, head_dim], or int8 pages */
    int64_t window;          /* sliding-window attention over the last `window` keys; 0: the whole context */
    const float *q_norm, *k_norm; /* RMSNorm of each q and k head before RoPE; NULL: none */
    const float *attn_out_norm;   /* RMSNorm of the attention block's output before its residual add; NULL: none */
    const float *mlp_out_norm;    /* the same for the MLP's output */
    int64_t alt_rope, alt_pages;  /* 1: the call's `second` RoPE table / pages */
    /* A mixture of experts in place of the dense MLP (moe_experts.c; experts 0: the dense MLP):
     * the router's [experts, hidden] weight, each row's top_k, and the experts' addresses and
     * storage as moe_experts_f32 takes them. */
    LayerWeight router;
    int64_t experts, top_k, normalize;
    const int64_t *gate_up_ptrs, *gate_up_meta, *down_ptrs, *down_meta;
} DecoderLayer;

/* A RoPE table and a page set (its slots, tables and number of pages): the step's own, or its
 * second (see the header); each layer reads one of the two. The rows' positions are the
 * step's whichever table a layer reads (a second's `positions` is not read). */
typedef struct {
    const float *cos, *sin; /* [rope_rows, head_dim / 2] */
    int64_t rope_rows;
    const int64_t *positions;
    const int64_t *slots;
    const int32_t *tables;
    int64_t table_stride, table_width, num_blocks;
} RopePages;

/* The embedding's rows of the step's tokens: x's first value, as the model's embed gives it
 * (quantized rows as quant_dequantize_f32 dequantizes them, float32 rows copied), times `scale`
 * where scaled (Gemma 3's sqrt(hidden), one float32 product). */
typedef struct {
    LayerWeight w; /* [vocab, hidden] */
    int64_t vocab;
    const int64_t *ids; /* [rows] */
    float scale;
    int64_t scaled;
} DecoderEmbed;

static int embed_valid(const DecoderEmbed *e, int64_t rows, int64_t hidden) {
    if (e->w.codes) {
        const QWeight q = {e->w.codes, e->w.scale, e->w.offset, e->vocab, hidden, e->w.bits, e->w.group, e->w.zero,
                           e->w.half, e->w.lanes};
        if (!weight_valid(&q)) return 0;
    } else if (!e->w.w) {
        return 0;
    }
    for (int64_t r = 0; r < rows; ++r)
        if (e->ids[r] < 0 || e->ids[r] >= e->vocab) return 0;
    return 1;
}

/* Row r's embedding into dst [hidden]. */
static void embed_row(const DecoderEmbed *e, int64_t hidden, int64_t r, float *dst) {
    if (e->w.codes) {
        const QWeight q = {e->w.codes, e->w.scale, e->w.offset, e->vocab, hidden, e->w.bits, e->w.group, e->w.zero,
                           e->w.half, e->w.lanes};
        dequantize_row_n(&q, e->ids[r], dst);
    } else {
        memcpy(dst, e->w.w + e->ids[r] * hidden, sizeof(float) * hidden);
    }
    if (e->scaled)
        for (int64_t i = 0; i < hidden; ++i) dst[i] = dst[i] * e->scale;
}

/* The logits of rows [count] of x after the layers: RMSNorm by `norm`, then the head [vocab, hidden]. */
typedef struct {
    const float *norm;
    LayerWeight w;
    int64_t vocab;
    const int64_t *rows;
    int64_t count;
    float *logits; /* [count, vocab] */
} DecoderHead;

/* out [rows, N] = x [rows, K] @ w.T + bias, by the kernel the weight's storage calls for. */
static int project(const float *x, int64_t rows, const LayerWeight *w, int64_t N, int64_t K, const float *bias,
                   float *out) {
    if (w->codes)
        return quant_linear_f32(x, rows, K, w->codes, w->scale, w->offset, N, K, w->bits, w->group, w->zero, w->half,
                                w->lanes, bias, out, N, 0);
    return skinny_linear_f32(x, rows, K, w->w, N, K, bias, out, N);
}

typedef struct {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim, num_blocks, block_size;
    int64_t page_bytes, code_bytes, kv_int8; /* kv_int8: the caches are int8 pages (paged_attention.c) */
    int64_t rotate_keys; /* q and k into the Hadamard basis after RoPE (kernels/key_basis.py) */
    int64_t activation;  /* the MLP's gate: 0 SiLU, 1 GELU-tanh */
    float eps, scale;
} DecoderShape;

/* KV heads [first, end) of a row's new K/V into its slot: copied, or quantized into int8 pages. */
static void store_heads(const DecoderShape *s, const Shape *pages, const DecoderLayer *w, const float *k,
                        const float *v, int64_t slot, int64_t first, int64_t end) {
    const int64_t kv_size = s->num_kv_heads * s->head_dim, at = first * s->head_dim;
    if (s->kv_int8) {
        store_heads_i8(pages, k, v, w->k_cache, w->v_cache, slot, first, end);
        return;
    }
    memcpy((float *)w->k_cache + slot * kv_size + at, k + at, sizeof(float) * (end - first) * s->head_dim);
    memcpy((float *)w->v_cache + slot * kv_size + at, v + at, sizeof(float) * (end - first) * s->head_dim);
}

static void add_rows(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] + y[i];
}

/* Whether the layers that read this page set (alt: those with alt_pages) may read slots and
 * tables: the widest window among them bounds the table entries checked (0: all). */
static int pages_valid(const DecoderLayer *layers, int64_t num_layers, int64_t alt, const int64_t *slots,
                       int64_t rows, const int32_t *tables, int64_t table_stride, int64_t table_width,
                       const int32_t *seq_lens, int64_t block_size, int64_t num_blocks, const uint64_t *masks) {
    int64_t widest = 0, full = 0, any = 0;
    for (int64_t i = 0; i < num_layers; ++i) {
        if ((layers[i].alt_pages != 0) != (alt != 0)) continue;
        any = 1;
        if (layers[i].window <= 0) full = 1;
        else if (layers[i].window > widest) widest = layers[i].window;
    }
    if (!any && alt) return 1;
    return slots_valid(slots, rows, num_blocks * block_size) &&
           tables_valid(tables, table_stride, table_width, seq_lens, rows, block_size, num_blocks,
                        full || !any ? 0 : widest, masks);
}

/* Whether every row's position has a row in a RoPE table of `rope_rows` positions. */
static int positions_valid(const int64_t *positions, int64_t rows, int64_t rope_rows) {
    for (int64_t r = 0; r < rows; ++r)
        if (positions[r] < 0 || positions[r] >= rope_rows) return 0;
    return 1;
}

/* What layer w reads: the step's own RoPE table and pages, or `second`'s (alt_rope, alt_pages). */
static RopePages layer_inputs(const DecoderLayer *w, const RopePages *second, const RopePages *own) {
    RopePages in = *own;
    if (w->alt_rope) in.cos = second->cos, in.sin = second->sin, in.rope_rows = second->rope_rows;
    if (w->alt_pages)
        in.slots = second->slots, in.tables = second->tables, in.table_stride = second->table_stride,
        in.table_width = second->table_width, in.num_blocks = second->num_blocks;
    return in;
}

/* Query heads [qa, qb) and KV heads [ka, kb) of the fused qkv rows made attention's inputs: q/k
 * norms, RoPE, the Hadamard basis, each head on its own; their q copied out to q's rows, their
 * K/V stored into each row's slot. */
static void attention_heads(const DecoderShape *s, const Shape *pages, const DecoderLayer *w, const RopePages *in,
                            float *qkv, float *q, int64_t rows, int64_t qa, int64_t qb, int64_t ka, int64_t kb) {
    const int64_t d = s->head_dim, q_size = s->num_heads * d, kv_size = s->num_kv_heads * d;
    const int64_t qkv_size = q_size + 2 * kv_size;
    float *qh = qkv + qa * d, *kh = qkv + q_size + ka * d;
    if (w->q_norm) rms_norm_heads_f32(qh, qkv_size, qb - qa, rows, d, w->q_norm, s->eps);
    if (w->k_norm) rms_norm_heads_f32(kh, qkv_size, kb - ka, rows, d, w->k_norm, s->eps);
    rope_table_f32(qh, qkv_size, qb - qa, kh, qkv_size, kb - ka, in->cos, in->sin, in->positions, rows, d);
    if (s->rotate_keys) {
        hadamard_heads_f32(qh, qkv_size, qb - qa, rows, d);
        hadamard_heads_f32(kh, qkv_size, kb - ka, rows, d);
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = qkv + r * qkv_size;
        memcpy(q + r * q_size + qa * d, row + qa * d, sizeof(float) * (qb - qa) * d);
        store_heads(s, pages, w, row + q_size, row + q_size + kv_size, in->slots[r], ka, kb);
    }
}

/* Every head of the fused qkv rows made attention's inputs (attention_heads). */
static void attention_inputs(const DecoderShape *s, const Shape *pages, const DecoderLayer *w, const RopePages *in,
                             float *qkv, float *q, int64_t rows) {
    attention_heads(s, pages, w, in, qkv, q, rows, 0, s->num_heads, 0, s->num_kv_heads);
}

/* x += a block's output, after the block's own norm where the layer has one (into tmp: out is
 * not written), as rms_norm_f32 in place then add_rows give it. */
static void residual_add(const DecoderShape *s, const float *norm, const float *out, float *tmp, float *x,
                         int64_t rows) {
    if (norm) rms_norm_f32(out, s->hidden, norm, tmp, s->hidden, rows, s->hidden, s->eps);
    add_rows(x, norm ? tmp : out, rows * s->hidden);
}

/* A step of at most TEAM_ROWS rows whose layers are all dense with every projection quantized
 * runs in one parallel region (team_layers), where each kernel call opened its own: at one row
 * a layer's four projections and its attention are 10-60 us each, and a region's start and
 * end were a tenth of that. The team's threads split each projection's features as
 * quant_linear_f32 does and each attention's work items as decode_pages does, and meet at a
 * barrier after each; the small row-wise work between (norms, the residual adds, rounding
 * the activations, the gate) each thread repeats on its own copy; attention's inputs (norms of
 * heads, RoPE, the K/V store) each thread makes for the heads its qkv share computed, and one
 * thread plans the attention. Every value is computed by the same function on the same inputs as
 * on the call-per-kernel path, so the two give the same bits. */
#define TEAM_ROWS 8

#if defined(_OPENMP)
static int team_threads(void) { return omp_get_num_threads(); }
static int team_thread(void) { return omp_get_thread_num(); }
#else
static int team_threads(void) { return 1; }
static int team_thread(void) { return 0; }
#endif

static int team_weight(const LayerWeight *w, int64_t N, int64_t K) {
    const QWeight q = {w->codes, w->scale, w->offset, N, K, w->bits, w->group, w->zero, w->half, w->lanes};
#if !defined(HAVE_VNNI)
    if (w->lanes) return 0;
#endif
    return w->codes != NULL && weight_valid(&q);
}

static int team_fits(const DecoderShape *s, const DecoderLayer *layers, int64_t num_layers, int64_t rows,
                     const DecoderHead *head) {
#if defined(_OPENMP)
    if (rows > TEAM_ROWS || omp_get_max_threads() < 2) return 0;
#else
    return 0;
#endif
    const int64_t q_size = s->num_heads * s->head_dim, qkv_size = q_size + 2 * s->num_kv_heads * s->head_dim;
    if (head && !team_weight(&head->w, head->vocab, s->hidden)) return 0;
    for (int64_t i = 0; i < num_layers; ++i) {
        const DecoderLayer *w = layers + i;
        if (w->experts || !team_weight(&w->qkv, qkv_size, s->hidden) || !team_weight(&w->o, s->hidden, q_size) ||
            !team_weight(&w->gate_up, 2 * s->intermediate, s->hidden) ||
            !team_weight(&w->down, s->hidden, s->intermediate))
            return 0;
    }
    return 1;
}

/* out [rows, N] = x [rows, K] @ w.T + bias, on the calling team: each thread rounds x into its
 * own activations (acts) and takes its share of the features; ends in the team's barrier. */
static void team_project(const float *x, int64_t rows, const LayerWeight *lw, int64_t N, int64_t K,
                         const float *bias, float *out, char *acts) {
    const QWeight w = {lw->codes, lw->scale, lw->offset, N, K, lw->bits, lw->group, lw->zero, lw->half, lw->lanes};
    char *p = acts;
    QActs a = acts_at(&p, rows, K, w.group);
    for (int64_t r = 0; r < rows; ++r) quantize_acts_row(x + r * K, &a, r, w.group);
    const int64_t step = feature_step(&w), chunks = (N + step - 1) / step;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c)
        product_features(&w, &a, c * step, c * step + step < N ? c * step + step : N, out, N, bias, 0);
}

/* The shared buffers of a step (the workspace's), as decoder_layers_f32 lays them out. */
typedef struct {
    float *qkv, *q, *attn, *proj, *gate_up;
} StepBuffers;

/* The thread of the team that team_project's static split gives feature f of a weight of N
 * features (libgomp's split of the chunks: the first chunks % threads threads take one more). */
static int64_t feature_owner(int64_t f, int64_t N, int64_t step) {
    const int64_t chunks = (N + step - 1) / step, T = team_threads(), q = chunks / T, r = chunks % T;
    const int64_t c = f / step;
    return c < r * (q + 1) ? c / (q + 1) : r + (c - r * (q + 1)) / q;
}

/* The query heads [qa, qb) and KV heads [ka, kb) this thread makes attention's inputs of: those
 * whose first feature its share of the qkv projection computed, so that it reads its own rows
 * (the split is only where the work goes: every head is some thread's, once). */
static void own_heads(const DecoderShape *s, const LayerWeight *qkv, int64_t *qa, int64_t *qb, int64_t *ka,
                      int64_t *kb) {
    const int64_t d = s->head_dim, q_size = s->num_heads * d, N = q_size + 2 * s->num_kv_heads * d;
    const QWeight w = {qkv->codes, qkv->scale, qkv->offset, N, s->hidden, qkv->bits, qkv->group, qkv->zero, qkv->half,
                       qkv->lanes};
    const int64_t step = feature_step(&w), me = team_thread();
    *qa = *qb = *ka = *kb = 0;
    for (int64_t h = 0; h < s->num_heads; ++h) {
        const int64_t owner = feature_owner(h * d, N, step);
        if (owner < me) *qa = h + 1;
        if (owner <= me) *qb = h + 1;
    }
    for (int64_t j = 0; j < s->num_kv_heads; ++j) {
        const int64_t owner = feature_owner(q_size + j * d, N, step);
        if (owner < me) *ka = j + 1;
        if (owner <= me) *kb = j + 1;
    }
}

/* One layer on the calling team; xp, normed, tmp and act are the thread's own. */
static void team_layer(const DecoderShape *s, const DecoderLayer *w, const RopePages *in, Shape pages,
                       const int32_t *seq_lens, int64_t rows, const StepBuffers *b, DecodePlan *plan,
                       DecodeScratch *scratch, float *xp, float *normed, float *tmp, float *act, char *acts) {
    const int64_t q_size = s->num_heads * s->head_dim, qkv_size = q_size + 2 * s->num_kv_heads * s->head_dim;
    const int64_t inter = s->intermediate;
    pages.k_pages = w->k_cache, pages.v_pages = w->v_cache, pages.window = w->window;
    rms_norm_f32(xp, s->hidden, w->input_norm, normed, s->hidden, rows, s->hidden, s->eps);
    team_project(normed, rows, &w->qkv, qkv_size, s->hidden, w->qkv_bias, b->qkv, acts);
    int64_t qa, qb, ka, kb;
    own_heads(s, &w->qkv, &qa, &qb, &ka, &kb);
    attention_heads(s, &pages, w, in, b->qkv, b->q, rows, qa, qb, ka, kb);
    if (team_thread() == 0) {
        plan_decode(&pages, in->tables, in->table_stride, seq_lens, rows, team_threads(), plan);
        plan_partial(plan);
    }
#pragma omp barrier
    attend_items(&pages, b->q, plan, b->attn, scratch);
    team_project(b->attn, rows, &w->o, s->hidden, q_size, w->o_bias, b->proj, acts);
    residual_add(s, w->attn_out_norm, b->proj, tmp, xp, rows);
    rms_norm_f32(xp, s->hidden, w->post_norm, normed, s->hidden, rows, s->hidden, s->eps);
    team_project(normed, rows, &w->gate_up, 2 * inter, s->hidden, w->gate_up_bias, b->gate_up, acts);
    if (s->activation == 1) gelu_tanh_mul_f32(b->gate_up, 2 * inter, act, rows, inter);
    else silu_mul_f32(b->gate_up, 2 * inter, act, rows, inter);
    team_project(act, rows, &w->down, s->hidden, inter, w->down_bias, b->proj, acts);
    residual_add(s, w->mlp_out_norm, b->proj, tmp, xp, rows);
}

/* The head's rows of the thread's own x normed into `normed`, then their logits on the team. */
static void team_head(const DecoderShape *s, const DecoderHead *head, const float *xp, float *normed, char *acts) {
    for (int64_t i = 0; i < head->count; ++i)
        rms_norm_f32(xp + head->rows[i] * s->hidden, s->hidden, head->norm, normed + i * s->hidden, s->hidden, 1,
                     s->hidden, s->eps);
    team_project(normed, head->count, &head->w, head->vocab, s->hidden, NULL, head->logits, acts);
}

static int team_layers(float *x, int64_t rows, const DecoderLayer *layers, int64_t num_layers, const DecoderShape *s,
                       const RopePages *own, const RopePages *second, const int32_t *seq_lens, const Shape *pages,
                       const StepBuffers *b, const DecoderHead *head) {
    DecodePlan plan;
    if (!plan_memory(&plan, rows)) {
        plan_free(&plan);
        return -1;
    }
    const int64_t q_size = s->num_heads * s->head_dim, hidden = s->hidden;
    int64_t widest = hidden > q_size ? hidden : q_size;
    widest = widest > s->intermediate ? widest : s->intermediate;
    int failed = 0;
#pragma omp parallel
    {
        float *mine = (float *)malloc(sizeof(float) * rows * (3 * hidden + s->intermediate));
        char *acts = (char *)malloc(acts_bytes(rows, widest, widest / 16));
        DecodeScratch scratch = decode_scratch(pages, rows);
        if (!mine || !acts || !scratch.memory) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            float *xp = mine, *normed = xp + rows * hidden, *tmp = normed + rows * hidden, *act = tmp + rows * hidden;
            memcpy(xp, x, sizeof(float) * rows * hidden);
            for (int64_t i = 0; i < num_layers; ++i) {
                const RopePages in = layer_inputs(layers + i, second, own);
                team_layer(s, layers + i, &in, *pages, seq_lens, rows, b, &plan, &scratch, xp, normed, tmp, act,
                           acts);
            }
            if (head) team_head(s, head, xp, normed, acts);
            if (team_thread() == 0) memcpy(x, xp, sizeof(float) * rows * hidden);
        }
        free(mine);
        free(acts);
        free(scratch.memory);
    }
    plan_free(&plan);
    return failed ? -1 : 0;
}

int decoder_layers_f32(float *x, int64_t rows, const DecoderLayer *layers, int64_t num_layers,
                       const DecoderShape *shape, const float *cos, const float *sin, int64_t rope_rows,
                       const int64_t *positions, const int64_t *slots,
                       const int32_t *tables, int64_t table_stride, int64_t table_width,
                       const int32_t *seq_lens, float *workspace, const RopePages *second,
                       const uint64_t *masks, const DecoderHead *head, const DecoderEmbed *embed) {
    const DecoderShape s = *shape;
    const int64_t q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, inter = s.intermediate;
    for (int64_t i = 0; i < num_layers; ++i)
        if ((layers[i].alt_rope || layers[i].alt_pages) && !second) return -1;
    if (!pages_valid(layers, num_layers, 0, slots, rows, tables, table_stride, table_width, seq_lens,
                     s.block_size, s.num_blocks, masks) ||
        (second && !pages_valid(layers, num_layers, 1, second->slots, rows, second->tables, second->table_stride,
                                second->table_width, seq_lens, s.block_size, second->num_blocks, masks)))
        return -2;
    if (!positions_valid(positions, rows, rope_rows) || (second && !positions_valid(positions, rows, second->rope_rows)))
        return -2;
    if (embed && !embed_valid(embed, rows, s.hidden)) return -2;
    if (head && (head->count < 1 || head->count > rows)) return -2;
    if (head)
        for (int64_t i = 0; i < head->count; ++i)
            if (head->rows[i] < 0 || head->rows[i] >= rows) return -2;
    float *normed = workspace, *qkv = normed + rows * s.hidden, *q = qkv + rows * qkv_size;
    float *attn = q + rows * q_size, *proj = attn + rows * q_size, *gate_up = proj + rows * s.hidden;
    float *act = gate_up + rows * 2 * inter, *logits = act + rows * inter;
    Shape pages = {NULL, NULL, s.page_bytes, s.code_bytes, (int)s.kv_int8, s.num_heads, s.num_kv_heads,
                   s.head_dim, s.block_size, s.scale};
    pages.masks = masks;
    if (embed)
#pragma omp parallel for schedule(static) if (rows * s.hidden >= 65536)
        for (int64_t r = 0; r < rows; ++r) embed_row(embed, s.hidden, r, x + r * s.hidden);
    const RopePages own = {cos, sin, rope_rows, positions, slots, tables, table_stride, table_width, s.num_blocks};
    if (team_fits(&s, layers, num_layers, rows, head)) {
        const StepBuffers buffers = {qkv, q, attn, proj, gate_up};
        return team_layers(x, rows, layers, num_layers, &s, &own, second, seq_lens, &pages, &buffers, head);
    }
    for (int64_t i = 0; i < num_layers; ++i) {
        const DecoderLayer *w = layers + i;
        const RopePages in = layer_inputs(w, second, &own);
        rms_norm_f32(x, s.hidden, w->input_norm, normed, s.hidden, rows, s.hidden, s.eps);
        if (project(normed, rows, &w->qkv, qkv_size, s.hidden, w->qkv_bias, qkv)) return -1;
        attention_inputs(&s, &pages, w, &in, qkv, q, rows);
        pages.k_pages = w->k_cache, pages.v_pages = w->v_cache, pages.window = w->window;
        if (decode_pages(&pages, q, in.num_blocks, in.tables, in.table_stride, in.table_width, seq_lens, attn, rows)) return -1;
        if (project(attn, rows, &w->o, s.hidden, q_size, w->o_bias, proj)) return -1;
        if (w->attn_out_norm) rms_norm_f32(proj, s.hidden, w->attn_out_norm, proj, s.hidden, rows, s.hidden, s.eps);
        add_rows(x, proj, rows * s.hidden);
        rms_norm_f32(x, s.hidden, w->post_norm, normed, s.hidden, rows, s.hidden, s.eps);
        if (w->experts) {
            if (project(normed, rows, &w->router, w->experts, s.hidden, NULL, logits) ||
                moe_experts_f32(normed, rows, s.hidden, logits, w->experts, w->experts, w->top_k, w->normalize,
                                w->gate_up_ptrs, w->gate_up_meta, w->down_ptrs, w->down_meta, proj, s.hidden, NULL, 0))
                return -1;
        } else {
            if (project(normed, rows, &w->gate_up, 2 * inter, s.hidden, w->gate_up_bias, gate_up)) return -1;
            if (s.activation == 1) gelu_tanh_mul_f32(gate_up, 2 * inter, act, rows, inter);
            else silu_mul_f32(gate_up, 2 * inter, act, rows, inter);
            if (project(act, rows, &w->down, s.hidden, inter, w->down_bias, proj)) return -1;
        }
        if (w->mlp_out_norm) rms_norm_f32(proj, s.hidden, w->mlp_out_norm, proj, s.hidden, rows, s.hidden, s.eps);
        add_rows(x, proj, rows * s.hidden);
    }
    if (!head) return 0;
    for (int64_t i = 0; i < head->count; ++i)
        rms_norm_f32(x + head->rows[i] * s.hidden, s.hidden, head->norm, normed + i * s.hidden, s.hidden, 1, s.hidden,
                     s.eps);
    return project(normed, head->count, &head->w, head->vocab, s.hidden, NULL, head->logits) ? -1 : 0;
}
