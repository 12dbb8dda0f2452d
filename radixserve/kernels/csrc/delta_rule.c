/*
 * One decode token of the gated delta rule (Gated DeltaNet layers: Qwen3.5, Qwen3-Next) for D
 * requests at once, each request's state advanced in place in the layer's state pool:
 *
 *   S' = e^g S + k u^T,  u = beta (v - e^g S^T k),  o = S'^T q = e^g S^T q + (k.q) u
 *
 * per (request, value head), S [Dk, Dv] float32 at pool slot slots[d]. S is the bulk of a
 * decode's memory traffic, so each head's S is read once for S^T k and S^T q together and then
 * rewritten once (in L2 by then): the torch ops' gather of the slots, their products, the decay,
 * the update and the scatter back passed over it about seven times.
 */
#include <math.h>
#include <stdint.h>

/* Returns 0, or -2 (nothing written) when a slot is outside the pool's num_slots. */
int delta_rule_step_f32(float *state, int64_t num_slots, const int64_t *slots, int64_t D, int64_t H, int64_t Dk,
                        int64_t Dv, const float *q, const float *k, const float *v, const float *g,
                        const float *beta, float *out) {
    for (int64_t d = 0; d < D; ++d)
        if (slots[d] < 0 || slots[d] >= num_slots) return -2;
#pragma omp parallel for schedule(static) if (D * H * Dk * Dv >= 65536)
    for (int64_t i = 0; i < D * H; ++i) {
        const int64_t d = i / H, h = i % H;
        float *S = state + (slots[d] * H + h) * Dk * Dv;
        const float *kk = k + i * Dk, *qq = q + i * Dk, *vv = v + i * Dv;
        const float decay = expf(g[i]), b = beta[i];
        float ks[Dv], qs[Dv], u[Dv];
        float kq = 0.0f;
        for (int64_t c = 0; c < Dv; ++c) ks[c] = qs[c] = 0.0f;
        for (int64_t r = 0; r < Dk; ++r) {
            const float kr = kk[r], qr = qq[r], *row = S + r * Dv;
            kq += kr * qr;
            for (int64_t c = 0; c < Dv; ++c) ks[c] += kr * row[c], qs[c] += qr * row[c];
        }
        float *o = out + i * Dv;
        for (int64_t c = 0; c < Dv; ++c) {
            u[c] = (vv[c] - decay * ks[c]) * b;
            o[c] = decay * qs[c] + kq * u[c];
        }
        for (int64_t r = 0; r < Dk; ++r) {
            const float kr = kk[r];
            float *row = S + r * Dv;
            for (int64_t c = 0; c < Dv; ++c) row[c] = decay * row[c] + kr * u[c];
        }
    }
    return 0;
}
