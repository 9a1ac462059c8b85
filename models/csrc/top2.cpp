// Each row's best and second-best logit in one pass: what greedy acceptance reads of a verify's
// rows (core/spec/verify.py `best_two`). torch's topk(2) takes ~85 us for a row of 49,152 logits on
// a 2-core Zen 4 (its selection is scalar code) and ~10 ops around it turned its values into the
// argmax and the top-1 minus top-2 margin; this reads each logit once, a vector at a time.
//
// Per lane: the best value, the index where it first occurred, and the best of the rest (a value
// equal to the best counts as the rest's, so a duplicated maximum gives a margin of 0, as topk's
// values do). Across lanes: the best value, the lowest index holding it (torch.argmax's choice:
// the first maximal value), and the second best of all the other lanes' values. A NaN is greater
// than every number, as in torch.argmax: the first NaN is the argmax and the margin is NaN.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <ATen/core/Tensor.h>   // not ATen.h: every op's declaration costs each build seconds
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {

#include "lanes.h"

struct Best {
  float value, second;
  int64_t index;
};

inline vf larger(vf a, vf b) { return a > b ? a : b; }
inline vf smaller(vf a, vf b) { return a < b ? a : b; }

Best row_best(const float* x, int64_t v) {
  constexpr float LOW = -std::numeric_limits<float>::infinity();
  const int64_t whole = v / L * L;
  vi lane;
  for (int l = 0; l < L; l++) lane[l] = l;
  // Lanes start from the first vector (or hold nothing: index -1, where V < L).
  vf best = whole ? load(x) : vf{} + LOW, second = vf{} + LOW;
  vi index = whole ? lane : vi{} - 1, nan = best != best;
  for (int64_t j = L; j < whole; j += L) {
    const vf y = load(x + j);
    nan |= y != y;
    const vi above = y > best;
    second = larger(second, smaller(y, best));
    best = above ? y : best;
    index = above ? lane + int32_t(j) : index;
  }
  Best out{LOW, LOW, -1};
  int won = -1;
  for (int l = 0; l < L; l++)
    if (index[l] >= 0 && (out.index < 0 || best[l] > out.value || (best[l] == out.value && index[l] < out.index))) {
      out.value = best[l];
      out.index = index[l];
      won = l;
    }
  for (int l = 0; l < L; l++) {
    out.second = std::max(out.second, second[l]);
    if (l != won) out.second = std::max(out.second, best[l]);
  }
  for (int64_t j = whole; j < v; j++) {   // the tail, in order
    const float y = x[j];
    if (y != y) nan[0] = -1;
    if (y > out.value || out.index < 0) {
      out.second = std::max(out.second, out.value);
      out.value = y;
      out.index = j;
    } else {
      out.second = std::max(out.second, y);
    }
  }
  bool any_nan = false;
  for (int l = 0; l < L; l++) any_nan |= nan[l] != 0;
  if (any_nan) {
    for (int64_t j = 0; j < v; j++)
      if (std::isnan(x[j])) return Best{x[j], x[j], j};
  }
  return out;
}

// logits (N, V) fp32 -> (N, 2) float64: each row's argmax and its top-1 minus top-2 logit (the
// difference taken in fp32, as the logits' own dtype would).
at::Tensor best_two(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) >= 2,
              "logits must be (N, V) fp32 with V >= 2");
  TORCH_CHECK(logits.size(1) < (int64_t(1) << 31), "a vocabulary past 2^31 tokens");
  const at::Tensor x = logits.contiguous();
  const int64_t n = x.size(0), v = x.size(1);
  at::Tensor out = at::empty({n, 2}, x.options().dtype(at::kDouble));
  double* op = out.data_ptr<double>();
  for (int64_t r = 0; r < n; r++) {
    const Best b = row_best(x.data_ptr<float>() + r * v, v);
    op[2 * r] = double(b.index);
    op[2 * r + 1] = double(b.value - b.second);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(aerie_top2, lib) { lib.def("best_two(Tensor logits) -> Tensor"); }
TORCH_LIBRARY_IMPL(aerie_top2, CPU, lib) { lib.impl("best_two", &best_two); }
