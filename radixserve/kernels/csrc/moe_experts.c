/*
 * A mixture-of-experts MLP in one call (model/moe.py's SparseMoE at decode sizes), its experts
 * stored quantized as quant_linear.c's weights (quant_dot.h's products, every path):
 *
 *   1. each row's top k experts from the router's logits (softmax; renormalised where asked);
 *   2. the (row, expert) pairs grouped per expert by a stable counting sort (rows ascending);
 *   3. per selected expert, over its rows only: gate/up (one fused [2I, H] weight), silu(gate) * up,
 *      down ([H, I]);
 *   4. each row's output the weighted sum of its experts' outputs, in ascending expert order.
 *
 * Only the selected experts' weights are read. The rows are rounded once for gate/up and each
 * pair's hidden row once for down, as quant_linear_f32 rounds them, so an expert's products are
 * those quant_linear_f32 gives on its rows (tests/kernels/test_moe_experts.py).
 *
 * Threads: one parallel region (torch's OpenMP workers). Each product's work, an expert's rows
 * times a few features, is cut into one contiguous share a thread, by cost (features x (rows + 2):
 * a feature's codes cost about two rows' arithmetic to stream at one row).
 */
#include <omp.h>

#include "quant_dot.h"

#define MAX_TOP_K 64

/* One projection of every expert: addresses [3][E] (codes, scales, offsets: 0 for none) and the
 * storage they share, meta [7]: N, K, bits, group, zero, half, lanes. */
typedef struct {
    const int64_t *ptrs;
    const int64_t *meta;
    int64_t E;
} Experts;

static QWeight expert_weight(const Experts *x, int64_t e) {
    const int64_t *m = x->meta;
    const QWeight w = {(const uint8_t *)(uintptr_t)x->ptrs[e], (const void *)(uintptr_t)x->ptrs[x->E + e],
                       (const void *)(uintptr_t)x->ptrs[2 * x->E + e], m[0], m[1], m[2], m[3], m[4], m[5], m[6]};
    return w;
}

/* Row `from` of src into row `to` of dst (the same K and groups). */
static void acts_copy_row(const QActs *src, int64_t from, QActs *dst, int64_t to) {
    const int64_t K = src->K;
    memcpy(dst->xq + to * K, src->xq + from * K, (size_t)K);
    memcpy(dst->xr + to * K, src->xr + from * K, (size_t)K);
    memcpy(dst->dx + to * (K / 32), src->dx + from * (K / 32), sizeof(float) * (size_t)(K / 32));
    memcpy(dst->xsum + to * src->groups, src->xsum + from * src->groups, sizeof(float) * (size_t)src->groups);
    for (int64_t b = 0; b < K / 32; ++b) {
        memcpy((int16_t *)x16_at(dst, to, b), x16_at(src, from, b), 32 * sizeof(int16_t));
        dst->dxt[b * dst->ld + to] = dxt_at(src, from, b);
    }
}

/* Each row's top k experts and weights: softmax over the logits, the k largest (the lower index
 * first among equals), divided by their sum where normalize. */
static void route(const float *logits, int64_t ldl, int64_t T, int64_t E, int64_t k, int64_t normalize,
                  float *probs, int64_t *expert, float *weight) {
    for (int64_t t = 0; t < T; ++t) {
        const float *l = logits + t * ldl;
        float top = l[0], sum = 0.0f;
        for (int64_t e = 1; e < E; ++e) top = l[e] > top ? l[e] : top;
        for (int64_t e = 0; e < E; ++e) sum += probs[e] = expf(l[e] - top);
        for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
        float picked = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e)
                if (probs[e] >= 0.0f && (best < 0 || probs[e] > probs[best])) best = e;
            expert[t * k + j] = best;
            picked += weight[t * k + j] = probs[best];
            probs[best] = -1.0f; /* taken */
        }
        if (normalize)
            for (int64_t j = 0; j < k; ++j) weight[t * k + j] /= picked;
    }
}

/* Where a thread's share of the cost [0, total) cuts expert e's features: cost b lies in feature
 * (b - base) / per, rounded down to a multiple of step (0 before the expert, N past it). */
static int64_t cut(int64_t b, int64_t base, int64_t per, int64_t N, int64_t step) {
    if (b <= base) return 0;
    if (b >= base + N * per) return N;
    const int64_t f = (b - base) / per / step * step;
    return f < N ? f : N;
}

/* This thread's share of one projection's products over the selected experts: rows of expert e
 * are acts rows [start[e], start[e] + count[e]), its output rows the same of out. */
static void share_of_products(const Experts *x, const QActs *acts, const int64_t *start, const int64_t *count,
                              float *out, int64_t ldo, int64_t path) {
    const int64_t N = x->meta[0], threads = omp_get_num_threads(), me = omp_get_thread_num();
    int64_t total = 0;
    for (int64_t e = 0; e < x->E; ++e) total += count[e] ? N * (count[e] + 2) : 0;
    const int64_t lo = total * me / threads, hi = total * (me + 1) / threads;
    int64_t base = 0;
    for (int64_t e = 0; e < x->E && base < hi; ++e) {
        if (!count[e]) continue;
        const int64_t per = count[e] + 2;
        const QWeight w = expert_weight(x, e);
        const int64_t step = feature_step(&w), n0 = cut(lo, base, per, N, step), n1 = cut(hi, base, per, N, step);
        if (n1 > n0) {
            const QActs rows = acts_rows(acts, start[e], count[e]);
            product_features(&w, &rows, n0, n1, out + start[e] * ldo, ldo, NULL, path);
        }
        base += N * per;
    }
}

static int experts_valid(const Experts *x, int64_t path) {
    for (int64_t e = 0; e < x->E; ++e) {
        const QWeight w = expert_weight(x, e);
        if (!weight_valid(&w) || !w.codes || !w.scale) return -1;
    }
    if (x->meta[6] && path != 0) return -1;
#if !defined(HAVE_VNNI)
    if (x->meta[6]) return -3;
#endif
#if !defined(__AVX2__)
    if (path == 1) return -3;
#endif
    return 0;
}

/* x [T, H] rows `ldx` floats apart, the router's logits [T, E] rows `ldl` apart -> out [T, H] rows
 * `ldo` apart. gate_up: each expert's [2I, H] (gate rows, then up rows); down: [H, I]. counts [E]
 * (or NULL) receives the rows each expert multiplied. path as quant_linear_f32's. Returns 0; -1
 * for shapes or layouts refused, -2 when scratch memory cannot be had, -3 for a path this build
 * lacks. */
int moe_experts_f32(const float *x, int64_t T, int64_t ldx, const float *logits, int64_t ldl, int64_t E,
                    int64_t top_k, int64_t normalize, const int64_t *gate_up_ptrs, const int64_t *gate_up_meta,
                    const int64_t *down_ptrs, const int64_t *down_meta, float *out, int64_t ldo, int64_t *counts,
                    int64_t path) {
    const Experts gu = {gate_up_ptrs, gate_up_meta, E}, dn = {down_ptrs, down_meta, E};
    const int64_t H = gate_up_meta[1], I = down_meta[1], P = T * top_k;
    if (T <= 0 || E <= 0 || top_k <= 0 || top_k > E || top_k > MAX_TOP_K || gate_up_meta[0] != 2 * I ||
        down_meta[0] != H || path < 0 || path > 2)
        return -1;
    int status = experts_valid(&gu, path);
    if (!status) status = experts_valid(&dn, path);
    if (status) return status;
    const int64_t gu_group = gate_up_meta[3], dn_group = down_meta[3];
    const size_t bytes = sizeof(float) * (size_t)(E + 2 * P + P * 2 * I + P * I + P * H) +
                         sizeof(int64_t) * (size_t)(3 * E + 3 * P) + acts_bytes(T, H, H / gu_group) +
                         acts_bytes(P, H, H / gu_group) + acts_bytes(P, I, I / dn_group) + 64;
    char *scratch = malloc(bytes), *p = scratch;
    if (!scratch) return -2;
    float *probs = (float *)p, *weight = probs + E, *pair_weight = weight + P, *gate_up = pair_weight + P, *hidden = gate_up + P * 2 * I;
    float *y = hidden + P * I;
    int64_t *expert = (int64_t *)(y + P * H), *count = expert + P, *start = count + E, *fill = start + E;
    int64_t *pair_row = fill + E, *row_pairs = pair_row + P;
    p = (char *)(row_pairs + P);
    QActs xa = acts_at(&p, T, H, gu_group), pa = acts_at(&p, P, H, gu_group), ha = acts_at(&p, P, I, dn_group);

    route(logits, ldl, T, E, top_k, normalize, probs, expert, weight);
    memset(count, 0, sizeof(int64_t) * (size_t)E);
    for (int64_t i = 0; i < P; ++i) ++count[expert[i]];
    for (int64_t e = 0, s = 0; e < E; ++e) start[e] = fill[e] = s, s += count[e];
    for (int64_t i = 0; i < P; ++i) { /* pair i = row i / k's j-th expert, in flat order: stable */
        const int64_t at = fill[expert[i]]++;
        pair_row[at] = i / top_k, pair_weight[at] = weight[i], row_pairs[i] = at;
    }
    for (int64_t t = 0; t < T; ++t) { /* a row's pairs by ascending expert: the order of the sum */
        int64_t *r = row_pairs + t * top_k;
        for (int64_t j = 1; j < top_k; ++j)
            for (int64_t i = j; i > 0 && r[i] < r[i - 1]; --i) {
                const int64_t s = r[i];
                r[i] = r[i - 1], r[i - 1] = s;
            }
    }

#pragma omp parallel if (P * (H + I) >= 16384)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) quantize_acts_row(x + t * ldx, &xa, t, gu_group);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < P; ++i) acts_copy_row(&xa, pair_row[i], &pa, i);
        share_of_products(&gu, &pa, start, count, gate_up, 2 * I, path);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = 0; i < P; ++i) {
            const float *g = gate_up + i * 2 * I, *u = g + I;
            float *h = hidden + i * I;
            for (int64_t j = 0; j < I; ++j) h[j] = g[j] / (1.0f + expf(fminf(-g[j], 88.0f))) * u[j]; /* as silu_mul_f32 */
            quantize_acts_row(h, &ha, i, dn_group);
        }
        share_of_products(&dn, &ha, start, count, y, H, path);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            float *o = out + t * ldo;
            memset(o, 0, sizeof(float) * (size_t)H);
            for (int64_t j = 0; j < top_k; ++j) {
                const int64_t at = row_pairs[t * top_k + j];
                const float w = pair_weight[at], *ya = y + at * H;
                for (int64_t h = 0; h < H; ++h) o[h] += ya[h] * w;
            }
        }
    }
    if (counts) memcpy(counts, count, sizeof(int64_t) * (size_t)E);
    free(scratch);
    return 0;
}
