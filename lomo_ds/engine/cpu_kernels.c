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
#include <stddef.h>
#include <stdint.h>

#define LANES 16

static float lanes_total(const float acc[LANES]) {
    float total = 0.0f;
    for (int k = 0; k < LANES; k++) total += acc[k];
    return total;
}

/* dst[i] = src[i] for i < n; returns the fp32 sum of src. */
float lomo_copy_sum_f32(float *restrict dst, const float *restrict src, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) {
            float v = src[i + k];
            dst[i + k] = v;
            acc[k] += v;
        }
    for (; i < n; i++) {
        dst[i] = src[i];
        acc[0] += src[i];
    }
    return lanes_total(acc);
}

/* out[i] = a[i] + b[i] for i < n; returns the fp32 sum of out. */
float lomo_add2_sum_f32(float *restrict out, const float *restrict a, const float *restrict b, int64_t n) {
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

/* out[i] += a[i] for i < n; returns the fp32 sum of out (the last row of a sum over ranks). */
float lomo_add_sum_f32(float *restrict out, const float *restrict a, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) {
            float v = out[i + k] + a[i + k];
            out[i + k] = v;
            acc[k] += v;
        }
    for (; i < n; i++) {
        out[i] += a[i];
        acc[0] += out[i];
    }
    return lanes_total(acc);
}
