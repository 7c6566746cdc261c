/* The lean forward's fp32 CPU glue: the elementwise work between one layer's products, one call each
 * (megatron_jf/inference/cpu_glue.py builds and loads this file; the lean forward calls it through ctypes).
 *
 * Why: on CPU every torch op costs a dispatch, and the first ops after a product that streamed megabytes of weights
 * run with torch's own code and data evicted from the caches (about 25 us an op on the Xeon this was measured on,
 * against 3 us warm). A layer's norms, RoPE and SwiGLU are 30-odd ops; here they are three calls into a few hundred
 * bytes of code.
 *
 * Exactness: every row (token) is computed by the same loop in the same order whatever the number of rows, so a
 * token's values do not depend on how many tokens share its forward (a draft's rows equal the AR step's bits).
 * Built without -ffast-math and with -ffp-contract=off: each product and sum rounds as written.
 * All arrays are contiguous fp32, row-major.
 */
#include <math.h>
#include <stdint.h>

#define LANES 16

/* sum of squares of v[0..d) in a fixed order: LANES interleaved partial sums, then the tail, then the partials */
static float sum_squares(const float *v, int64_t d) {
  float part[LANES] = {0};
  int64_t j = 0;
  for (; j + LANES <= d; j += LANES)
    for (int l = 0; l < LANES; l++) part[l] += v[j + l] * v[j + l];
  float acc = 0.f;
  for (; j < d; j++) acc += v[j] * v[j];
  for (int l = 0; l < LANES; l++) acc += part[l];
  return acc;
}

/* x[rows, d] += r (when r is not NULL), then out[rows, d] = x * (1 / sqrt(mean(x^2) + eps)) * w  (RMSNorm) */
void jf_add_rmsnorm(float *x, const float *r, const float *w, float *out, int64_t rows, int64_t d, float eps) {
  for (int64_t i = 0; i < rows; i++) {
    float *xi = x + i * d;
    float *oi = out + i * d;
    if (r) {
      const float *ri = r + i * d;
      for (int64_t j = 0; j < d; j++) xi[j] = xi[j] + ri[j];
    }
    const float s = 1.0f / sqrtf(sum_squares(xi, d) / (float)d + eps);
    for (int64_t j = 0; j < d; j++) oi[j] = (xi[j] * s) * w[j];
  }
}

/* x[rows, d] += r */
void jf_add(float *x, const float *r, int64_t rows, int64_t d) {
  const int64_t n = rows * d;
  for (int64_t j = 0; j < n; j++) x[j] = x[j] + r[j];
}

/* y[hd] = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x[half:], x[:half]] (megatron's non-interleaved RoPE) */
static void rope(const float *x, const float *c, const float *s, float *y, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t j = 0; j < half; j++) y[j] = x[j] * c[j] + (-x[j + half]) * s[j];
  for (int64_t j = half; j < hd; j++) y[j] = x[j] * c[j] + x[j - half] * s[j];
}

/* Split a QKV product and rotate q and k.
 *   qkv [b, s, ng, (qpg + 2) * hd]: per query group, qpg query heads, then its key head, then its value head
 *   cos, sin [b, s, hd]: each token's RoPE table row
 *   q [b, ng * qpg, s, hd], k and v [b, ng, s, hd] (out)                                                        */
void jf_rope_split_qkv(const float *qkv, const float *cos, const float *sin, float *q, float *k, float *v,
                       int64_t b, int64_t s, int64_t ng, int64_t qpg, int64_t hd) {
  const int64_t group = (qpg + 2) * hd, nh = ng * qpg;
  for (int64_t bi = 0; bi < b; bi++)
    for (int64_t t = 0; t < s; t++) {
      const float *row = qkv + (bi * s + t) * ng * group;
      const float *c = cos + (bi * s + t) * hd, *sn = sin + (bi * s + t) * hd;
      for (int64_t g = 0; g < ng; g++) {
        const float *src = row + g * group;
        for (int64_t j = 0; j < qpg; j++)
          rope(src + j * hd, c, sn, q + ((bi * nh + g * qpg + j) * s + t) * hd, hd);
        rope(src + qpg * hd, c, sn, k + ((bi * ng + g) * s + t) * hd, hd);
        const float *vs = src + (qpg + 1) * hd;
        float *vd = v + ((bi * ng + g) * s + t) * hd;
        for (int64_t j = 0; j < hd; j++) vd[j] = vs[j];
      }
    }
}

/* exp(x) to about 1 ulp on [-87.3, 88.3] (clamped outside): Cephes' expf (range reduction by ln 2 in two parts and a
 * degree-5 polynomial), written without calls or branches so the compiler vectorizes the loops it is in */
static inline float exp_poly(float x) {
  x = x > 88.3762626647949f ? 88.3762626647949f : x;
  x = x < -87.3365478515625f ? -87.3365478515625f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x / ln 2) */
  x = x - n * 0.693359375f;
  x = x - n * -2.12194440e-4f;
  const float z = x * x;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  union { int32_t i; float f; } p = {.i = ((int32_t)n + 127) << 23};
  return y * p.f;
}

/* out[rows, ff] = silu(gu[:, :ff]) * gu[:, ff:], silu(g) = g / (1 + exp(-g))  (SwiGLU) */
void jf_silu_mul(const float *gu, float *out, int64_t rows, int64_t ff) {
  for (int64_t i = 0; i < rows; i++) {
    const float *g = gu + i * 2 * ff, *u = g + ff;
    float *o = out + i * ff;
    for (int64_t j = 0; j < ff; j++) o[j] = (g[j] / (1.0f + exp_poly(-g[j]))) * u[j];
  }
}
