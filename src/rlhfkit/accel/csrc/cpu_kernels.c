/* rlhfkit's compiled pieces, float32 on a CPU: softmax attention for short contexts (forward,
 * backward, and a decode step that also appends to the KV cache), the tanh-GELU and a Llama MLP's
 * SwiGLU gate (forward and backward each), the masked softmax between the oneDNN products of
 * the blocked causal attention, the sampling step of a rollout, a bfloat16 LM head's
 * logsumexp and logits' gradient (read and written as bfloat16, computed in float32), and a
 * bfloat16 decode step's attention and RMS norm (the attention on AVX-512 BF16, in functions
 * compiled for it alone). Called through ctypes from rlhfkit/accel/kernels.py,
 * which compiles this file on first use and falls back to PyTorch when it cannot.
 *
 * At a small model's sizes PyTorch's CPU kernels spend more on set-up than on arithmetic:
 * attention for 64 rows x 4 heads x one query x a few dozen keys takes ~100 us, the GELU of a
 * [64, 256] activation four element-wise passes of ~10 us each, a sampling step ~12 small ops.
 * The loops here do the same arithmetic in one pass each. Written with GCC/Clang vector
 * extensions (8 floats: one AVX register, two NEON ones); where AVX is compiled in, the lane
 * select and the clamps are its single instructions (the generic forms are 3-4 each). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4))); /* unaligned loads and stores */

static inline v8 ld(const float *p) { return *(const v8u *)p; }
static inline void st(float *p, v8 x) { *(v8u *)p = x; }
static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }

static inline v8 sel(i8 m, v8 a, v8 b) { /* lane by lane: m ? a : b (m: all ones or all zeros a lane) */
#ifdef __AVX__
    return (v8)_mm256_blendv_ps((__m256)b, (__m256)a, (__m256)m);
#else
    i8 ai, bi, r;
    memcpy(&ai, &a, 32);
    memcpy(&bi, &b, 32);
    r = (ai & m) | (bi & ~m);
    v8 o;
    memcpy(&o, &r, 32);
    return o;
#endif
}

static inline v8 vmax(v8 a, v8 b) { /* lane by lane; a NaN in either gives b (maxps): put a constant first */
#ifdef __AVX__
    return (v8)_mm256_max_ps((__m256)a, (__m256)b);
#else
    return sel(a > b, a, b);
#endif
}

static inline v8 vmin(v8 a, v8 b) {
#ifdef __AVX__
    return (v8)_mm256_min_ps((__m256)a, (__m256)b);
#else
    return sel(a < b, a, b);
#endif
}

static inline float hsum(v8 x) {
    return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

static inline float hmax(v8 x) {
    float m = x[0];
    for (int i = 1; i < 8; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* (sum a[0], ..., sum a[7]): eight dot products finished at once */
static inline v8 hsum8(const v8 *a) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
    v8 b0 = __builtin_shufflevector(a[0], a[1], 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(a[0], a[1], 1, 9, 3, 11, 5, 13, 7, 15);
    v8 b1 = __builtin_shufflevector(a[2], a[3], 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(a[2], a[3], 1, 9, 3, 11, 5, 13, 7, 15);
    v8 b2 = __builtin_shufflevector(a[4], a[5], 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(a[4], a[5], 1, 9, 3, 11, 5, 13, 7, 15);
    v8 b3 = __builtin_shufflevector(a[6], a[7], 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(a[6], a[7], 1, 9, 3, 11, 5, 13, 7, 15);
    /* b0 = (a0 01, a1 01, a0 23, a1 23, a0 45, a1 45, a0 67, a1 67): pair sums */
    v8 c0 = __builtin_shufflevector(b0, b1, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(b0, b1, 2, 3, 10, 11, 6, 7, 14, 15);
    v8 c1 = __builtin_shufflevector(b2, b3, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(b2, b3, 2, 3, 10, 11, 6, 7, 14, 15);
    /* c0 = (a0..a3 over lanes 0-3, a0..a3 over lanes 4-7) */
    return __builtin_shufflevector(c0, c1, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(c0, c1, 4, 5, 6, 7, 12, 13, 14, 15);
#else
    v8 r;
    for (int i = 0; i < 8; i++) r[i] = hsum(a[i]);
    return r;
#endif
}

/* exp(x) for -87 <= x <= 87. Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a
 * degree-7 polynomial, 2^n put into the exponent bits. n = x log2e rounded to the nearest integer
 * by adding 1.5 * 2^23, which leaves it in the low bits of t's mantissa: no conversions to and
 * from integers (half the time of a floor by conversion on an Intel Xeon). Relative error
 * ~1e-7, as the vectorised exp of PyTorch's own kernels. */
static inline v8 exp8_range(v8 x) {
    const v8 shift = splat(12582912.f); /* 1.5 * 2^23 */
    const v8 t = x * splat(1.44269504088896341f) + shift;
    const v8 n = t - shift;
    const v8 r = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f); /* ln2 in two parts */
    v8 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.f);
    i8 ti;
    memcpy(&ti, &t, 32);
    const i8 e = (ti - 0x4B400000 + 127) << 23; /* t's bits minus the shift's are n */
    v8 two_n;
    memcpy(&two_n, &e, 32);
    return p * two_n;
}

/* exp(x) for x <= 87 (scores minus their maximum are <= 0), 0 below -87 and for -inf. */
static inline v8 exp8(v8 x) {
    const i8 dead = x < splat(-87.0f);
    return sel(dead, splat(0.f), exp8_range(vmax(splat(-87.0f), x))); /* a NaN stays NaN */
}

/* ------------------------------------------------------------------------------ attention
 *
 * out[b, h, i, :] = sum_j p_j v[b, h / g, j, :],  p = softmax_j(scale * q[b, h, i, :] . k[b, h / g, j, :] + bias[b, i, j])
 *
 * Strides are in elements; the innermost dimension (head_dim) of q, k, v and out is
 * contiguous. A bias of -inf masks a key exactly (its probability is 0 whatever the key
 * holds); every query row must leave at least one key unmasked. */

#define MAX_D8 64        /* head_dim up to 512 */
#define MAX_KEYS 16384   /* the scores of one query live on the stack: 64 KiB at most */

/* scores of keys j0 .. j0+7 (a partial block, full == 0, repeats the last key and masks the
 * copies), plus the bias, -inf exactly where the bias is -inf */
static inline __attribute__((always_inline)) v8 scores8(
    const float *restrict qi, const v8 *restrict qv, const float *restrict kb, const float *restrict bi,
    int64_t j0, int64_t Tk, const int64_t D, float scale, int64_t ksj, int64_t bsj, const int full)
{
    const int64_t n8 = D / 8, D8 = n8 * 8;
    v8 a[8], bias;
    float tail[8] = {0};
    for (int jj = 0; jj < 8; jj++) {
        const int64_t j = full || j0 + jj < Tk ? j0 + jj : Tk - 1;
        const float *kj = kb + j * ksj;
        v8 acc = qv[0] * ld(kj);
        for (int64_t d = 1; d < n8; d++) acc += qv[d] * ld(kj + 8 * d);
        a[jj] = acc;
        for (int64_t d = D8; d < D; d++) tail[jj] += qi[d] * scale * kj[d];
    }
    if (full && bsj == 1) {
        bias = ld(bi + j0);
    } else {
        for (int jj = 0; jj < 8; jj++) bias[jj] = full || j0 + jj < Tk ? bi[(j0 + jj) * bsj] : -INFINITY;
    }
    v8 sc = hsum8(a) + bias;
    if (D8 < D) {
        v8 t;
        memcpy(&t, tail, 32);
        sc += t;
    }
    const v8 ninf = splat(-INFINITY);
    return sel(bias == ninf, ninf, sc);
}

/* one query row; D is a compile-time constant in the common cases (see rlhfkit_attend) */
static inline __attribute__((always_inline)) void row(
    const float *restrict qi, const float *restrict kb, const float *restrict vb, const float *restrict bi,
    float *restrict o, int64_t Tk, const int64_t D, float scale, int64_t ksj, int64_t vsj, int64_t bsj,
    float *restrict s, float *restrict lse)
{
    const int64_t n8 = D / 8, D8 = n8 * 8;
    v8 qv[MAX_D8];
    for (int64_t d = 0; d < n8; d++) qv[d] = ld(qi + 8 * d) * splat(scale);
    v8 m8 = splat(-INFINITY);
    int64_t j0 = 0;
    for (; j0 + 8 <= Tk; j0 += 8) {
        v8 sc = scores8(qi, qv, kb, bi, j0, Tk, D, scale, ksj, bsj, 1);
        st(s + j0, sc);
        m8 = sel(sc > m8, sc, m8);
    }
    if (j0 < Tk) {
        v8 sc = scores8(qi, qv, kb, bi, j0, Tk, D, scale, ksj, bsj, 0);
        st(s + j0, sc);
        m8 = sel(sc > m8, sc, m8);
    }
    const v8 mv = splat(hmax(m8));
    v8 sum8 = splat(0.f);
    for (j0 = 0; j0 < Tk; j0 += 8) {
        v8 e = exp8(ld(s + j0) - mv);
        st(s + j0, e);
        sum8 += e;
    }
    /* out = sum_j p_j v_j, keys two at a time into two accumulators: a single chain of
     * dependent FMAs would wait on itself. Masked keys have p = 0 (their values must be finite,
     * as for any matmul) */
    v8 a0[MAX_D8], a1[MAX_D8];
    float t0[8] = {0}, t1[8] = {0};
    for (int64_t d = 0; d < n8; d++) a0[d] = a1[d] = splat(0.f);
    int64_t j = 0;
    for (; j + 2 <= Tk; j += 2) {
        const float *v0 = vb + j * vsj, *v1 = v0 + vsj;
        const v8 p0 = splat(s[j]), p1 = splat(s[j + 1]);
        for (int64_t d = 0; d < n8; d++) {
            a0[d] += p0 * ld(v0 + 8 * d);
            a1[d] += p1 * ld(v1 + 8 * d);
        }
        for (int64_t d = D8; d < D; d++) {
            t0[d - D8] += s[j] * v0[d];
            t1[d - D8] += s[j + 1] * v1[d];
        }
    }
    if (j < Tk) {
        const float *v0 = vb + j * vsj;
        const v8 p0 = splat(s[j]);
        for (int64_t d = 0; d < n8; d++) a0[d] += p0 * ld(v0 + 8 * d);
        for (int64_t d = D8; d < D; d++) t0[d - D8] += s[j] * v0[d];
    }
    const float total = hsum(sum8), inv = 1.f / total;
    if (lse) *lse = hmax(m8) + logf(total); /* log-sum-exp of the scores: the backward's softmax */
    const v8 iv = splat(inv);
    for (int64_t d = 0; d < n8; d++) st(o + 8 * d, (a0[d] + a1[d]) * iv);
    for (int64_t d = D8; d < D; d++) o[d] = (t0[d - D8] + t1[d - D8]) * inv;
}

/* One query for each of the G heads that read the same key head (grouped-query attention in a
 * decode step), as G calls of row() but with the heads taking turns on each block of keys: a
 * block of 8 keys (or of KEYS_IN_L1 values) is read from L2 or memory once and then from L1
 * by every head of the group, where separate rows stream the whole key head G times. The same
 * arithmetic in the same order as row(), so the results match it bit for bit. D a multiple of 8.
 * q and out of head h at q0 + h * qh, o0 + h * oh; lse (may be NULL) at lse0 + h. */
#define MAX_G 32
#ifndef KEYS_IN_L1
#define KEYS_IN_L1 64 /* values a pass: 16 KiB at head_dim 64 */
#endif
static inline __attribute__((always_inline)) void group_row(
    const float *restrict q0, int64_t qh, const int64_t G, const float *restrict kb, const float *restrict vb,
    const float *restrict bi, float *restrict o0, int64_t oh, int64_t Tk, const int64_t D, float scale,
    int64_t ksj, int64_t vsj, int64_t bsj, float *restrict s, float *restrict lse0)
{
    const int64_t n8 = D / 8, Tp = (Tk + 7) / 8 * 8;
    v8 qv[G * n8], m8[G], sum8[G], acc0[G * n8], acc1[G * n8];
    for (int64_t h = 0; h < G; h++) {
        for (int64_t d = 0; d < n8; d++) qv[h * n8 + d] = ld(q0 + h * qh + 8 * d) * splat(scale);
        m8[h] = splat(-INFINITY);
    }
    for (int64_t c0 = 0; c0 < Tk; c0 += KEYS_IN_L1) {
        const int64_t c1 = c0 + KEYS_IN_L1 < Tk ? c0 + KEYS_IN_L1 : Tk;
        for (int64_t h = 0; h < G; h++) {
            const float *qi = q0 + h * qh;
            v8 m = m8[h];
            int64_t j0 = c0;
            for (; j0 + 8 <= c1; j0 += 8) {
                const v8 sc = scores8(qi, qv + h * n8, kb, bi, j0, Tk, D, scale, ksj, bsj, 1);
                st(s + h * Tp + j0, sc);
                m = sel(sc > m, sc, m);
            }
            if (j0 < c1) {
                const v8 sc = scores8(qi, qv + h * n8, kb, bi, j0, Tk, D, scale, ksj, bsj, 0);
                st(s + h * Tp + j0, sc);
                m = sel(sc > m, sc, m);
            }
            m8[h] = m;
        }
    }
    for (int64_t h = 0; h < G; h++) {
        const v8 mv = splat(hmax(m8[h]));
        float *sh = s + h * Tp;
        sum8[h] = splat(0.f);
        for (int64_t j0 = 0; j0 < Tk; j0 += 8) {
            v8 e = exp8(ld(sh + j0) - mv);
            st(sh + j0, e);
            sum8[h] += e;
        }
        for (int64_t d = 0; d < n8; d++) acc0[h * n8 + d] = acc1[h * n8 + d] = splat(0.f);
    }
    /* out = sum_j p_j v_j as in row(): keys two at a time into two accumulators */
    for (int64_t c0 = 0; c0 < Tk; c0 += KEYS_IN_L1) {
        const int64_t c1 = c0 + KEYS_IN_L1 < Tk ? c0 + KEYS_IN_L1 : Tk;
        for (int64_t h = 0; h < G; h++) {
            const float *sh = s + h * Tp;
            v8 a0[MAX_D8], a1[MAX_D8];
            for (int64_t d = 0; d < n8; d++) a0[d] = acc0[h * n8 + d], a1[d] = acc1[h * n8 + d];
            int64_t j = c0;
            for (; j + 2 <= c1; j += 2) {
                const float *v0 = vb + j * vsj, *v1 = v0 + vsj;
                const v8 p0 = splat(sh[j]), p1 = splat(sh[j + 1]);
                for (int64_t d = 0; d < n8; d++) {
                    a0[d] += p0 * ld(v0 + 8 * d);
                    a1[d] += p1 * ld(v1 + 8 * d);
                }
            }
            if (j < c1) {
                const float *v0 = vb + j * vsj;
                const v8 p0 = splat(sh[j]);
                for (int64_t d = 0; d < n8; d++) a0[d] += p0 * ld(v0 + 8 * d);
            }
            for (int64_t d = 0; d < n8; d++) acc0[h * n8 + d] = a0[d], acc1[h * n8 + d] = a1[d];
        }
    }
    for (int64_t h = 0; h < G; h++) {
        const float total = hsum(sum8[h]), inv = 1.f / total;
        if (lse0) lse0[h] = hmax(m8[h]) + logf(total);
        const v8 iv = splat(inv);
        for (int64_t d = 0; d < n8; d++) st(o0 + h * oh + 8 * d, (acc0[h * n8 + d] + acc1[h * n8 + d]) * iv);
    }
}

/* Returns 0, or 1 when head_dim or the number of keys is too large. Strides: q (b, h, i),
 * k and v (b, h_kv, j), bias (b, i, j), out (b, h, i). lse, when not NULL, receives each
 * query's log-sum-exp of scores, contiguous [B, H, Tq] (for rlhfkit_attend_backward). */
int rlhfkit_attend(const float *q, const float *k, const float *v, const float *bias, float *out, float *lse,
                   int64_t B, int64_t H, int64_t Hkv, int64_t Tq, int64_t Tk, int64_t D, float scale,
                   int64_t qb, int64_t qh, int64_t qi, int64_t kb, int64_t kh, int64_t kj,
                   int64_t vb, int64_t vh, int64_t vj, int64_t bb, int64_t bi, int64_t bj,
                   int64_t ob, int64_t oh, int64_t oi)
{
    if (D > 8 * MAX_D8 || Tk < 1 || Tk > MAX_KEYS || H % Hkv) return 1;
    const int64_t g = H / Hkv;
    /* a decode step with four or more heads a key head: at one thread, 0.6-0.8x the time of
     * separate rows (14 heads over 2, 4096 keys; 32 over 8, head_dim 128). At three heads a
     * key head (SmolLM2) it measured 1.05x, so separate rows keep it (2-core AMD EPYC Zen 5) */
    if (Tq == 1 && g >= 4 && g <= MAX_G && D % 8 == 0) {
        float s[g * ((Tk + 7) / 8 * 8)];
        for (int64_t b = 0; b < B; b++)
            for (int64_t hk = 0; hk < Hkv; hk++) {
                const float *kp = k + b * kb + hk * kh, *vp = v + b * vb + hk * vh, *qp = q + b * qb + hk * g * qh;
                float *op = out + b * ob + hk * g * oh, *lp = lse ? lse + b * H + hk * g : NULL;
                const float *bp = bias + b * bb;
                switch (D) {
                case 16: group_row(qp, qh, g, kp, vp, bp, op, oh, Tk, 16, scale, kj, vj, bj, s, lp); break;
                case 32: group_row(qp, qh, g, kp, vp, bp, op, oh, Tk, 32, scale, kj, vj, bj, s, lp); break;
                case 64: group_row(qp, qh, g, kp, vp, bp, op, oh, Tk, 64, scale, kj, vj, bj, s, lp); break;
                case 128: group_row(qp, qh, g, kp, vp, bp, op, oh, Tk, 128, scale, kj, vj, bj, s, lp); break;
                default: group_row(qp, qh, g, kp, vp, bp, op, oh, Tk, D, scale, kj, vj, bj, s, lp);
                }
            }
        return 0;
    }
    float s[(Tk + 7) / 8 * 8];
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const float *kp = k + b * kb + (h / g) * kh, *vp = v + b * vb + (h / g) * vh;
            for (int64_t i = 0; i < Tq; i++) {
                const float *qp = q + b * qb + h * qh + i * qi, *bp = bias + b * bb + i * bi;
                float *op = out + b * ob + h * oh + i * oi, *lp = lse ? lse + (b * H + h) * Tq + i : NULL;
                switch (D) {
                case 16: row(qp, kp, vp, bp, op, Tk, 16, scale, kj, vj, bj, s, lp); break;
                case 32: row(qp, kp, vp, bp, op, Tk, 32, scale, kj, vj, bj, s, lp); break;
                case 64: row(qp, kp, vp, bp, op, Tk, 64, scale, kj, vj, bj, s, lp); break;
                case 128: row(qp, kp, vp, bp, op, Tk, 128, scale, kj, vj, bj, s, lp); break;
                default: row(qp, kp, vp, bp, op, Tk, D, scale, kj, vj, bj, s, lp);
                }
            }
        }
    return 0;
}

/* the backward of one query row, from the forward's log-sum-exp: with p_j = exp(s_j - lse),
 * dv_j += p_j dO, dp_j = dO . v_j, ds_j = p_j (dp_j - dO . O), dq = scale sum_j ds_j k_j,
 * dk_j += scale ds_j q. dk and dv accumulate over queries and grouped heads. */
static inline __attribute__((always_inline)) void row_backward(
    const float *restrict qi, const float *restrict kb, const float *restrict vb, const float *restrict bi,
    const float *restrict oi, const float *restrict goi, float lse, float *restrict dqi, float *restrict dkb,
    float *restrict dvb, int64_t Tk, const int64_t D, float scale, int64_t ksj, int64_t vsj, int64_t bsj,
    float *restrict p, float *restrict ds)
{
    const int64_t n8 = D / 8, D8 = n8 * 8;
    v8 qv[MAX_D8], gv[MAX_D8];
    float delta = 0.f; /* dO . O */
    for (int64_t d = 0; d < n8; d++) {
        qv[d] = ld(qi + 8 * d) * splat(scale);
        gv[d] = ld(goi + 8 * d);
        delta += hsum(gv[d] * ld(oi + 8 * d));
    }
    for (int64_t d = D8; d < D; d++) delta += goi[d] * oi[d];
    const float zero = 0.f;
    for (int64_t j0 = 0; j0 < Tk; j0 += 8) {
        const int full = j0 + 8 <= Tk;
        const v8 sc = full ? scores8(qi, qv, kb, bi, j0, Tk, D, scale, ksj, bsj, 1)
                           : scores8(qi, qv, kb, bi, j0, Tk, D, scale, ksj, bsj, 0);
        const v8 dp = full ? scores8(goi, gv, vb, &zero, j0, Tk, D, 1.f, vsj, 0, 1)
                           : scores8(goi, gv, vb, &zero, j0, Tk, D, 1.f, vsj, 0, 0);
        const v8 pv = exp8(sc - splat(lse)); /* 0 where masked */
        st(p + j0, pv);
        st(ds + j0, pv * (dp - splat(delta)) * splat(scale));
    }
    v8 dq[MAX_D8];
    float dqt[8] = {0};
    for (int64_t d = 0; d < n8; d++) dq[d] = splat(0.f);
    for (int64_t j = 0; j < Tk; j++) {
        if (p[j] == 0.f) continue; /* a masked key: no gradient either way */
        const v8 pj = splat(p[j]), dsj = splat(ds[j]);
        const float *kj = kb + j * ksj;
        float *dkj = dkb + j * D, *dvj = dvb + j * D;
        for (int64_t d = 0; d < n8; d++) {
            dq[d] += dsj * ld(kj + 8 * d);
            st(dkj + 8 * d, ld(dkj + 8 * d) + dsj * ld(qi + 8 * d));
            st(dvj + 8 * d, ld(dvj + 8 * d) + pj * gv[d]);
        }
        for (int64_t d = D8; d < D; d++) {
            dqt[d - D8] += ds[j] * kj[d];
            dkj[d] += ds[j] * qi[d];
            dvj[d] += p[j] * goi[d];
        }
    }
    for (int64_t d = 0; d < n8; d++) st(dqi + 8 * d, dq[d]);
    for (int64_t d = D8; d < D; d++) dqi[d] = dqt[d - D8];
}

/* Gradients of rlhfkit_attend: dq [B, H, Tq, D], dk and dv [B, Hkv, Tk, D] contiguous (dk and
 * dv zeroed by the caller), from q, k, v, bias, out, its gradient gout (strides as out) and lse. */
int rlhfkit_attend_backward(const float *q, const float *k, const float *v, const float *bias, const float *out,
                            const float *gout, const float *lse, float *dq, float *dk, float *dv,
                            int64_t B, int64_t H, int64_t Hkv, int64_t Tq, int64_t Tk, int64_t D, float scale,
                            int64_t qb, int64_t qh, int64_t qi, int64_t kb, int64_t kh, int64_t kj,
                            int64_t vb, int64_t vh, int64_t vj, int64_t bb, int64_t bi, int64_t bj,
                            int64_t ob, int64_t oh, int64_t oi)
{
    if (D > 8 * MAX_D8 || Tk < 1 || Tk > MAX_KEYS || H % Hkv) return 1;
    float p[(Tk + 7) / 8 * 8], ds[(Tk + 7) / 8 * 8];
    const int64_t g = H / Hkv;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const float *kp = k + b * kb + (h / g) * kh, *vp = v + b * vb + (h / g) * vh;
            float *dkp = dk + (b * Hkv + h / g) * Tk * D, *dvp = dv + (b * Hkv + h / g) * Tk * D;
            for (int64_t i = 0; i < Tq; i++) {
                const float *qp = q + b * qb + h * qh + i * qi, *bp = bias + b * bb + i * bi;
                const float *op = out + b * ob + h * oh + i * oi, *gp = gout + b * ob + h * oh + i * oi;
                const float l = lse[(b * H + h) * Tq + i];
                float *dqp = dq + ((b * H + h) * Tq + i) * D;
                switch (D) {
                case 16: row_backward(qp, kp, vp, bp, op, gp, l, dqp, dkp, dvp, Tk, 16, scale, kj, vj, bj, p, ds); break;
                case 32: row_backward(qp, kp, vp, bp, op, gp, l, dqp, dkp, dvp, Tk, 32, scale, kj, vj, bj, p, ds); break;
                case 64: row_backward(qp, kp, vp, bp, op, gp, l, dqp, dkp, dvp, Tk, 64, scale, kj, vj, bj, p, ds); break;
                case 128: row_backward(qp, kp, vp, bp, op, gp, l, dqp, dkp, dvp, Tk, 128, scale, kj, vj, bj, p, ds); break;
                default: row_backward(qp, kp, vp, bp, op, gp, l, dqp, dkp, dvp, Tk, D, scale, kj, vj, bj, p, ds);
                }
            }
        }
    return 0;
}

/* One decode step over a cache laid out as rlhfkit.accel.forward.KVCache, all contiguous: qkv [B, 3, H, D]
 * (this step's query, key and value, as GPT-2's c_attn writes them), kv [B, 2, H, T_max, D],
 * bias [B, T_max], out [B, H, D]. Writes the step's key and value into cache column t, then
 * attends over columns 0 .. t: the copy and the attention in one call. */
int rlhfkit_decode_attend(const float *qkv, float *kv, const float *bias, float *out,
                          int64_t B, int64_t H, int64_t D, int64_t T_max, int64_t t, float scale)
{
    if (D > 8 * MAX_D8 || t < 0 || t >= T_max || t >= MAX_KEYS) return 1;
    float s[(t + 1 + 7) / 8 * 8];
    const int64_t HD = H * D, TD = T_max * D;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const float *qp = qkv + b * 3 * HD + h * D;
            float *kp = kv + b * 2 * H * TD + h * TD, *vp = kp + H * TD;
            memcpy(kp + t * D, qp + HD, D * sizeof(float));
            memcpy(vp + t * D, qp + 2 * HD, D * sizeof(float));
            const float *bp = bias + b * T_max;
            float *op = out + b * HD + h * D;
            switch (D) {
            case 16: row(qp, kp, vp, bp, op, t + 1, 16, scale, D, D, 1, s, NULL); break;
            case 32: row(qp, kp, vp, bp, op, t + 1, 32, scale, D, D, 1, s, NULL); break;
            case 64: row(qp, kp, vp, bp, op, t + 1, 64, scale, D, D, 1, s, NULL); break;
            case 128: row(qp, kp, vp, bp, op, t + 1, 128, scale, D, D, 1, s, NULL); break;
            default: row(qp, kp, vp, bp, op, t + 1, D, scale, D, D, 1, s, NULL);
            }
        }
    return 0;
}

/* ------------------------------------------------------------------------------ blocked attention
 *
 * The element-wise steps of rlhfkit.accel.kernels.block_attention, which computes attention for a
 * block of m queries of G heads (rows head-major: row r is head r / m, query r % m) as two
 * matrix products on oneDNN with these in between. s [rows, n] holds q . k over the block's
 * first n keys; mask (bytes, nonzero = may attend) holds query i's row at mask + i * ms, every
 * query allowed at least one key. */

static inline i8 allowed8(const uint8_t *p) { /* 8 mask bytes as lanes of -1 (allowed) or 0 */
    i8 r;
    for (int k = 0; k < 8; k++) r[k] = p[k];
    return r != 0;
}

/* forward (lse_in == 0): s becomes softmax(scale * s) over the allowed keys (0 elsewhere) and
 * lse[r] its log-sum-exp; the backward's recompute (lse_in == 1): s becomes
 * exp(scale * s - lse[r]) where allowed, 0 elsewhere */
void rlhfkit_block_softmax(float *s, const uint8_t *mask, float *lse, int64_t G, int64_t m, int64_t n, int64_t ms,
                           float scale, int lse_in)
{
    const v8 ninf = splat(-INFINITY), sc = splat(scale);
    for (int64_t r = 0; r < G * m; r++) {
        float *x = s + r * n;
        const uint8_t *mk = mask + (r % m) * ms;
        int64_t j = 0;
        if (lse_in) {
            const v8 l = splat(lse[r]);
            for (; j + 8 <= n; j += 8) st(x + j, sel(allowed8(mk + j), exp8(ld(x + j) * sc - l), splat(0.f)));
            for (; j < n; j++) x[j] = mk[j] ? expf(x[j] * scale - lse[r]) : 0.f;
            continue;
        }
        v8 m8 = ninf;
        for (; j + 8 <= n; j += 8) {
            const v8 v = sel(allowed8(mk + j), ld(x + j) * sc, ninf);
            st(x + j, v);
            m8 = sel(v > m8, v, m8);
        }
        float top = hmax(m8);
        for (; j < n; j++) {
            x[j] = mk[j] ? x[j] * scale : -INFINITY;
            top = x[j] > top ? x[j] : top;
        }
        const v8 t8 = splat(top);
        v8 sum8 = splat(0.f);
        for (j = 0; j + 8 <= n; j += 8) {
            const v8 e = exp8(ld(x + j) - t8);
            st(x + j, e);
            sum8 += e;
        }
        float total = hsum(sum8);
        for (; j < n; j++) {
            x[j] = expf(x[j] - top);
            total += x[j];
        }
        const float inv = 1.f / total;
        const v8 i8v = splat(inv);
        for (j = 0; j + 8 <= n; j += 8) st(x + j, ld(x + j) * i8v);
        for (; j < n; j++) x[j] *= inv;
        lse[r] = top + logf(total);
    }
}

/* the backward through the softmax: dp [rows, n] (dO . v_j) becomes the scores' gradient
 * scale * p * (dp - delta[r]), delta[r] = dO . O of the row; p 0 at masked keys */
void rlhfkit_block_softmax_backward(float *dp, const float *p, const float *delta, int64_t rows, int64_t n, float scale)
{
    const v8 sc = splat(scale);
    for (int64_t r = 0; r < rows; r++) {
        float *x = dp + r * n;
        const float *pr = p + r * n;
        const v8 d = splat(delta[r]);
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) st(x + j, ld(pr + j) * (ld(x + j) - d) * sc);
        for (; j < n; j++) x[j] = pr[j] * (x[j] - delta[r]) * scale;
    }
}

/* ------------------------------------------------------------------------------ GELU
 *
 * gelu_tanh(x) = x (1 + tanh z) / 2 = x sigmoid(2z),  2z = c1 x + c3 x^3,  c1 = 2 sqrt(2 / pi),
 * c3 = 0.044715 c1: out = x * gate and, when gate is not NULL, the gate sigmoid(2z) too (the
 * backward pass needs it). out may be x itself. */
void rlhfkit_gelu_tanh(const float *x, float *out, float *gate, int64_t n)
{
    const float c1 = 1.5957691216057308f, c3 = 0.044715f * 1.5957691216057308f;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 xv = ld(x + i);
        const v8 y = xv * (splat(c1) + splat(c3) * xv * xv);  /* 2z */
        const v8 e = exp8_range(vmin(splat(87.f), vmax(splat(-87.f), -y)));  /* exp(-2z), clamped */
        const v8 g = splat(1.f) / (splat(1.f) + e);                   /* ~6e-39 when 2z < -87: then 0 */
        const v8 gz = sel(y < splat(-87.f), splat(0.f), g);
        if (gate) st(gate + i, gz);
        st(out + i, xv * gz);
    }
    for (; i < n; i++) {
        const float xv = x[i], y = xv * (c1 + c3 * xv * xv);
        const float g = y < -87.f ? 0.f : 1.f / (1.f + expf(-y));
        if (gate) gate[i] = g;
        out[i] = xv * g;
    }
}

/* d gelu_tanh / dx times grad, from x and the gate s = sigmoid(2z) saved by the forward:
 * out = grad * (s + s (1 - s) * x (c1 + 3 c3 x^2)). out may be grad itself. */
void rlhfkit_gelu_tanh_backward(const float *x, const float *gate, const float *grad, float *out, int64_t n)
{
    const float c1 = 1.5957691216057308f, c3x3 = 3.f * 0.044715f * 1.5957691216057308f;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 xv = ld(x + i), s = ld(gate + i);
        const v8 xdz = (splat(c1) + splat(c3x3) * xv * xv) * xv;
        st(out + i, ((s - s * s) * xdz + s) * ld(grad + i));
    }
    for (; i < n; i++) {
        const float xv = x[i], s = gate[i], xdz = (c1 + c3x3 * xv * xv) * xv;
        out[i] = ((s - s * s) * xdz + s) * grad[i];
    }
}

/* ------------------------------------------------------------------------------ SwiGLU
 *
 * A Llama MLP's gate: act = silu(g) u = g s u with s = sigmoid(g) = 1 / (1 + exp(-g)), exp(-g)
 * clamped at exp(87) (then s ~ 1.6e-38 and silu(g) ~ 0, as in float32 arithmetic). */
static inline v8 sigmoid8(v8 g)
{
    const v8 neg = -g;
    return splat(1.f) / (splat(1.f) + exp8(sel(neg > splat(87.f), splat(87.f), neg)));
}

static inline float sigmoid1(float g) { return 1.f / (1.f + expf(-g > 87.f ? 87.f : -g)); }

void rlhfkit_swiglu(const float *g, const float *u, float *act, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 gv = ld(g + i);
        st(act + i, gv * sigmoid8(gv) * ld(u + i));
    }
    for (; i < n; i++) act[i] = g[i] * sigmoid1(g[i]) * u[i];
}

/* The backward of rlhfkit_swiglu from the output's gradient d: du = d g s and
 * dg = d u (s + g s (1 - s)) (d silu / dg); with act not NULL, act = g s u again (the down
 * projection's weight gradient needs it, and the forward did not keep it). */
void rlhfkit_swiglu_backward(const float *g, const float *u, const float *d, float *act, float *dg, float *du,
                             int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 gv = ld(g + i), uv = ld(u + i), dv = ld(d + i), s = sigmoid8(gv), gs = gv * s;
        if (act) st(act + i, gs * uv);
        st(du + i, dv * gs);
        st(dg + i, dv * uv * (s + gs * (splat(1.f) - s)));
    }
    for (; i < n; i++) {
        const float s = sigmoid1(g[i]), gs = g[i] * s;
        if (act) act[i] = gs * u[i];
        du[i] = d[i] * gs;
        dg[i] = d[i] * u[i] * (s + gs * (1.f - s));
    }
}

/* ------------------------------------------------------------------------------ sampling
 *
 * One step of rlhfkit.rollout.generate for B rows of V logits, as the PyTorch path computes it:
 * y = logits / temperature, log p = log_softmax(y), token = the first index whose cumulative
 * probability (summed in double, as torch.cumsum on a CPU, stored in float) reaches
 * (1 - u) * total (inverse-CDF sampling with the row's uniform u; never a zero-probability
 * token). Writes the token, its log-prob and the entropy -sum p log p (ruled-out tokens add 0),
 * clears alive[b] when the token is eos, and returns how many rows are still alive. Logit rows
 * have stride ls, the outputs strides ts (tokens) and os (log-probs, entropies). */
static inline v8 ld_tail(const float *p, int64_t n) { /* n < 8 floats, -inf after them */
    v8 x = splat(-INFINITY);
    for (int64_t i = 0; i < n; i++) x[i] = p[i];
    return x;
}

int64_t rlhfkit_sample(const float *logits, int64_t B, int64_t V, int64_t ls, float temperature,
                       const float *u, int64_t us, int64_t eos, int64_t *tok, int64_t ts,
                       float *logp, float *ent, int64_t os, uint8_t *alive, float *work)
{
    int64_t n_alive = 0;
    const int64_t V8 = V / 8 * 8;
    float *y = work, *cdf = work + V; /* 2 V floats from the caller */
    for (int64_t b = 0; b < B; b++) {
        const float *x = logits + b * ls;
        v8 m8 = splat(-INFINITY);
        int64_t j = 0;
        for (; j < V8; j += 8) {
            v8 v = ld(x + j) / splat(temperature);
            st(y + j, v);
            m8 = sel(v > m8, v, m8);
        }
        for (; j < V; j++) y[j] = x[j] / temperature;
        float m = hmax(m8);
        for (j = V8; j < V; j++) m = y[j] > m ? y[j] : m;
        const v8 mv = splat(m);
        v8 s8 = splat(0.f);
        for (j = 0; j < V8; j += 8) s8 += exp8(ld(y + j) - mv);
        if (V8 < V) s8 += exp8(ld_tail(y + V8, V - V8) - mv);
        const float lse = m + logf(hsum(s8));
        /* log-probs in place, probabilities, entropy */
        v8 h8 = splat(0.f);
        for (j = 0; j < V8; j += 8) {
            const v8 lp = ld(y + j) - splat(lse);
            const v8 p = exp8(lp);
            st(y + j, lp);
            st(cdf + j, p);
            h8 -= sel(p > splat(0.f), p * lp, splat(0.f));
        }
        if (V8 < V) {
            const v8 lp = ld_tail(y + V8, V - V8) - splat(lse);
            const v8 p = exp8(lp);
            h8 -= sel(p > splat(0.f), p * lp, splat(0.f));
            for (int64_t i = 0; i < V - V8; i++) {
                y[V8 + i] = lp[i];
                cdf[V8 + i] = p[i];
            }
        }
        double run = 0.0;
        for (j = 0; j < V; j++) {
            run += cdf[j];
            cdf[j] = (float)run;
        }
        const float point = (1.0f - u[b * us]) * cdf[V - 1];
        int64_t lo = 0, hi = V; /* first index with cdf >= point (torch.searchsorted, left) */
        while (lo < hi) {
            const int64_t mid = (lo + hi) / 2;
            if (cdf[mid] < point) lo = mid + 1;
            else hi = mid;
        }
        const int64_t t = lo < V ? lo : V - 1;
        tok[b * ts] = t;
        logp[b * os] = y[t];
        ent[b * os] = hsum(h8);
        if (t == eos) alive[b] = 0;
        n_alive += alive[b] != 0;
    }
    return n_alive;
}

/* --------------------------------------------------------------- bfloat16 log-prob head
 *
 * An LM head's bfloat16 logits z [n, V] (row stride zs) read as they are: each lane widened
 * to float32 exactly (a bfloat16 is the top half of a float32), so no float32 copy of the
 * chunk, no separate max, shift, exp and sum passes. rlhfkit_head_lse_bf16 gives each row's
 * logsumexp and its target's logit; rlhfkit_head_grad_bf16 the gradient wrt the logits of
 * sum_r c_r logp_r(t_r), c_r (onehot - softmax), rounded to bfloat16 once (to nearest even),
 * as the float32 expression converted after. A row whose max is infinite is shifted by 0, as
 * torch.logsumexp does. */

typedef uint16_t bf8 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u8 __attribute__((vector_size(32)));

static inline v8 ld_bf16(const uint16_t *p) {
    const u8 w = __builtin_convertvector(*(const bf8 *)p, u8) << 16;
    v8 x;
    memcpy(&x, &w, 32);
    return x;
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    float x;
    memcpy(&x, &w, 4);
    return x;
}

static inline uint16_t f32_to_bf16(float x) { /* round to nearest even; a NaN stays a (quiet) NaN */
    uint32_t w;
    memcpy(&w, &x, 4);
    if ((w & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((w >> 16) | 0x40u);
    return (uint16_t)((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
}

static inline void st_bf16(uint16_t *p, v8 x) {
    u8 w;
    memcpy(&w, &x, 32);
    const u8 nan = (w & 0x7fffffffu) > 0x7f800000u; /* all ones where x is NaN */
    const u8 r = (w + 0x7fffu + ((w >> 16) & 1u)) >> 16;
    const u8 q = (w >> 16) | 0x40u;
    *(bf8 *)p = __builtin_convertvector((nan & q) | (~nan & r), bf8);
}

static inline float row_max_bf16(const uint16_t *x, int64_t V) {
    const int64_t V8 = V / 8 * 8;
    v8 m8 = splat(-INFINITY);
    int64_t j = 0;
    for (; j < V8; j += 8) m8 = vmax(ld_bf16(x + j), m8);
    float m = hmax(m8);
    for (; j < V; j++) {
        const float v = bf16_to_f32(x[j]);
        m = v > m ? v : m;
    }
    return m;
}

void rlhfkit_head_lse_bf16(const uint16_t *z, int64_t n, int64_t V, int64_t zs, const int64_t *targets,
                           float *lse, float *picked)
{
    const int64_t V8 = V / 8 * 8;
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *x = z + r * zs;
        picked[r] = bf16_to_f32(x[targets[r]]);
        const float m = row_max_bf16(x, V);
        if (isinf(m)) { /* shifted by 0: -inf for a row of -inf, +inf with a +inf logit */
            float s = 0.f;
            for (int64_t j = 0; j < V; j++) s += expf(bf16_to_f32(x[j]));
            lse[r] = logf(s);
            continue;
        }
        const v8 mv = splat(m);
        v8 s8 = splat(0.f);
        int64_t j = 0;
        for (; j < V8; j += 8) s8 += exp8(ld_bf16(x + j) - mv);
        float s = hsum(s8);
        for (; j < V; j++) s += expf(bf16_to_f32(x[j]) - m);
        lse[r] = logf(s) + m;
    }
}

void rlhfkit_head_grad_bf16(const uint16_t *z, int64_t n, int64_t V, int64_t zs, const float *lse,
                            const float *c, const int64_t *targets, uint16_t *g, int64_t gs)
{
    const int64_t V8 = V / 8 * 8;
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *x = z + r * zs;
        uint16_t *y = g + r * gs;
        const v8 lv = splat(lse[r]), cv = splat(-c[r]);
        int64_t j = 0;
        for (; j < V8; j += 8) st_bf16(y + j, cv * exp8(ld_bf16(x + j) - lv));
        for (; j < V; j++) y[j] = f32_to_bf16(-c[r] * expf(bf16_to_f32(x[j]) - lse[r]));
        const int64_t t = targets[r];
        y[t] = f32_to_bf16(-c[r] * expf(bf16_to_f32(x[t]) - lse[r]) + c[r]);
    }
}

/* ------------------------------------------------------------------------------ bfloat16 decode attention
 *
 * One decode step's attention for a bfloat16 model (one query a head) with AVX-512 BF16's
 * dot-product instruction, which multiplies pairs of bfloat16 exactly and accumulates them in
 * float32: for each row and key head, the G heads that read it take each block of 16 keys in
 * turn, so the keys and values are read from memory once (PyTorch's attention read SmolLM2's
 * cache at about 6-7 GB/s of the 13 GB/s one core of an Intel Xeon streams). Three passes a
 * row and key head (decode_group_bf16):
 *
 *   scores   s_hj = scale * q_h . k_j + bias_j           (float32; bias 0 or -inf), and max_j
 *   softmax  p_hj = exp(s_hj - max), l_h = sum_j p_hj
 *   values   acc_h = sum_j p_hj v_j                      (p rounded to bfloat16 for the product,
 *                                                         as PyTorch's reduced-precision attention does)
 *   out_h  = acc_h / l_h                                 (rounded to bfloat16 once)
 *
 * An online softmax (one pass, rescaling as it goes) measured slower: its reductions a block
 * form a chain the core waits on. Software prefetching keeps more reads in flight than the
 * hardware's prefetchers do; without it the kernel was no faster than PyTorch's from memory.
 *
 * head_dim a multiple of 32, at most 256; at most 8 heads a key head. q, k, v, bias and out are
 * bfloat16; strides in elements: q and out (b, h), k and v (b, h_kv, j), bias (b, j). With src
 * (not NULL), row b reads its first P keys and values from row src[b]: rows that share a prompt
 * (a group's samples) read one copy of it, which stays in cache across them, so the prompt
 * leaves memory once a group instead of once a row. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define BF16_ATTR __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define DEC_MAX_G 8
#define DEC_MAX_C 8 /* head_dim / 32 */
#ifndef PF_KEYS
#define PF_KEYS 32
#endif

/* 16 vectors -> one vector of their 16 sums (a transposing reduction: 45 operations) */
BF16_ATTR static inline __m512 sum16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) /* each 128-bit lane: two partial sums of a[2i] and of a[2i+1] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* each 128-bit lane: one partial sum of a[4i] .. a[4i+3] */
        c[i] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]))));
    for (int i = 0; i < 2; i++) /* lanes: (a[8i..8i+3]: half of the sums, the other half, a[8i+4..]: ...) */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

BF16_ATTR static inline __m512 exp16(__m512 x) { /* exp8 on each half */
    v8 lo, hi;
    __m256 l = _mm512_castps512_ps256(x), h = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
    memcpy(&lo, &l, 32);
    memcpy(&hi, &h, 32);
    lo = exp8(lo), hi = exp8(hi);
    memcpy(&l, &lo, 32);
    memcpy(&h, &hi, 32);
    return _mm512_insertf32x8(_mm512_castps256_ps512(l), h, 1);
}

BF16_ATTR static inline __m512 ld16_bf16(const uint16_t *p, __mmask16 m) { /* 16 bfloat16 (lanes off m: 0) */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* Three passes over one row's key head, none with a chain of dependent reductions a block: the
 * scores of every key (and their running maximum as a vector), then the exponentials and their
 * sum, then the values. Keys and values before column P are read at kp and vp (another row's
 * copy of the same prompt, still in cache), the rest at kb and vb. s: G x Tp floats, pw: G x
 * Tp / 2 words (Tp = Tk rounded up to 16). */
BF16_ATTR static void decode_group_bf16(const uint16_t *q0, int64_t qh, int G, const uint16_t *kb,
                                        const uint16_t *vb, const uint16_t *kp, const uint16_t *vp, int64_t P,
                                        const uint16_t *bi, uint16_t *o0, int64_t oh, int64_t Tk, int C,
                                        float scale, int64_t ksj, int64_t vsj, int64_t bsj, float *s, uint32_t *pw)
{
    static const uint16_t zero[32 * DEC_MAX_C]; /* the rows past the last key */
    const int64_t Tp = (Tk + 15) / 16 * 16;
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    __m512 mx[DEC_MAX_G];
    for (int h = 0; h < G; h++) mx[h] = ninf;
    for (int64_t j0 = 0; j0 < Tk; j0 += 16) {
        const int n = Tk - j0 < 16 ? (int)(Tk - j0) : 16;
        const __mmask16 live = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
        const uint16_t *key[16];
        for (int jj = 0; jj < 16; jj++) key[jj] = jj < n ? (j0 + jj < P ? kp : kb) + (j0 + jj) * ksj : zero;
        /* keys PF_KEYS ahead into L1 and this block's values into L2 for the third pass: more
         * reads in flight than the hardware's prefetchers keep (7.5 GB/s without, of about 13) */
        for (int jj = 0; jj < n; jj++) {
            const int64_t j = j0 + jj;
            if (j + PF_KEYS < Tk)
                for (int c = 0; c < C; c++)
                    _mm_prefetch((const char *)((j + PF_KEYS < P ? kp : kb) + (j + PF_KEYS) * ksj + 32 * c), _MM_HINT_T0);
            for (int c = 0; c < C; c++) _mm_prefetch((const char *)((j < P ? vp : vb) + j * vsj + 32 * c), _MM_HINT_T1);
        }
        __m512 bias;
        if (bsj == 1) {
            bias = ld16_bf16(bi + j0, live);
        } else {
            float tmp[16];
            for (int jj = 0; jj < 16; jj++) tmp[jj] = jj < n ? bf16_to_f32(bi[(j0 + jj) * bsj]) : 0.f;
            bias = _mm512_loadu_ps(tmp);
        }
        bias = _mm512_mask_blend_ps(live, ninf, bias); /* keys past the end: -inf */
        const __mmask16 dead = _mm512_cmp_ps_mask(bias, ninf, _CMP_EQ_OQ);
        for (int h = 0; h < G; h++) {
            const uint16_t *qp = q0 + h * qh;
            __m512 dots[16];
            for (int jj = 0; jj < 16; jj++) {
                __m512 a = _mm512_setzero_ps();
                for (int c = 0; c < C; c++)
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(key[jj] + 32 * c),
                                         (__m512bh)_mm512_loadu_si512(qp + 32 * c));
                dots[jj] = a;
            }
            __m512 sc = _mm512_add_ps(_mm512_mul_ps(sum16(dots), vscale), bias);
            sc = _mm512_mask_blend_ps(dead, sc, ninf); /* -inf exactly where the bias is */
            _mm512_storeu_ps(s + h * Tp + j0, sc);
            mx[h] = _mm512_max_ps(mx[h], sc);
        }
    }
    float inv[DEC_MAX_G];
    for (int h = 0; h < G; h++) {
        float m = _mm512_reduce_max_ps(mx[h]);
        if (m == -INFINITY) m = 0.f; /* every key masked: all p 0, the output 0 */
        const __m512 mv = _mm512_set1_ps(m);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j0 = 0; j0 < Tk; j0 += 16) {
            const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + h * Tp + j0), mv));
            sum = _mm512_add_ps(sum, p);
            _mm256_storeu_si256((__m256i *)(pw + (h * Tp + j0) / 2), (__m256i)_mm512_cvtneps_pbh(p));
        }
        const float l = _mm512_reduce_add_ps(sum);
        inv[h] = l > 0.f ? 1.f / l : 0.f;
    }
    __m512 acc[DEC_MAX_G][2 * DEC_MAX_C]; /* head h, d-block c: [2c] d = 32c + 8L + r, [2c+1] d = 32c + 8L + 4 + r */
    for (int h = 0; h < G; h++)
        for (int c = 0; c < 2 * C; c++) acc[h][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < Tk; j += 2) { /* keys j, j+1: their values interleaved word by word */
        const uint16_t *va = (j < P ? vp : vb) + j * vsj, *vb1 = j + 1 < Tk ? (j + 1 < P ? vp : vb) + (j + 1) * vsj : zero;
        for (int c = 0; c < C; c++) {
            const __m512i a = _mm512_loadu_si512(va + 32 * c), b = _mm512_loadu_si512(vb1 + 32 * c);
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int h = 0; h < G; h++) {
                const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pw[(h * Tp + j) / 2]);
                acc[h][2 * c] = _mm512_dpbf16_ps(acc[h][2 * c], lo, pp);
                acc[h][2 * c + 1] = _mm512_dpbf16_ps(acc[h][2 * c + 1], hi, pp);
            }
        }
    }
    for (int h = 0; h < G; h++) {
        float tmp[2 * DEC_MAX_C][16];
        const __m512 iv = _mm512_set1_ps(inv[h]);
        for (int c = 0; c < 2 * C; c++) _mm512_storeu_ps(tmp[c], _mm512_mul_ps(acc[h][c], iv));
        uint16_t *o = o0 + h * oh;
        for (int c = 0; c < C; c++)
            for (int L = 0; L < 4; L++)
                for (int r = 0; r < 4; r++) {
                    o[32 * c + 8 * L + r] = f32_to_bf16(tmp[2 * c][4 * L + r]);
                    o[32 * c + 8 * L + 4 + r] = f32_to_bf16(tmp[2 * c + 1][4 * L + r]);
                }
    }
}

/* Returns 0; 1 for shapes the kernel does not take; 2 on a CPU without AVX-512 BF16; 3 for a
 * shared row outside 0 .. B-1. */
int rlhfkit_decode_attend_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *bias,
                               uint16_t *out, const int64_t *src, int64_t P, int64_t B, int64_t H, int64_t Hkv,
                               int64_t Tk, int64_t D, float scale, int64_t qb, int64_t qh, int64_t kb, int64_t kh,
                               int64_t kj, int64_t vb, int64_t vh, int64_t vj, int64_t bb, int64_t bj, int64_t ob,
                               int64_t oh)
{
    if (D % 32 || D > 32 * DEC_MAX_C || Tk < 1 || Hkv < 1 || H % Hkv || H / Hkv > DEC_MAX_G) return 1;
    if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512bw")) return 2;
    if (src)
        for (int64_t b = 0; b < B; b++)
            if (src[b] < 0 || src[b] >= B) return 3;
    const int G = (int)(H / Hkv), C = (int)(D / 32);
    const int64_t Tp = (Tk + 15) / 16 * 16;
    float *s = malloc(G * Tp * (sizeof(float) + sizeof(uint16_t)));
    if (!s) return 1;
    uint32_t *pw = (uint32_t *)(s + G * Tp);
    for (int64_t b = 0; b < B; b++)
        for (int64_t hk = 0; hk < Hkv; hk++) {
            const int64_t r = src ? src[b] : b;
            decode_group_bf16(q + b * qb + hk * G * qh, qh, G, k + b * kb + hk * kh, v + b * vb + hk * vh,
                              k + r * kb + hk * kh, v + r * vb + hk * vh, src ? P : 0, bias + b * bb,
                              out + b * ob + hk * G * oh, oh, Tk, C, scale, kj, vj, bj, s, pw);
        }
    free(s);
    return 0;
}
#else
int rlhfkit_decode_attend_bf16(void) { return 2; }
#endif

/* ------------------------------------------------------------------------------ bfloat16 RMS norm
 *
 * y = w * x * rstd, rstd = 1 / sqrt(mean(x^2) + eps), for rows of C bfloat16 values and a
 * bfloat16 weight, computed in float32 and rounded once (as F.rms_norm's fused kernel), and
 * its backward in one pass a row after the dot product: with m = mean(g w x),
 * dx = rstd g w - x rstd^3 m, and dw += g x rstd (float32, when dw is not NULL). PyTorch's
 * backward of F.rms_norm in bfloat16 is about ten element-wise passes over the rows. */
static inline float bf16_row_dot(const uint16_t *a, const uint16_t *b, const uint16_t *c, int64_t C) {
    /* sum a*b*c, or sum a*a with b == c == NULL */
    const int64_t C8 = C / 8 * 8;
    v8 acc = splat(0.f);
    float t = 0.f;
    int64_t j = 0;
    if (!b) {
        for (; j < C8; j += 8) {
            const v8 x = ld_bf16(a + j);
            acc += x * x;
        }
        for (; j < C; j++) t += bf16_to_f32(a[j]) * bf16_to_f32(a[j]);
    } else {
        for (; j < C8; j += 8) acc += ld_bf16(a + j) * ld_bf16(b + j) * ld_bf16(c + j);
        for (; j < C; j++) t += bf16_to_f32(a[j]) * bf16_to_f32(b[j]) * bf16_to_f32(c[j]);
    }
    return hsum(acc) + t;
}

void rlhfkit_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, float *rstd, int64_t N, int64_t C,
                           float eps)
{
    const int64_t C8 = C / 8 * 8;
    for (int64_t r = 0; r < N; r++) {
        const uint16_t *xr = x + r * C;
        uint16_t *yr = y + r * C;
        const float rs = 1.f / sqrtf(bf16_row_dot(xr, NULL, NULL, C) / (float)C + eps);
        rstd[r] = rs;
        const v8 rv = splat(rs);
        int64_t j = 0;
        for (; j < C8; j += 8) st_bf16(yr + j, ld_bf16(xr + j) * rv * ld_bf16(w + j));
        for (; j < C; j++) yr[j] = f32_to_bf16(bf16_to_f32(xr[j]) * rs * bf16_to_f32(w[j]));
    }
}

void rlhfkit_rms_norm_backward_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *g, const float *rstd,
                                    uint16_t *dx, float *dw, int64_t N, int64_t C)
{
    const int64_t C8 = C / 8 * 8;
    for (int64_t r = 0; r < N; r++) {
        const uint16_t *xr = x + r * C, *gr = g + r * C;
        uint16_t *dr = dx + r * C;
        const float rs = rstd[r], k = rs * rs * rs * bf16_row_dot(gr, w, xr, C) / (float)C;
        const v8 rv = splat(rs), kv = splat(k);
        int64_t j = 0;
        for (; j < C8; j += 8) {
            const v8 xv = ld_bf16(xr + j), gv = ld_bf16(gr + j);
            st_bf16(dr + j, rv * gv * ld_bf16(w + j) - xv * kv);
            if (dw) st(dw + j, ld(dw + j) + gv * xv * rv);
        }
        for (; j < C; j++) {
            const float xv = bf16_to_f32(xr[j]), gv = bf16_to_f32(gr[j]);
            dr[j] = f32_to_bf16(rs * gv * bf16_to_f32(w[j]) - xv * k);
            if (dw) dw[j] += gv * xv * rs;
        }
    }
}
