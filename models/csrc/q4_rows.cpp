// A 4-bit linear for a tree's few rows whose cost is nearly flat in the rows, and in which each row
// is computed alone, in one order, whatever rows come beside it (models/q4_rows.py says why).
//
// Weights are torch's int4 values: w = (c - 8) d + z with a code c in 0..15 and d, z per group of 32
// inputs, computed here as fma(c - 8, d, z) in fp32, one rounding, as the int4 kernel does. Lanes
// are outputs: output n's sum runs over k = 0, 1, ... in order in one vector lane, with no
// horizontal sums, so a row's result is the same bits alone or among others. A lane's 32-bit word
// holds 8 inputs' codes (stored as c ^ 8, so a sign-extending shift gives c - 8 in two
// operations); each weight is dequantized once per block of 4 rows, in registers.
// GCC vector types, as wide as the build's instruction set.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

#if defined(__AVX512F__)
constexpr int L = 16;
#elif defined(__AVX__)
constexpr int L = 8;
#else
constexpr int L = 4;
#endif
// Outputs per block: up to NV vectors (fewer at N's end), rows per register block: up to RB, taken
// in passes of R rows x V vectors of sums, R V <= ACC: independent FMA chains, enough to hide an
// FMA's latency even at one row (V = 4), within the 16 (AVX2) or 32 (AVX-512) vector registers.
// None of this changes any output's order of arithmetic.
constexpr int NV = 4;
constexpr int RB = 6;
constexpr int ACC = L == 16 ? 24 : 12;
typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));

inline vf splat(float x) { return vf{} + x; }
template <typename V, typename T>
inline V load(const T* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf as_float(vi bits) { vf f; std::memcpy(&f, &bits, sizeof f); return f; }

// Rows R of x (fp32, row stride K) times V vectors of outputs from output n0 on: out (row stride N).
// codes: (N/L, K/8, L) words; sz: (K/32, N) pairs of bf16 (d, z), one int32 per output.
template <int R, int V>
void block_of(const float* x, int64_t k, const int32_t* codes, const int32_t* sz, int64_t n, int64_t n0, float* out) {
  vf acc[R][V] = {};
  const int64_t words = k / 8;
  for (int64_t g = 0; g < k / 32; g++) {
    vf scale[V], zero[V];
    for (int v = 0; v < V; v++) {
      const vi pair = load<vi>(sz + g * n + n0 + v * L);
      scale[v] = as_float(pair << 16);
      zero[v] = as_float(pair & int32_t(0xFFFF0000u));
    }
    for (int q = 0; q < 4; q++) {
      vi word[V];
      for (int v = 0; v < V; v++) word[v] = load<vi>(codes + ((n0 / L + v) * words + g * 4 + q) * L);
      const float* xs = x + g * 32 + q * 8;
#pragma GCC unroll 8
      for (int i = 0; i < 8; i++)
        for (int v = 0; v < V; v++) {
          const vf w = __builtin_convertvector((word[v] << (28 - 4 * i)) >> 28, vf) * scale[v] + zero[v];
          for (int r = 0; r < R; r++) acc[r][v] += splat(xs[r * k + i]) * w;
        }
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) store(out + r * n + n0 + v * L, acc[r][v]);
}

template <int R>
void rows_of(int vectors, const float* x, int64_t k, const int32_t* codes, const int32_t* sz, int64_t n, int64_t n0,
             float* out) {
  constexpr int per_pass = ACC / R >= 4 ? 4 : ACC / R >= 2 ? 2 : 1;
  for (int v0 = 0; v0 < vectors; v0 += per_pass) {
    const int64_t at = n0 + v0 * L;
    switch (std::min(per_pass, vectors - v0)) {
      case 1: block_of<R, 1>(x, k, codes, sz, n, at, out); break;
      case 2: block_of<R, 2>(x, k, codes, sz, n, at, out); break;
      case 3: block_of<R, 3>(x, k, codes, sz, n, at, out); break;
      default: block_of<R, per_pass>(x, k, codes, sz, n, at, out); break;
    }
  }
}

template <int... Rs>
void rows_for(int rows, int vectors, const float* x, int64_t k, const int32_t* codes, const int32_t* sz, int64_t n,
              int64_t n0, float* out, std::integer_sequence<int, Rs...>) {
  ((rows == Rs + 1 ? rows_of<Rs + 1>(vectors, x, k, codes, sz, n, n0, out) : void()), ...);
}

at::Tensor mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_zero, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be (M, K) bf16");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 32 == 0 && n % L == 0, "K must be a multiple of 32 and N of ", L);
  TORCH_CHECK(codes.scalar_type() == at::kInt && codes.is_contiguous() && codes.numel() == n * k / 8, "codes from pack()");
  TORCH_CHECK(scale_zero.scalar_type() == at::kBFloat16 && scale_zero.is_contiguous() && scale_zero.numel() == k / 16 * n,
              "scale_zero must be (K/32, N, 2) bf16");
  const at::Tensor xf = x.contiguous().to(at::kFloat);  // exact
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const int32_t* cp = codes.data_ptr<int32_t>();
  const int32_t* sp = reinterpret_cast<const int32_t*>(scale_zero.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  const int64_t block = NV * L, blocks = (n + block - 1) / block;
  // A task: one block of outputs for every row; a thread takes at least ~64K weights' work.
  at::parallel_for(0, blocks, std::max<int64_t>(1, 65536 / (k * block)), [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; b++) {
      const int vectors = int(std::min<int64_t>(NV, (n - b * block) / L));
      for (int64_t r = 0; r < m; r += RB)
        rows_for(int(std::min<int64_t>(RB, m - r)), vectors, xp + r * k, k, cp, sp, n, b * block, op + r * n,
                 std::make_integer_sequence<int, RB>{});
    }
  });
  return out;
}

// codes (N, K) uint8 0..15 -> the layout `mm` reads: per block of L outputs, per 8 inputs, one
// int32 per output whose nibble i holds input 8j + i's code c as c ^ 8.
at::Tensor pack(const at::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "codes must be (N, K) uint8");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(k % 32 == 0 && n % L == 0, "K must be a multiple of 32 and N of ", L);
  const at::Tensor c = codes.contiguous();
  at::Tensor out = at::empty({n * k / 8}, codes.options().dtype(at::kInt));
  const uint8_t* cp = c.data_ptr<uint8_t>();
  int32_t* op = out.data_ptr<int32_t>();
  for (int64_t j = 0; j < n; j++)
    for (int64_t w = 0; w < k / 8; w++) {
      uint32_t word = 0;
      for (int i = 0; i < 8; i++) word |= uint32_t((cp[j * k + 8 * w + i] & 15) ^ 8) << (4 * i);
      op[((j / L) * (k / 8) + w) * L + j % L] = int32_t(word);
    }
  return out;
}

// pack's inverse: -> codes (N, K) uint8.
at::Tensor unpack(const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous() && packed.numel() == n * k / 8, "codes from pack()");
  at::Tensor out = at::empty({n, k}, packed.options().dtype(at::kByte));
  const int32_t* pp = packed.data_ptr<int32_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t j = 0; j < n; j++)
    for (int64_t w = 0; w < k / 8; w++) {
      const uint32_t word = uint32_t(pp[((j / L) * (k / 8) + w) * L + j % L]);
      for (int i = 0; i < 8; i++) op[j * k + 8 * w + i] = uint8_t(((word >> (4 * i)) & 15) ^ 8);
    }
  return out;
}

int64_t block_outputs() { return L; }

}  // namespace

TORCH_LIBRARY(aerie_q4, lib) {
  lib.def("mm(Tensor x, Tensor codes, Tensor scale_zero, int n) -> Tensor");
  lib.def("pack(Tensor codes) -> Tensor");
  lib.def("unpack(Tensor packed, int n, int k) -> Tensor");
  lib.def("block_outputs() -> int", &block_outputs);
}
TORCH_LIBRARY_IMPL(aerie_q4, CPU, lib) {
  lib.impl("mm", &mm);
  lib.impl("pack", &pack);
  lib.impl("unpack", &unpack);
}
