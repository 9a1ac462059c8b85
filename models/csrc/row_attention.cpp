// Attention for a few query rows over a static KV cache, each row computed on its own in one fixed
// order (models/attention.py says why). fp32 arithmetic; GCC vector types, so the same source runs
// on AVX-512 and AVX2 machines (each build's arithmetic fixed at compile time).
//
// q (H, R, D): H KV heads, R = r * N query rows each (GQA folded: row i reads mask row i % N);
// kt (H, C/16, D, 16): the cached keys in blocks of 16 rows, each block transposed (kt[h][b][d][l]
// is element d of key 16b + l), so element d of 16 neighbouring keys is one vector and a block's
// 4 KB (D 64) lie together; v (H, C, D) fp32 or bf16, widened exactly to fp32 as read (where the
// 4-bit kernels' outputs are V, they are bf16 values: half the bytes a token streams, the same
// bits); the first Lk keys and values are read. mask (N, Lk)
// additive: a column is seen where its entry is above -1e30 (0), blocked where it is a large
// negative number (finfo.min, -inf). out (H, R, D) = softmax(q k^T * scale + mask) v.
//
// Per row: s_j = q_0 k_j0 + q_1 k_j1 + ... in order of d (each step one fused multiply-add where
// the CPU has FMA), 16 columns at once, then * scale + mask_j; m = max s; p_j = exp(s_j - m);
// sum p adds the seen columns' p_j in order of j, the i-th seen one in lane i mod L (L lanes: 16
// on AVX-512, 8 on AVX2), then a fixed tree over the lanes; out = (sum of p_j v_j in order of j)
// / sum p. A blocked column gives p_j = 0 exactly and adds nothing to the second sum, so a row's
// value depends only on the sequence of columns it sees, not on where they sit: the same alone or
// in a tree of many rows (where a node's own column is L + its index, not L + its depth as when
// its token comes alone), whatever Lk's padding. Keys row by row instead cost a horizontal sum per
// row and column, ~30 cycles; keys wholly transposed, (H, D, C), made one token's call read 64
// strided streams, slower from memory than rows (30 layers' calls over distinct K/V, 2-core Zen 4,
// Lk 2752, one token: rows 6.1 ms, transposed 8.6, blocks 4.9; eight tokens 26.6, 16.8, 12.8).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include <ATen/core/Tensor.h>   // not ATen.h: every op's declaration costs each build seconds
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

#include "lanes.h"

constexpr int KB = 16;         // keys per block of kt: the columns a step of the scores computes
constexpr int V = KB / L;      // vectors of those
constexpr float SEEN = -1e30f; // a mask entry above this sees its column

inline float hsum(vf a) {  // lanes [0, L/2) + [L/2, L), then halves again: one fixed order
  float t[L];
  std::memcpy(t, &a, sizeof a);
  for (int w = L / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; l++) t[l] += t[l + w];
  return t[0];
}

inline vf splat(float x) { return vf{} + x; }

inline vf load_value(const float* p) { return load(p); }

// L bf16 values -> fp32 (exact: a bf16 is an fp32's upper half).
inline vf load_value(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#elif defined(__AVX2__)
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
#else
  vu w;
  for (int l = 0; l < L; l++) w[l] = uint32_t(p[l]) << 16;
  vf x;
  std::memcpy(&x, &w, sizeof x);
  return x;
#endif
}

// a * b + c rounded once where the CPU has FMA, else twice: spelled out, so every instantiation
// rounds the same way (the build forbids the compiler's own contraction, which could differ
// between a row computed alone and one beside others).
inline vf fma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && defined(__AVX__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}


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

// The sum of p over the seen columns (mask above SEEN), the i-th seen one in lane i mod L: columns
// [0, dense) are all seen (rank = index: plain vector adds), the rest are packed by rank into
// `packed` (Lk + L floats).
inline float sum_seen(const float* p, const float* mask, int64_t dense, int64_t lk, float* packed) {
  const int64_t aligned = dense / L * L;
  vf total{};
  for (int64_t j = 0; j < aligned; j += L) total += load(p + j);
  int64_t count = dense - aligned;
  std::memcpy(packed, p + aligned, count * sizeof(float));
  for (int64_t j = dense; j < lk; j++) {
    packed[count] = p[j];
    count += mask[j] > SEEN;
  }
  for (int64_t j = count; j % L; j++) packed[j] = 0.0f;
  for (int64_t j = 0; j < count; j += L) total += load(packed + j);
  return hsum(total);
}

// B <= 4 query rows of one head, sharing each key's and value's loads: q[b], out[b] (D,), D = C L;
// kt (Lk/16 blocks, D, 16), v (Lk, D); mask[b] (Lk,), its first dense[b] columns
// all seen; s[b] (Lk rounded up to 16) and packed (Lk + L) scratch. Each row's arithmetic is its own.
template <int D, int B, typename T>
void rows_of(const float* const* q, const float* kt, const T* v, const float* const* mask, const int64_t* dense,
             float* const* out, float* const* s, float* packed, int64_t lk, float scale) {
  constexpr int C = D / L;
  const int64_t blocks = (lk + KB - 1) / KB, padded = blocks * KB;
  float tail[B][KB];   // the last 16 columns' mask (those past Lk are set blocked below, whatever kt holds there)
  for (int b = 0; b < B; b++)
    for (int l = 0; l < KB; l++) {
      const int64_t j = padded - KB + l;
      tail[b][l] = j < lk ? mask[b][j] : 0.0f;
    }
  for (int64_t jb = 0; jb < blocks; jb++) {
    const float* block = kt + jb * D * KB;
    vf acc[B][V] = {};
    for (int d = 0; d < D; d++) {
      vf key[V];
      for (int u = 0; u < V; u++) key[u] = load(block + d * KB + u * L);
      for (int b = 0; b < B; b++) {
        const vf qd = splat(q[b][d]);
        for (int u = 0; u < V; u++) acc[b][u] = fma(qd, key[u], acc[b][u]);
      }
    }
    for (int b = 0; b < B; b++) {
      const float* m = jb + 1 < blocks ? mask[b] + jb * KB : tail[b];
      for (int u = 0; u < V; u++) store(s[b] + jb * KB + u * L, acc[b][u] * scale + load(m + u * L));
    }
  }
  for (int b = 0; b < B; b++)
    for (int64_t j = lk; j < padded; j++) s[b][j] = -3.0e38f;
  float sum[B];
  for (int b = 0; b < B; b++) {
    vf top = load(s[b]);
    for (int64_t j = L; j < padded; j += L) {
      const vf x = load(s[b] + j);
      top = x > top ? x : top;
    }
    float m = top[0];
    for (int l = 1; l < L; l++) m = top[l] > m ? top[l] : m;
    for (int64_t j = 0; j < padded; j += L) store(s[b] + j, exp_nonpositive(load(s[b] + j) - m));
    sum[b] = sum_seen(s[b], mask[b], dense[b], lk, packed);
  }
  // A blocked column's p is 0 and its cached v finite: adding 0 * v leaves a row's sum as it was.
  vf acc[B][C] = {};
  for (int64_t j = 0; j < lk; j++) {
    vf val[C];
    for (int c = 0; c < C; c++) val[c] = load_value(v + j * D + L * c);
    for (int b = 0; b < B; b++) {
      const vf p = splat(s[b][j]);
      for (int c = 0; c < C; c++) acc[b][c] = fma(p, val[c], acc[b][c]);
    }
  }
  for (int b = 0; b < B; b++)
    for (int c = 0; c < C; c++) store(out[b] + L * c, acc[b][c] / sum[b]);
}

template <int D, typename T>
void rows_for(int B, const float* const* q, const float* kt, const T* v, const float* const* mask,
              const int64_t* dense, float* const* out, float* const* s, float* packed, int64_t lk, float scale) {
  switch (B) {
    case 1: return rows_of<D, 1>(q, kt, v, mask, dense, out, s, packed, lk, scale);
    case 2: return rows_of<D, 2>(q, kt, v, mask, dense, out, s, packed, lk, scale);
    case 3: return rows_of<D, 3>(q, kt, v, mask, dense, out, s, packed, lk, scale);
    default: return rows_of<D, 4>(q, kt, v, mask, dense, out, s, packed, lk, scale);
  }
}

// One task's rows of one head: rows_for at the head size d (a multiple of 16 up to 128).
template <typename T>
void head_rows(int64_t d, int B, const float* const* q, const float* kt, const T* v, const float* const* mask,
               const int64_t* dense, float* const* out, float* const* s, float* packed, int64_t lk, float scale) {
  switch (d / 16) {
    case 1: return rows_for<16>(B, q, kt, v, mask, dense, out, s, packed, lk, scale);
    case 2: return rows_for<32>(B, q, kt, v, mask, dense, out, s, packed, lk, scale);
    case 3: return rows_for<48>(B, q, kt, v, mask, dense, out, s, packed, lk, scale);
    case 4: return rows_for<64>(B, q, kt, v, mask, dense, out, s, packed, lk, scale);
    case 5: return rows_for<80>(B, q, kt, v, mask, dense, out, s, packed, lk, scale);
    case 6: return rows_for<96>(B, q, kt, v, mask, dense, out, s, packed, lk, scale);
    case 7: return rows_for<112>(B, q, kt, v, mask, dense, out, s, packed, lk, scale);
    default: return rows_for<128>(B, q, kt, v, mask, dense, out, s, packed, lk, scale);
  }
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& kt, const at::Tensor& v, const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && kt.dim() == 4 && v.dim() == 3 && mask.dim() == 2,
              "q (H, rows, D), kt (H, C/16, D, 16), v (H, C, D), mask (N, Lk)");
  for (const at::Tensor* t : {&q, &kt, &mask})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "q, kt and mask must be contiguous fp32");
  const bool bf16 = v.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || v.scalar_type() == at::kFloat) && v.is_contiguous(), "v must be contiguous fp32 or bf16");
  const int64_t heads = q.size(0), rows = q.size(1), d = q.size(2), n = mask.size(0), lk = mask.size(1);
  TORCH_CHECK(d % 16 == 0 && d >= 16 && d <= 128, "the head size must be a multiple of 16 up to 128");
  const int64_t width = (lk + KB - 1) / KB * KB;
  TORCH_CHECK(kt.size(0) == heads && kt.size(2) == d && kt.size(3) == KB && v.size(0) == heads && v.size(2) == d
              && kt.size(1) * KB >= lk && v.size(1) >= lk, "kt must be (H, C/16, D, 16) and v (H, C, D), C >= Lk");
  TORCH_CHECK(rows % n == 0, "the rows must be whole groups of the mask's N");
  at::Tensor out = at::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kp = kt.data_ptr<float>(), *mp = mask.data_ptr<float>();
  const float* vf32 = bf16 ? nullptr : v.data_ptr<float>();
  const uint16_t* vb16 = bf16 ? reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()) : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t key_stride = kt.size(1) * d * KB, value_stride = v.size(1) * d;
  std::vector<int64_t> dense(n);   // each mask row's first blocked column (all before it are seen)
  for (int64_t i = 0; i < n; i++) {
    const float* m = mp + i * lk;
    int64_t j = 0;
    while (j < lk && m[j] > SEEN) j++;
    dense[i] = j;
  }
  // A task is up to 4 rows of one head, and a thread takes at least ~1024 columns of work, so one
  // token's few rows do not pay for starting a thread. (Smaller tasks, so that each thread gets
  // two, measured no faster with the keys in blocks and slower at long contexts: 30 layers' calls
  // over distinct K/V, one token at Lk 2752, 4.7 ms against 5.5.)
  const int64_t size = 4;
  const int64_t groups = (rows + size - 1) / size;
  const int64_t grain = std::max<int64_t>(1, 1024 / std::max<int64_t>(lk, 1));
  at::parallel_for(0, heads * groups, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> scratch(4 * width + lk + L);  // s of up to 4 rows, then packed
    float* packed = scratch.data() + 4 * width;
    for (int64_t t = lo; t < hi; t++) {
      const int64_t h = t / groups, r0 = (t % groups) * size;
      const int B = int(std::min<int64_t>(size, rows - r0));
      const float* qs[4];
      const float* ms[4];
      int64_t ds[4];
      float* os[4];
      float* ss[4];
      for (int b = 0; b < B; b++) {
        qs[b] = qp + (h * rows + r0 + b) * d;
        ms[b] = mp + ((r0 + b) % n) * lk;
        ds[b] = dense[(r0 + b) % n];
        os[b] = op + (h * rows + r0 + b) * d;
        ss[b] = scratch.data() + b * width;
      }
      const float* kh = kp + h * key_stride;
      if (bf16)
        head_rows(d, B, qs, kh, vb16 + h * value_stride, ms, ds, os, ss, packed, lk, float(scale));
      else
        head_rows(d, B, qs, kh, vf32 + h * value_stride, ms, ds, os, ss, packed, lk, float(scale));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(aerie_attn, lib) { lib.def("attend(Tensor q, Tensor kt, Tensor v, Tensor mask, float scale) -> Tensor"); }
TORCH_LIBRARY_IMPL(aerie_attn, CPU, lib) { lib.impl("attend", &attend); }
