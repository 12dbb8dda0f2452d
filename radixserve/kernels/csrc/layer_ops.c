/*
 * The per-token ops of a decoder layer besides its matmuls and attention, on CPU in
 * float32: RMSNorm (of rows, or of each head: q/k norms), rotary embedding and the MLP's SiLU or
 * GELU-tanh gate, each one pass over the rows
 * instead of the several tensor ops (and their dispatches) torch needs. They follow
 * transformers' formulas: RMSNorm as x * 1/sqrt(mean(x^2) + eps) * weight, rotary as
 * x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1], SiLU as x / (1 + e^-x).
 */
#include <math.h>
#include <stdint.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

/* for (r = 0; r < n; ++r) the statement after: in a parallel region of its own where `work`
 * (elements) is large and the caller is not inside one already, else on the calling thread. The
 * native decoder's team calls these ops on each thread's own rows, where an inner region, even
 * one an `if` clause leaves to a single thread, costs ~0.8 us to open and close (~100 a step). */
#if defined(_OPENMP)
#define FOR_ROWS(r, n, work, ...)                                              \
    do {                                                                       \
        if ((work) >= 65536 && !omp_in_parallel()) {                           \
            _Pragma("omp parallel for schedule(static)")                       \
            for (int64_t r = 0; r < (n); ++r) __VA_ARGS__                      \
        } else {                                                               \
            for (int64_t r = 0; r < (n); ++r) __VA_ARGS__                      \
        }                                                                      \
    } while (0)
#else
#define FOR_ROWS(r, n, work, ...) \
    do {                          \
        for (int64_t r = 0; r < (n); ++r) __VA_ARGS__ \
    } while (0)
#endif

/* out = x / sqrt(mean(x^2) + eps) * weight for one row of dim floats; never inlined, so that
 * every caller gets the same bits (-ffast-math lets an inlined copy sum and multiply in
 * another order). */
static __attribute__((noinline)) void rms_norm_row(const float *x, const float *weight, float *out, int64_t dim,
                                                   float eps) {
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; ++i) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int64_t i = 0; i < dim; ++i) out[i] = weight[i] * (x[i] * inv);
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight; rows `ldx` and `ldo` floats apart. */
void rms_norm_f32(const float *x, int64_t ldx, const float *weight, float *out, int64_t ldo, int64_t rows,
                  int64_t dim, float eps) {
    FOR_ROWS(r, rows, rows * dim, { rms_norm_row(x + r * ldx, weight, out + r * ldo, dim, eps); });
}

/* x[r] += y[r] / sqrt(mean(y[r]^2) + eps) * weight (a residual add of a normalized output:
 * Gemma 3's post-attention and post-MLP norms); rows `ldx` and `ldy` floats apart. The row is
 * normalized into a buffer first, so x holds the bits of rms_norm_f32 followed by an add. */
void rms_norm_add_f32(float *x, int64_t ldx, const float *y, int64_t ldy, const float *weight, int64_t rows,
                      int64_t dim, float eps) {
    FOR_ROWS(r, rows, rows * dim, {
        float normed[dim], *xr = x + r * ldx;
        rms_norm_row(y + r * ldy, weight, normed, dim, eps);
        for (int64_t i = 0; i < dim; ++i) xr[i] += normed[i];
    });
}

/* Rotate every head of one token in place: x [heads, head_dim]. cos/sin hold the angles of
 * a head's first half at [0, half) and of its second at [second, second + half): second =
 * half in a row that repeats them (rope_f32's), 0 in a table row that holds each once. */
static void rotate(float *x, int64_t heads, int64_t head_dim, const float *cos, const float *sin, int64_t second) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; ++h) {
        float *a = x + h * head_dim, *b = a + half;
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = a[i], x2 = b[i];
            a[i] = x1 * cos[i] - x2 * sin[i];
            b[i] = x2 * cos[second + i] + x1 * sin[second + i];
        }
    }
}

/* Rotary embedding of q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim] in
 * place; token rows `ldq` / `ldk` floats apart, heads contiguous within a row;
 * cos, sin [tokens, head_dim] contiguous. */
void rope_f32(float *q, int64_t ldq, int64_t q_heads, float *k, int64_t ldk, int64_t k_heads,
              const float *cos, const float *sin, int64_t tokens, int64_t head_dim) {
    FOR_ROWS(t, tokens, tokens * (q_heads + k_heads) * head_dim, {
        rotate(q + t * ldq, q_heads, head_dim, cos + t * head_dim, sin + t * head_dim, head_dim / 2);
        rotate(k + t * ldk, k_heads, head_dim, cos + t * head_dim, sin + t * head_dim, head_dim / 2);
    });
}

/* rope_f32 with each token's angles read from tables [positions, head_dim / 2] (one angle a
 * pair: both halves of a head turn by it) at the token's position. */
static void rope_table_f32(float *q, int64_t ldq, int64_t q_heads, float *k, int64_t ldk, int64_t k_heads,
                           const float *cos, const float *sin, const int64_t *positions, int64_t tokens,
                           int64_t head_dim) {
    const int64_t half = head_dim / 2;
    FOR_ROWS(t, tokens, tokens * (q_heads + k_heads) * head_dim, {
        const float *c = cos + positions[t] * half, *s = sin + positions[t] * half;
        rotate(q + t * ldq, q_heads, head_dim, c, s, 0);
        rotate(k + t * ldk, k_heads, head_dim, c, s, 0);
    });
}

/* out[r] = silu(gate_up[r, :n]) * gate_up[r, n:2n]; gate_up rows `ld` floats apart. */
void silu_mul_f32(const float *gate_up, int64_t ld, float *out, int64_t rows, int64_t n) {
    FOR_ROWS(r, rows, rows * n, {
        const float *g = gate_up + r * ld, *u = g + n;
        float *o = out + r * n;
        /* exp's argument capped: past 88 it is inf, and under -ffast-math g / inf came out NaN */
        for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + expf(fminf(-g[i], 88.0f))) * u[i];
    });
}

/* Every head of every token RMS-normalized in place by weight [head_dim] (q/k norms: Qwen3,
 * Gemma 3): x [tokens, heads, head_dim], token rows `ldx` floats apart, heads contiguous. */
void rms_norm_heads_f32(float *x, int64_t ldx, int64_t heads, int64_t tokens, int64_t head_dim, const float *weight,
                        float eps) {
    FOR_ROWS(t, tokens, tokens * heads * head_dim, {
        for (int64_t h = 0; h < heads; ++h)
            rms_norm_row(x + t * ldx + h * head_dim, weight, x + t * ldx + h * head_dim, head_dim, eps);
    });
}

/* out[r] = gelu_tanh(gate_up[r, :n]) * gate_up[r, n:2n] (Gemma's MLP), gelu_tanh(x) =
 * x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))); gate_up rows `ld` floats apart. */
void gelu_tanh_mul_f32(const float *gate_up, int64_t ld, float *out, int64_t rows, int64_t n) {
    const float beta = 0.7978845608028654f; /* sqrt(2 / pi) */
    FOR_ROWS(r, rows, rows * n, {
        const float *g = gate_up + r * ld, *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; ++i) {
            const float x = g[i];
            o[i] = 0.5f * x * (1.0f + tanhf(beta * (x + 0.044715f * x * x * x))) * u[i];
        }
    });
}

/* x [n] <- H_n x / sqrt(n) for n a power of two: the Walsh-Hadamard butterflies, stage by
 * stage (kernels/key_basis.py's matrix is the same rotation). */
static void hadamard_block(float *x, int64_t n) {
    for (int64_t h = 1; h < n; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; ++j) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    float scale = 1.0f; /* 1/sqrt(n) exactly rounded: powers of 1/2, times 1/sqrt(2) for odd powers */
    int64_t m = n;
    for (; m >= 4; m /= 4) scale *= 0.5f;
    if (m == 2) scale *= 0.70710678118654752f;
    for (int64_t j = 0; j < n; ++j) x[j] *= scale;
}

/* Every head [head_dim] of x [tokens, heads, head_dim] (token rows `ld` floats apart) into
 * the Hadamard basis in place: the head dim split into power-of-two blocks, largest first
 * (64 -> 64; 96 -> 64 + 32), each block rotated on its own. */
void hadamard_heads_f32(float *x, int64_t ld, int64_t heads, int64_t tokens, int64_t head_dim) {
    FOR_ROWS(t, tokens, tokens * heads * head_dim, {
        for (int64_t h = 0; h < heads; ++h) {
            float *head = x + t * ld + h * head_dim;
            for (int64_t start = 0, left = head_dim; left > 0;) {
                int64_t n = 1;
                while (2 * n <= left) n *= 2;
                hadamard_block(head + start, n);
                start += n, left -= n;
            }
        }
    });
}
