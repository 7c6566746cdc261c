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

typedef float v16 __attribute__((vector_size(64)));          /* 16 floats (two AVX registers without AVX-512) */
typedef float v16u __attribute__((vector_size(64), aligned(4))); /* the same, at any float's address */

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
 *   q [b, ng * qpg, s, hd] (out); k and v (out): token t of group g of row bi at k + bi * kv_row + g * kv_group +
 *   t * hd (a [b, ng, s, hd] buffer: kv_row = ng * s * hd, kv_group = s * hd; or a KV cache's rows from a slot on) */
void jf_rope_split_qkv(const float *qkv, const float *cos, const float *sin, float *q, float *k, float *v,
                       int64_t b, int64_t s, int64_t ng, int64_t qpg, int64_t hd, int64_t kv_row, int64_t kv_group) {
  const int64_t group = (qpg + 2) * hd, nh = ng * qpg;
  for (int64_t bi = 0; bi < b; bi++)
    for (int64_t t = 0; t < s; t++) {
      const float *row = qkv + (bi * s + t) * ng * group;
      const float *c = cos + (bi * s + t) * hd, *sn = sin + (bi * s + t) * hd;
      for (int64_t g = 0; g < ng; g++) {
        const float *src = row + g * group;
        for (int64_t j = 0; j < qpg; j++)
          rope(src + j * hd, c, sn, q + ((bi * nh + g * qpg + j) * s + t) * hd, hd);
        rope(src + qpg * hd, c, sn, k + bi * kv_row + g * kv_group + t * hd, hd);
        const float *vs = src + (qpg + 1) * hd;
        float *vd = v + bi * kv_row + g * kv_group + t * hd;
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

/* ---------------------------------------------------------------------------------------------------------------
 * Skinny products: y[R, N] = x[R, K] @ W^T for a few rows R, W given as panels (jf_pack_panels), read once per 16
 * rows. Every output element is the sequential sum over k = 0..K-1 of x[r, k] * W[n, k], one fused multiply-add per
 * k where the CPU has FMA (one rounding each; else a rounded product and a rounded sum), whichever of the loops below
 * computes it: a row's bits do not depend on R or on the rows beside it (jf_skinny_fused says which rounding).
 * Speed comes from reading S panels (S memory streams) at once with the R x S x 32 sums in registers, fetching each
 * panel PF k values ahead: on an Intel Xeon (one thread, weights from memory) SmolLM2-135M's 3,072 x 576 product took
 * 451-480 us at 1-4 rows against 528-1,117 us for the fastest of MKL and oneDNN. Past four rows the registers hold
 * four rows' sums: each group of panels is taken k chunk by k chunk, four rows at a time, all but the first four
 * reading the chunk from L1 (492-532 us at 5-8 rows, 541-710 at 9-16; MKL 1,184-1,874). Measured on that Xeon
 * against the previous kernel (no prefetch, no FMA, two halves of 8 rows at most, chunks of 128): 464-637 -> 451-532 us
 * at 1-8 rows, 876-944 -> 541-710 at 9-16.
 * --------------------------------------------------------------------------------------------------------------- */
#define PANEL 32 /* output columns per panel */

/* MADD16(a, x, w) = a + x * w, fused (one rounding) where the CPU has FMA; the scalar tail columns round the same
 * way (macros, not functions: a 64-byte vector argument has no stable ABI without AVX-512) */
#if defined(__AVX512F__)
#include <immintrin.h>
#define SKINNY_FUSED 1
#define MADD16(a, x, w) ((v16)_mm512_fmadd_ps((__m512)(x), (__m512)(w), (__m512)(a)))
#elif defined(__FMA__)
#include <immintrin.h>
#define SKINNY_FUSED 1
typedef union {
  v16 v;
  __m256 h[2];
} v16h;
#define MADD16(a, x, w)                                                                                        \
  ({                                                                                                           \
    v16h A_ = {(a)}, X_ = {(x)}, W_ = {(w)}, O_;                                                               \
    O_.h[0] = _mm256_fmadd_ps(X_.h[0], W_.h[0], A_.h[0]);                                                       \
    O_.h[1] = _mm256_fmadd_ps(X_.h[1], W_.h[1], A_.h[1]);                                                       \
    O_.v;                                                                                                      \
  })
#else
#define SKINNY_FUSED 0
#define MADD16(a, x, w) ((a) + (x) * (w))
#endif
#define MADD1(a, x, w) (SKINNY_FUSED ? fmaf((x), (w), (a)) : (a) + (x) * (w))

/* 1 where jf_skinny_mm's multiply-adds are fused (one rounding each), 0 where a product and a sum round apart */
int jf_skinny_fused(void) { return SKINNY_FUSED; }

/* panels[N / PANEL][K][PANEL] (the columns of W^T, 32 at a time, each panel contiguous) from w[N, K]; the last
 * N % PANEL columns are not packed (jf_skinny_mm reads them from w) */
void jf_pack_panels(const float *w, float *panels, int64_t N, int64_t K) {
  for (int64_t p = 0; p < N / PANEL; p++)
    for (int64_t k = 0; k < K; k++)
      for (int64_t j = 0; j < PANEL; j++) panels[(p * K + k) * PANEL + j] = w[(p * PANEL + j) * K + k];
}

/* panels [p0, p0 + S) for R rows, over k in [k0, k1): the sums start at zero when k0 == 0, else from y (where the
 * previous k range left them), so a sum split over k ranges is still the one sequential sum over k */
#define DEF_SKINNY_PF(R, S, NAME, PF)                                                                           \
  static void NAME(const float *x, const float *panels, float *y, int64_t N, int64_t K, int64_t p0, \
                               int64_t k0, int64_t k1) {                                                         \
    v16 a[R][S][2];                                                                                            \
    for (int r = 0; r < R; r++)                                                                                \
      for (int s = 0; s < S; s++) {                                                                            \
        if (k0 == 0) {                                                                                         \
          a[r][s][0] = a[r][s][1] = (v16){0};                                                                  \
        } else {                                                                                               \
          a[r][s][0] = *(const v16u *)(y + r * N + (p0 + s) * PANEL);                                          \
          a[r][s][1] = *(const v16u *)(y + r * N + (p0 + s) * PANEL + 16);                                     \
        }                                                                                                      \
      }                                                                                                        \
    for (int64_t k = k0; k < k1; k++) {                                                                        \
      v16 w[S][2];                                                                                             \
      for (int s = 0; s < S; s++) {                                                                            \
        const float *pw = panels + ((p0 + s) * K + k) * PANEL;                                                 \
        w[s][0] = *(const v16u *)pw;                                                                           \
        w[s][1] = *(const v16u *)(pw + 16);                                                                    \
        if (PF) {                                                                                              \
          __builtin_prefetch(pw + (PF) * PANEL);                                                               \
          __builtin_prefetch(pw + (PF) * PANEL + 16);                                                          \
        }                                                                                                      \
      }                                                                                                        \
      for (int r = 0; r < R; r++) {                                                                            \
        const float xs = x[r * K + k];                                                                         \
        const v16 xv = {xs, xs, xs, xs, xs, xs, xs, xs, xs, xs, xs, xs, xs, xs, xs, xs};                       \
        for (int s = 0; s < S; s++) {                                                                          \
          a[r][s][0] = MADD16(a[r][s][0], xv, w[s][0]);                                                        \
          a[r][s][1] = MADD16(a[r][s][1], xv, w[s][1]);                                                        \
        }                                                                                                      \
      }                                                                                                        \
    }                                                                                                          \
    for (int r = 0; r < R; r++)                                                                                \
      for (int s = 0; s < S; s++) {                                                                            \
        *(v16u *)(y + r * N + (p0 + s) * PANEL) = a[r][s][0];                                                  \
        *(v16u *)(y + r * N + (p0 + s) * PANEL + 16) = a[r][s][1];                                             \
      }                                                                                                        \
  }

/* a pass from memory fetches each panel PF k values (2 KiB) ahead; a later group of rows reads what the first left
 * in L1 */
#define PF 16
#define DEF_SKINNY(R, S) DEF_SKINNY_PF(R, S, skinny_##R##_##S, PF)
#define DEF_SECOND(R, S) DEF_SKINNY_PF(R, S, second_##R##_##S, 0)
typedef void (*skinny_fn)(const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t);
#define MAX_ROWS 16 /* rows per pass over the weight */
#define HALF 4     /* past HALF rows a pass runs over each k chunk in groups of HALF rows, all but the first from cache */
#define KCHUNK 32 /* k values per chunk: S panels x 32 x 32 floats (12 KiB at S = 3) stay in L1 between groups */
#ifdef __AVX512F__ /* 32 vector registers of 16 floats: up to 28 of them hold sums */
DEF_SKINNY(1, 4) DEF_SKINNY(2, 4) DEF_SKINNY(3, 4) DEF_SKINNY(4, 3) DEF_SECOND(1, 3) DEF_SECOND(2, 3)
DEF_SECOND(3, 3) DEF_SECOND(4, 3) DEF_SKINNY(1, 1) DEF_SKINNY(2, 1) DEF_SKINNY(3, 1) DEF_SKINNY(4, 1)
static const skinny_fn WIDE[HALF + 1] = {0, skinny_1_4, skinny_2_4, skinny_3_4, skinny_4_3};
static const int STREAMS[HALF + 1] = {0, 4, 4, 4, 3};
/* a later group of rows: the first group's streams */
static const skinny_fn SECOND[HALF + 1] = {0, second_1_3, second_2_3, second_3_3, second_4_3};
#else /* 16 registers of 8 floats (a v16 is two) */
DEF_SKINNY(1, 2) DEF_SKINNY(1, 1) DEF_SKINNY(2, 1) DEF_SKINNY(3, 1) DEF_SKINNY(4, 1) DEF_SECOND(1, 1)
DEF_SECOND(2, 1) DEF_SECOND(3, 1) DEF_SECOND(4, 1)
static const skinny_fn WIDE[HALF + 1] = {0, skinny_1_2, skinny_2_1, skinny_3_1, skinny_4_1};
static const int STREAMS[HALF + 1] = {0, 2, 1, 1, 1};
static const skinny_fn SECOND[HALF + 1] = {0, second_1_1, second_2_1, second_3_1, second_4_1};
#endif
static const skinny_fn ONE[HALF + 1] = {0, skinny_1_1, skinny_2_1, skinny_3_1, skinny_4_1};

/* y[R, N] = x[R, K] @ w[N, K]^T: MAX_ROWS rows at a time. Up to HALF rows: the packed columns from panels, S at a
 * time, then one at a time. More: each group of S panels (of the first group's S) k chunk by k chunk, the rows HALF
 * at a time, so the weight comes from memory once and the later groups read it from cache. The last N % PANEL
 * columns from w, one element at a time (the same sum, in the same order) */
void jf_skinny_mm(const float *x, const float *panels, const float *w, float *y, int64_t R, int64_t N, int64_t K) {
  const int64_t np = N / PANEL;
  for (int64_t r0 = 0; r0 < R; r0 += MAX_ROWS) {
    const int64_t rows = R - r0 < MAX_ROWS ? R - r0 : MAX_ROWS;
    const float *xr = x + r0 * K;
    float *yr = y + r0 * N;
    const int64_t first = rows < HALF ? rows : HALF, rest = rows - first;
    const int64_t S = STREAMS[first];
    int64_t p = 0;
    if (rest == 0) {
      for (; p + S <= np; p += S) WIDE[first](xr, panels, yr, N, K, p, 0, K);
      for (; p < np; p++) ONE[first](xr, panels, yr, N, K, p, 0, K);
    } else {
      for (; p + S <= np; p += S)
        for (int64_t k0 = 0; k0 < K; k0 += KCHUNK) {
          const int64_t k1 = k0 + KCHUNK < K ? k0 + KCHUNK : K;
          WIDE[first](xr, panels, yr, N, K, p, k0, k1);
          for (int64_t g = HALF; g < rows; g += HALF) {
            const int64_t m = rows - g < HALF ? rows - g : HALF;
            SECOND[m](xr + g * K, panels, yr + g * N, N, K, p, k0, k1);
          }
        }
      for (; p < np; p++)
        for (int64_t g = 0; g < rows; g += HALF) {
          const int64_t m = rows - g < HALF ? rows - g : HALF;
          ONE[m](xr + g * K, panels, yr + g * N, N, K, p, 0, K);
        }
    }
    for (int64_t n = np * PANEL; n < N; n++)
      for (int64_t r = 0; r < rows; r++) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; k++) acc = MADD1(acc, xr[r * K + k], w[n * K + k]);
        yr[r * N + n] = acc;
      }
  }
}

/* ---------------------------------------------------------------------------------------------------------------
 * Decode attention: a few new tokens per row over the row's KV cache, causal among the new tokens. On a CPU, SDPA's
 * call costs 25-40 us a layer for a handful of queries (the first ops after a product find torch's code evicted; a
 * mask for more than one token; the output copied to [b, s, h]) where the arithmetic is a few microseconds.
 * Each (row, head, token) is computed by one loop in one order whatever s is, so a token's output does not depend on
 * how many tokens share its forward:
 *   score_j = (sum over the head dim in 16 lanes, chunk by chunk with MADD16, then the lanes summed pairwise: l and
 *             l + 8, then + 4, + 2, + 1) * scale -- 16 keys at a time through a butterfly of shuffles that adds the
 *             lanes in that same order, the last n % 16 keys one at a time;
 *   p_j = exp_poly(score_j - max); sum = the p_j in 16 interleaved partial sums, the tail, then the partials in order;
 *   o = (sum_j p_j v_j, in 4 interleaved partial sums by j mod 4, the last n % 4 keys into the first, then added in
 *        order) / sum.
 * --------------------------------------------------------------------------------------------------------------- */
#define ATTN_MAX_HD 256 /* head dims up to this many channels (a multiple of 16) */

#if defined(__clang__)
#define SHUFFLE2(a, b, ...) __builtin_shufflevector((a), (b), __VA_ARGS__)
#else
typedef int32_t v16i __attribute__((vector_size(64)));
#define SHUFFLE2(a, b, ...) __builtin_shuffle((a), (b), (v16i){__VA_ARGS__})
#endif
#define SHUFFLE1(a, ...) SHUFFLE2(a, a, __VA_ARGS__)

/* one key's 16 lane sums of q . k over the head dim (nv chunks of 16) */
#define KEY_LANES(acc, qv, kp, nv)                                                                             \
  do {                                                                                                         \
    acc = (qv)[0] * *(const v16u *)(kp);                                                                       \
    for (int64_t c_ = 1; c_ < (nv); c_++) acc = MADD16(acc, (qv)[c_], *(const v16u *)((kp) + 16 * c_));        \
  } while (0)

/* the sum of a's 16 lanes: l and l + 8, then l and l + 4, l + 2, l + 1 */
static inline float lanes_sum(const v16 *p) {
  v16 a = *p;
  a = a + SHUFFLE1(a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  a = a + SHUFFLE1(a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  a = a + SHUFFLE1(a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  a = a + SHUFFLE1(a, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return a[0];
}

/* out = the lane sums of 16 keys' vectors a[0..15] (as lanes_sum adds them), key k in lane k */
static inline void keys_sum(const v16 *a, v16 *out) {
  v16 l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; i++) /* keys 2i, 2i + 1: lanes l + (l + 8) of each, 8 lanes a key */
    l1[i] = SHUFFLE2(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            SHUFFLE2(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; i++) /* 4 lanes a key */
    l2[i] = SHUFFLE2(l1[2 * i], l1[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            SHUFFLE2(l1[2 * i], l1[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; i++) /* 2 lanes a key */
    l3[i] = SHUFFLE2(l2[2 * i], l2[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
            SHUFFLE2(l2[2 * i], l2[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  *out = SHUFFLE2(l3[0], l3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUFFLE2(l3[0], l3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

#define ATTN_CHUNK 64 /* keys whose K (then V) rows stay in L1 while every query of a KV head reads them */

/* scores of one query (qv: its nv chunks) for keys [j0, j1), j0 a multiple of 16: 16-key blocks through the butterfly,
 * the last j1 % 16 keys one at a time (the same sums either way) */
static inline __attribute__((always_inline)) void scores_range(const v16 *qv, const float *K, float *sc, int64_t j0,
                                                                 int64_t j1, const int64_t nv, float scale) {
  const v16 scalev = {scale, scale, scale, scale, scale, scale, scale, scale,
                      scale, scale, scale, scale, scale, scale, scale, scale};
  int64_t j = j0;
  for (; j + 16 <= j1; j += 16) {
    v16 a[16], d;
    for (int k = 0; k < 16; k++) KEY_LANES(a[k], qv, K + (j + k) * 16 * nv, nv);
    keys_sum(a, &d);
    *(v16u *)(sc + j) = d * scalev;
  }
  for (; j < j1; j++) {
    v16 a0;
    KEY_LANES(a0, qv, K + j * 16 * nv, nv);
    sc[j] = lanes_sum(&a0) * scale;
  }
}

/* p[0..n) = exp(sc - max) in place; returns their sum (16 interleaved partial sums, the tail, then the partials) */
static float softmax_numerators(float *sc, int64_t n) {
  float m = -INFINITY;
  for (int64_t j = 0; j < n; j++) m = sc[j] > m ? sc[j] : m;
  float part[LANES] = {0};
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int l = 0; l < LANES; l++) {
      const float e = exp_poly(sc[j + l] - m);
      sc[j + l] = e;
      part[l] += e;
    }
  float sum = 0.f;
  for (; j < n; j++) {
    const float e = exp_poly(sc[j] - m);
    sc[j] = e;
    sum += e;
  }
  for (int l = 0; l < LANES; l++) sum += part[l];
  return sum;
}

/* One KV head's queries -- qpg heads x s tokens, query i = (head j, token t) with i = j * s + t, at q + i * hd -- over its
 * keys and values K, V [start + s][hd]: token t attends keys 0..start+t. Keys are taken ATTN_CHUNK at a time, every
 * query reading the chunk while it is in L1 (first the scores, then the values). scr: (qpg * s) * (start + s + 4 * hd)
 * floats. Output row i at o + (t * nh + j) * hd. Each query's sums run in one order whatever s and qpg are. */
static inline __attribute__((always_inline)) void attend_head(const float *q, const float *K, const float *V, float *o,
                                                                float *scr, int64_t s, int64_t qpg, int64_t nh,
                                                                int64_t start, const int64_t nv, float scale) {
  const int64_t hd = 16 * nv, Q = qpg * s, L = start + s;
  float *sc = scr, *accbuf = scr + Q * L, *sums = accbuf + Q * 4 * hd;
  for (int64_t c0 = 0; c0 < L; c0 += ATTN_CHUNK)
    for (int64_t i = 0; i < Q; i++) {
      const int64_t n = start + i % s + 1;
      if (c0 >= n) continue;
      v16 qv[ATTN_MAX_HD / 16];
      for (int64_t c = 0; c < nv; c++) qv[c] = *(const v16u *)(q + i * hd + 16 * c);
      scores_range(qv, K, sc + i * L, c0, c0 + ATTN_CHUNK < n ? c0 + ATTN_CHUNK : n, nv, scale);
    }
  for (int64_t i = 0; i < Q; i++) sums[i] = softmax_numerators(sc + i * L, start + i % s + 1);
  for (int64_t x = 0; x < Q * 4 * hd; x++) accbuf[x] = 0.f;
  /* o = sum_j p_j v_j: 4 interleaved sums by j mod 4 over the first n - n % 4 keys, the last n % 4 into the first */
  for (int64_t c0 = 0; c0 < L; c0 += ATTN_CHUNK)
    for (int64_t i = 0; i < Q; i++) {
      const int64_t n = start + i % s + 1, n4 = n - n % 4;
      if (c0 >= n) continue;
      const float *p = sc + i * L;
      v16 acc[4][ATTN_MAX_HD / 16];
      float *ab = accbuf + i * 4 * hd;
      for (int u = 0; u < 4; u++)
        for (int64_t c = 0; c < nv; c++) acc[u][c] = *(const v16u *)(ab + (u * nv + c) * 16);
      const int64_t c1 = c0 + ATTN_CHUNK < n4 ? c0 + ATTN_CHUNK : n4;
      for (int64_t j = c0; j < c1; j += 4)
        for (int u = 0; u < 4; u++) {
          const float pj = p[j + u];
          const v16 pv = {pj, pj, pj, pj, pj, pj, pj, pj, pj, pj, pj, pj, pj, pj, pj, pj};
          const float *vj = V + (j + u) * hd;
          for (int64_t c = 0; c < nv; c++) acc[u][c] = MADD16(acc[u][c], pv, *(const v16u *)(vj + 16 * c));
        }
      if (n4 < c0 + ATTN_CHUNK) /* the chunk that holds key n4: the tail after every 4-way key */
        for (int64_t j = n4; j < n; j++) {
          const float pj = p[j];
          const v16 pv = {pj, pj, pj, pj, pj, pj, pj, pj, pj, pj, pj, pj, pj, pj, pj, pj};
          for (int64_t c = 0; c < nv; c++) acc[0][c] = MADD16(acc[0][c], pv, *(const v16u *)(V + j * hd + 16 * c));
        }
      for (int u = 0; u < 4; u++)
        for (int64_t c = 0; c < nv; c++) *(v16u *)(ab + (u * nv + c) * 16) = acc[u][c];
    }
  for (int64_t i = 0; i < Q; i++) {
    const float *ab = accbuf + i * 4 * hd;
    const float sum = sums[i];
    const v16 sv = {sum, sum, sum, sum, sum, sum, sum, sum, sum, sum, sum, sum, sum, sum, sum, sum};
    float *ot = o + ((i % s) * nh + i / s) * hd;
    for (int64_t c = 0; c < nv; c++) {
      const v16 a0 = *(const v16u *)(ab + c * 16), a1 = *(const v16u *)(ab + (nv + c) * 16);
      const v16 a2 = *(const v16u *)(ab + (2 * nv + c) * 16), a3 = *(const v16u *)(ab + (3 * nv + c) * 16);
      *(v16u *)(ot + 16 * c) = (((a0 + a1) + a2) + a3) / sv;
    }
  }
}

/* q [b, ng * qpg, s, hd]; row bi's keys (values) of group g at kc (vc) + bi * kv_row + g * kv_group, slot j at
 * + j * hd, the new tokens' own at slots start..start+s-1; token t attends slots 0..start+t.
 * o [b, s, ng * qpg * hd] (out); scr: scratch of (qpg * s) * (start + s + 4 * hd) + qpg * s floats. hd a multiple of 16,
 * at most ATTN_MAX_HD. */
void jf_decode_attn(const float *q, const float *kc, const float *vc, float *o, float *scr, int64_t b, int64_t s,
                    int64_t ng, int64_t qpg, int64_t hd, int64_t start, int64_t kv_row, int64_t kv_group,
                    float scale) {
  const int64_t nh = ng * qpg, nv = hd / 16;
  for (int64_t bi = 0; bi < b; bi++)
    for (int64_t g = 0; g < ng; g++) {
      const float *K = kc + bi * kv_row + g * kv_group, *V = vc + bi * kv_row + g * kv_group;
      const float *qg = q + (bi * nh + g * qpg) * s * hd; /* its qpg heads' s tokens, back to back */
      float *og = o + (bi * s * nh + g * qpg) * hd;
      switch (nv) { /* the usual head dims with the chunk count a constant */
        case 2: attend_head(qg, K, V, og, scr, s, qpg, nh, start, 2, scale); break;
        case 4: attend_head(qg, K, V, og, scr, s, qpg, nh, start, 4, scale); break;
        case 8: attend_head(qg, K, V, og, scr, s, qpg, nh, start, 8, scale); break;
        default: attend_head(qg, K, V, og, scr, s, qpg, nh, start, nv, scale);
      }
    }
}
