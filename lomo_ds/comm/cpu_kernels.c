/* lomo_ds's fused passes over fp32 gradients on CPU ranks (cpu_kernels.py builds and loads this).
 *
 * On a CPU, LOMO's own time is passes over the gradient's bytes, bound by memory bandwidth: each
 * kernel here does in one read what the torch ops do in two or three (pack, then sum for the flag;
 * sum the ranks' rows, then sum the result for the check; then step the weights).
 *
 * Sums run in 16 independent fp32 lanes (vectorised by the compiler without reassociating across
 * lanes, so no -ffast-math): a NaN or infinity anywhere makes the total non-finite, as torch's
 * sum does, which is all the callers read of it.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define LANES 16

static float lanes_total(const float acc[LANES]) {
    float total = 0.0f;
    for (int k = 0; k < LANES; k++) total += acc[k];
    return total;
}

/* dst[i] = src[i] for i < n; returns the fp32 sum of |src[i]|: not finite where some element is
 * not, and a bound on every element (the callers bound it by FLT_MAX / world, so that no sum over
 * the ranks can overflow). */
float lomo_copy_abs_sum_f32(float *restrict dst, const float *restrict src, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) {
            float v = src[i + k];
            dst[i + k] = v;
            acc[k] += fabsf(v);
        }
    for (; i < n; i++) {
        dst[i] = src[i];
        acc[0] += fabsf(src[i]);
    }
    return lanes_total(acc);
}

/* out[i] = a[i] + b[i] for i < n; returns the fp32 sum of out. `out` may be `a` (adding a third
 * rank's row in place), so neither is `restrict`: the compiler checks the overlap at run time. */
float lomo_add2_sum_f32(float *out, const float *a, const float *restrict b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) {
            float v = a[i + k] + b[i + k];
            out[i + k] = v;
            acc[k] += v;
        }
    for (; i < n; i++) {
        out[i] = a[i] + b[i];
        acc[0] += out[i];
    }
    return lanes_total(acc);
}

/* The SGD step of this rank's slice straight from the ranks' rows, the sum over ranks never
 * stored: g = rows[0][i] + rows[1][i] + ... (torch's order); with clip > 0, g = clamp(g * scale,
 * -clip, clip); then w[i] = w[i] * decay + alpha * g (alpha: -lr, times scale when not clipping).
 * An element whose sum is not finite is left as it is (a NaN never reaches a weight); returns how
 * many there were. The callers' flags make that 0 (see lomo_copy_abs_sum_f32).
 * Two ranks (the common CPU case) get a loop of their own, which the compiler vectorises; more
 * ranks sum into a block of LANES first. `clipping` is a constant in each inlined copy. */
static inline int step_one(float *restrict w, float g, int clipping, float scale, float clip, float alpha,
                           float decay) {
    int ok = (g - g) == 0.0f;  /* false for inf and NaN: tested before the clamp, which drops NaN */
    if (clipping) {  /* compares, not fminf / fmaxf: those keep NaN apart and do not vectorise */
        g *= scale;
        g = g < -clip ? -clip : g;
        g = g > clip ? clip : g;
    }
    *w = ok ? *w * decay + alpha * g : *w;
    return !ok;
}

static inline int64_t sgd_two(float *restrict w, const float *restrict a, const float *restrict b, int64_t n,
                              int clipping, float scale, float clip, float alpha, float decay) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += step_one(w + i, a[i] + b[i], clipping, scale, clip, alpha, decay);
    return bad;
}

static inline int64_t sgd_many(float *restrict w, const float *const *rows, int32_t nrows, int64_t n,
                               int clipping, float scale, float clip, float alpha, float decay) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i += LANES) {
        int m = n - i < LANES ? (int)(n - i) : LANES;
        float g[LANES];
        for (int k = 0; k < m; k++) g[k] = rows[0][i + k];
        for (int32_t r = 1; r < nrows; r++)
            for (int k = 0; k < m; k++) g[k] += rows[r][i + k];
        for (int k = 0; k < m; k++) bad += step_one(w + i + k, g[k], clipping, scale, clip, alpha, decay);
    }
    return bad;
}

int64_t lomo_sgd_rows_f32(float *restrict w, const float *const *rows, int32_t nrows, int64_t n,
                          float scale, float clip, float alpha, float decay) {
    if (nrows == 2)
        return clip > 0.0f ? sgd_two(w, rows[0], rows[1], n, 1, scale, clip, alpha, decay)
                           : sgd_two(w, rows[0], rows[1], n, 0, scale, clip, alpha, decay);
    return clip > 0.0f ? sgd_many(w, rows, nrows, n, 1, scale, clip, alpha, decay)
                       : sgd_many(w, rows, nrows, n, 0, scale, clip, alpha, decay);
}
