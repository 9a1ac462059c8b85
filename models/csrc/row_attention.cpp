// Attention for a few query rows over a static KV cache, each row computed on its own in one fixed
// order (models/attention.py says why). fp32 throughout; GCC vector types, so the same source runs
// on AVX-512 and AVX2 machines (each build's arithmetic fixed at compile time).
//
// q (H, R, D): H KV heads, R = r * N query rows each (GQA folded: row i reads mask row i % N);
// k, v (H, C, D): the cache, of which the first Lk rows are read; mask (N, Lk) additive (0 sees,
// a large negative number blocks). out (H, R, D) = softmax(q k^T * scale + mask) v.
//
// Per row: s_j = hsum(q . k_j) * scale + mask_j, with lane l of the dot summing d = l, l+L, ...
// (L lanes: 16 on AVX-512, 8 on AVX2) and hsum a fixed tree; m = max s; p_j = exp(s_j - m); sum p
// adds the nonzero p_j in order of j, the i-th of them in lane i mod L, then the same tree; out =
// (sum of p_j v_j in order of j) / sum p. A blocked column gives p_j = 0 exactly and drops out of
// both sums, so a row's value depends only on the sequence of columns it sees, not on where they
// sit: the same alone or in a tree of many rows (where a node's own column is L + its index, not
// L + its depth as when its token comes alone), whatever Lk's padding.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

#include "lanes.h"

inline float hsum(vf a) {  // lanes [0, L/2) + [L/2, L), then halves again: one fixed order
  float t[L];
  std::memcpy(t, &a, sizeof a);
  for (int w = L / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; l++) t[l] += t[l + w];
  return t[0];
}

inline vf splat(float x) { return vf{} + x; }


// exp(x) for x <= 0 (scores minus their maximum): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p of degree 6
// (relative error ~2e-7); 0 below -87.3, where 2^n leaves fp32's normal range.
inline vf exp_nonpositive(vf x) {
  const vi live = x >= splat(-87.3f);
  x = x < splat(-87.3f) ? splat(-87.3f) : x;
  const vi n = __builtin_convertvector(x * 1.44269504f - 0.5f, vi);  // truncating t - 0.5 rounds t <= 0 to nearest
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = (x - nf * 0.693145752f) - nf * 1.42860677e-06f;
  vf p = splat(1.0f / 720);
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vi scale = (n + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &scale, sizeof two_n);
  const vf y = p * two_n;
  vi bits;
  std::memcpy(&bits, &y, sizeof bits);
  bits &= live;
  vf e;
  std::memcpy(&e, &bits, sizeof e);
  return e;
}

// The sum of p (n values; `packed` holds n rounded up to L) over its nonzero entries in order, the i-th in
// lane i mod L: lanes by a column's rank among the seen ones, not by its index.
inline float sum_seen(const float* p, int64_t n, float* packed) {
  int64_t count = 0;
  for (int64_t j = 0; j < n; j++) {
    packed[count] = p[j];
    count += p[j] != 0.0f;
  }
  for (int64_t j = count; j % L; j++) packed[j] = 0.0f;
  vf total{};
  for (int64_t j = 0; j < count; j += L) total += load(packed + j);
  return hsum(total);
}

// B <= 4 query rows of one head, sharing each k_j and v_j load: q[b], out[b] (D,), D = C L;
// k, v (Lk, D); mask[b] (Lk,); s[b] and packed scratch (Lk rounded up to 16). Each row's arithmetic is its own.
template <int D, int B>
void rows_of(const float* const* q, const float* k, const float* v, const float* const* mask, float* const* out,
             float* const* s, float* packed, int64_t lk, float scale) {
  constexpr int C = D / L;
  const int64_t padded = (lk + 15) / 16 * 16;
  vf qv[B][C];
  for (int b = 0; b < B; b++)
    for (int c = 0; c < C; c++) qv[b][c] = load(q[b] + L * c);
  for (int64_t j = 0; j < lk; j++) {
    vf key[C];
    for (int c = 0; c < C; c++) key[c] = load(k + j * D + L * c);
    for (int b = 0; b < B; b++) {
      vf acc = qv[b][0] * key[0];
      for (int c = 1; c < C; c++) acc += qv[b][c] * key[c];
      s[b][j] = hsum(acc) * scale + mask[b][j];
    }
  }
  float sum[B];
  for (int b = 0; b < B; b++) {
    for (int64_t j = lk; j < padded; j++) s[b][j] = -3.0e38f;
    vf top = load(s[b]);
    for (int64_t j = L; j < padded; j += L) {
      const vf x = load(s[b] + j);
      top = x > top ? x : top;
    }
    float m = top[0];
    for (int l = 1; l < L; l++) m = top[l] > m ? top[l] : m;
    for (int64_t j = 0; j < padded; j += L) store(s[b] + j, exp_nonpositive(load(s[b] + j) - m));
    sum[b] = sum_seen(s[b], lk, packed);
  }
  // A blocked column's p is 0 and its cached v finite: adding 0 * v leaves a row's sum as it was.
  vf acc[B][C] = {};
  for (int64_t j = 0; j < lk; j++) {
    vf val[C];
    for (int c = 0; c < C; c++) val[c] = load(v + j * D + L * c);
    for (int b = 0; b < B; b++) {
      const vf p = splat(s[b][j]);
      for (int c = 0; c < C; c++) acc[b][c] += p * val[c];
    }
  }
  for (int b = 0; b < B; b++)
    for (int c = 0; c < C; c++) store(out[b] + L * c, acc[b][c] / sum[b]);
}

template <int D>
void rows_for(int B, const float* const* q, const float* k, const float* v, const float* const* mask, float* const* out,
              float* const* s, float* packed, int64_t lk, float scale) {
  switch (B) {
    case 1: return rows_of<D, 1>(q, k, v, mask, out, s, packed, lk, scale);
    case 2: return rows_of<D, 2>(q, k, v, mask, out, s, packed, lk, scale);
    case 3: return rows_of<D, 3>(q, k, v, mask, out, s, packed, lk, scale);
    default: return rows_of<D, 4>(q, k, v, mask, out, s, packed, lk, scale);
  }
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && mask.dim() == 2, "q, k, v (H, rows, D), mask (N, Lk)");
  for (const at::Tensor* t : {&q, &k, &v, &mask})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "q, k, v and mask must be contiguous fp32");
  const int64_t heads = q.size(0), rows = q.size(1), d = q.size(2), n = mask.size(0), lk = mask.size(1);
  TORCH_CHECK(d % 16 == 0 && d >= 16 && d <= 128, "the head size must be a multiple of 16 up to 128");
  TORCH_CHECK(k.size(0) == heads && v.sizes() == k.sizes() && k.size(2) == d && k.size(1) >= lk, "k and v must be (H, C >= Lk, D)");
  TORCH_CHECK(rows % n == 0, "the rows must be whole groups of the mask's N");
  at::Tensor out = at::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(), *mp = mask.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t cache_rows = k.size(1), width = (lk + 15) / 16 * 16;
  // A task is up to 4 rows of one head, and a thread takes at least ~1024 columns of work, so one
  // token's few rows do not pay for starting a thread.
  const int64_t blocks = (rows + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, 1024 / std::max<int64_t>(lk, 1));
  at::parallel_for(0, heads * blocks, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> scratch(5 * width);  // s of up to 4 rows, then packed
    float* packed = scratch.data() + 4 * width;
    for (int64_t t = lo; t < hi; t++) {
      const int64_t h = t / blocks, r0 = (t % blocks) * 4;
      const int B = int(std::min<int64_t>(4, rows - r0));
      const float* qs[4];
      const float* ms[4];
      float* os[4];
      float* ss[4];
      for (int b = 0; b < B; b++) {
        qs[b] = qp + (h * rows + r0 + b) * d;
        ms[b] = mp + ((r0 + b) % n) * lk;
        os[b] = op + (h * rows + r0 + b) * d;
        ss[b] = scratch.data() + b * width;
      }
      const float *kh = kp + h * cache_rows * d, *vh = vp + h * cache_rows * d;
      switch (d / 16) {
        case 1: rows_for<16>(B, qs, kh, vh, ms, os, ss, packed, lk, float(scale)); break;
        case 2: rows_for<32>(B, qs, kh, vh, ms, os, ss, packed, lk, float(scale)); break;
        case 3: rows_for<48>(B, qs, kh, vh, ms, os, ss, packed, lk, float(scale)); break;
        case 4: rows_for<64>(B, qs, kh, vh, ms, os, ss, packed, lk, float(scale)); break;
        case 5: rows_for<80>(B, qs, kh, vh, ms, os, ss, packed, lk, float(scale)); break;
        case 6: rows_for<96>(B, qs, kh, vh, ms, os, ss, packed, lk, float(scale)); break;
        case 7: rows_for<112>(B, qs, kh, vh, ms, os, ss, packed, lk, float(scale)); break;
        default: rows_for<128>(B, qs, kh, vh, ms, os, ss, packed, lk, float(scale)); break;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(aerie_attn, lib) { lib.def("attend(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor"); }
TORCH_LIBRARY_IMPL(aerie_attn, CPU, lib) { lib.impl("attend", &attend); }
