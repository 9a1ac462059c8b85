// A 4-bit linear for a tree's few rows whose cost is nearly flat in the rows, and in which each row
// is computed alone, in one order, whatever rows come beside it (models/q4_rows.py says why).
//
// Weights are torch's int4 values: w = (c - 8) d + z with a code c in 0..15 and d, z per group of 32
// inputs; per group x . w = d sum((c - 8) x) + z sum(x) (`group_total`), so no weight is
// dequantized. Inputs and outputs are rounded to bf16 values as int4's are, but read and written
// as fp32. Lanes are outputs: output n's sum runs over its groups in order, each group's over its
// inputs in order, in one vector lane, with no horizontal sums, so a row's result is the same bits
// alone or among others. A lane's 32-bit word holds 8 inputs' codes (stored as c ^ 8, so a
// sign-extending shift gives c - 8 in two operations), inputs 0, 2, 4, 6 in its low half and 1, 3,
// 5, 7 in its high half, so that AVX512-BF16 finds a pair of inputs' codes in one shift.
// GCC vector types, as wide as the build's instruction set.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <ATen/core/Tensor.h>   // not ATen.h: every op's declaration costs each build seconds
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

#include "lanes.h"

// Outputs per block: up to NV vectors (fewer at N's end), rows per register block: up to RB, taken
// in passes of R rows x V vectors of sums, R V <= ACC: independent FMA chains, enough to hide an
// FMA's latency even at one row (V = 4), with registers to spare for the codes (16
// on AVX2, 32 on AVX-512; more sums spilled to the stack). None of this changes any output's
// order of arithmetic.
constexpr int NV = 4;
constexpr int RB = L == 16 ? 6 : 4;
constexpr int ACC = L == 16 ? 24 : 8;
inline vf as_float(vi bits) { vf f; std::memcpy(&f, &bits, sizeof f); return f; }

// fp32 -> the nearest bf16 value, ties to even, as torch rounds (a NaN stays a NaN).
inline vf round_bf16(vf x) {
  vu bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  vf y;
  std::memcpy(&y, &bits, sizeof y);
  return x == x ? y : x;
}

// The packed weight is one stream per block of W = NV L outputs (fewer in the last), read in order:
// per group of 32 inputs, 4 x W code words (8 inputs each, output-major), then W (d, z) bf16 pairs.
constexpr int64_t GROUP_WORDS = 5;  // x W int32 per group
inline int64_t block_start(int64_t b, int64_t groups) { return b * groups * GROUP_WORDS * NV * L; }

// Per group of 32 inputs a weight is w = (c - 8) d + z, so x . w = d sum((c - 8) x) + z sum(x):
// the codes' sum runs over the group from 0, each product exact (a bf16 x times a 4-bit integer
// fits fp32's 24 bits), then the output's total takes d times it and z times the group's input
// sum (`group_total`, two FMAs per 32 inputs); the same weight values as torch's int4, without
// dequantizing each weight (an FMA per 8 weights, a fifth of the arithmetic at four rows).
// Input 8q + i's nibble in its code word: even inputs in the low half, odd in the high.
constexpr int nibble_of(int i) { return (i & 1) * 4 + (i >> 1); }
// Input 8q + i's code c - 8 from a word (its nibble holds c ^ 8, so the arithmetic shift gives c - 8).
inline vf code_of(vi word, int i) { return __builtin_convertvector((word << (28 - 4 * nibble_of(i))) >> 28, vf); }
// The (d, z) pair is one int32: d the low bf16, z the high.
inline vf scale_of(vi pair) { return as_float(pair << 16); }
inline vf zero_of(vi pair) { return as_float(pair & int32_t(0xFFFF0000u)); }
inline vf group_total(vf total, vf codes_x, vi pair, float x_sum) {
  total += codes_x * scale_of(pair);
  return total + zero_of(pair) * x_sum;
}

// The codes' sums run in units of PER inputs: one multiply-add takes a unit of weights (wv, per
// output lane) and a unit of one row's inputs (xu, broadcast to every lane).
#if defined(__AVX512BF16__)
// Two inputs per unit: vdpbf16ps adds to each fp32 lane its two bf16 products (each exact: a bf16 x
// times an integer -8..7), which is twice an FMA's inputs per instruction. A weight unit's lane
// holds the bf16 values c - 8 of inputs 2u (low half) and 2u + 1, an input unit their x's bf16 bits.
constexpr int PER = 2;
typedef vi wv;
typedef uint32_t xu;
// bf16 bits of each nibble's c - 8 (the nibble's sign-extended value), twice: vpermw reads an index's
// low 5 bits, so a word shifted by 4u needs no mask to pick pair u's two codes.
const vi CODES_BF16 = [] {
  uint16_t bits[2 * L];
  for (int i = 0; i < 2 * L; i++) {
    const float c = float(i & 8 ? (i & 15) - 16 : i & 15);
    uint32_t f;
    std::memcpy(&f, &c, 4);
    bits[i] = uint16_t(f >> 16);
  }
  return load<vi>(bits);
}();
inline wv unit_of(vi word, int u) {
  return (wv)_mm512_permutexvar_epi16((__m512i)((vu)word >> (4 * u)), (__m512i)CODES_BF16);
}
inline vf mac(vf acc, wv w, xu x) { return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(int(x))); }
#else
// One input per unit: an FMA of its code c - 8 and its x.
constexpr int PER = 1;
typedef vf wv;
typedef float xu;
inline wv unit_of(vi word, int u) { return code_of(word, u); }
inline vf mac(vf acc, wv w, xu x) { return acc + w * x; }   // contracted to one FMA, x a scalar broadcast
#endif
constexpr int UNITS = 8 / PER;   // per code word

// Rows R of x (input units, row stride K/PER; x_sum: each row's group sums, row stride K/32) times
// V vectors of a block's outputs from its vector v0 on; out holds the totals between groups.
template <int R, int V>
void block_of(const xu* x, int64_t k, const float* x_sum, const int32_t* block, int64_t width, int v0, int64_t n,
              float* out) {
  const int64_t groups = k / 32, stride = k / PER;
  for (int64_t g = 0; g < groups; g++) {
    const int32_t* group = block + g * GROUP_WORDS * width + v0 * L;
    vf acc[R][V] = {};
    for (int q = 0; q < 4; q++) {
      vi word[V];
      for (int v = 0; v < V; v++) word[v] = load<vi>(group + q * width + v * L);
      const xu* xs = x + (g * 32 + q * 8) / PER;
#pragma GCC unroll 8
      for (int u = 0; u < UNITS; u++)
        for (int v = 0; v < V; v++) {
          const wv w = unit_of(word[v], u);
          for (int r = 0; r < R; r++) acc[r][v] = mac(acc[r][v], w, xs[r * stride + u]);
        }
    }
    for (int v = 0; v < V; v++) {
      const vi pair = load<vi>(group + 4 * width + v * L);
      for (int r = 0; r < R; r++) {
        float* at = out + r * n + v * L;
        store(at, group_total(g ? load<vf>(at) : vf{}, acc[r][v], pair, x_sum[r * groups + g]));
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) store(out + r * n + v * L, round_bf16(load<vf>(out + r * n + v * L)));
}

// Calls pass(V, v0) for each pass over up to P of a block's `vectors` vectors, V as a compile-time
// int (std::integral_constant), so each pass's sums sit in registers.
template <int P, typename F>
void by_vectors(int vectors, F&& pass) {
  for (int v0 = 0; v0 < vectors; v0 += P) {
    switch (std::min(P, vectors - v0)) {
      case 1: pass(std::integral_constant<int, 1>{}, v0); break;
      case 2: pass(std::integral_constant<int, 2>{}, v0); break;
      case 3: pass(std::integral_constant<int, 3>{}, v0); break;
      default: pass(std::integral_constant<int, P>{}, v0); break;
    }
  }
}

template <int R>
void rows_of(int vectors, const xu* x, int64_t k, const float* x_sum, const int32_t* block, int64_t n, float* out) {
  constexpr int per_pass = ACC / R >= 4 ? 4 : ACC / R >= 2 ? 2 : 1;
  const int64_t width = int64_t(vectors) * L;
  by_vectors<per_pass>(vectors, [&](auto V, int v0) {
    block_of<R, decltype(V)::value>(x, k, x_sum, block, width, v0, n, out + v0 * L);
  });
}

template <int... Rs>
void rows_for(int rows, int vectors, const xu* x, int64_t k, const float* x_sum, const int32_t* block, int64_t n,
              float* out, std::integer_sequence<int, Rs...>) {
  ((rows == Rs + 1 ? rows_of<Rs + 1>(vectors, x, k, x_sum, block, n, out) : void()), ...);
}

// ---- tiled path: a group's codes converted once into an L1 tile, then rows x vectors of FMAs ----
// The same arithmetic per output as block_of (each group's sum from 0 over its units in order,
// then `group_total`), so a row's bits do not depend on which path or which rows came beside it.
// One group (32 inputs) of a block's `width` outputs -> tile[u * width + o]: weight unit u's lanes.
void codes_group(const int32_t* group, int64_t width, uint32_t* tile) {
  for (int64_t o = 0; o < width; o += L)
    for (int q = 0; q < 4; q++) {
      const vi word = load<vi>(group + q * width + o);
#pragma GCC unroll 8
      for (int u = 0; u < UNITS; u++) store(tile + (q * UNITS + u) * width + o, unit_of(word, u));
    }
}

// sums[r][v] (R rows x V vectors, row stride `width`): the group's total added (`group_total`),
// its codes in `tile`, its (d, z) pairs at `pairs`; x: the group's input units of each row (stride
// k / PER), x_sum: each row's sum of them (stride `groups`).
template <int R, int V>
void tile_fma(const uint32_t* tile, const int32_t* pairs, int64_t width, const xu* x, int64_t k, const float* x_sum,
              int64_t groups, float* sums) {
  vf acc[R][V] = {};
#pragma GCC unroll 4
  for (int u = 0; u < 32 / PER; u++) {
    wv w[V];
    for (int v = 0; v < V; v++) w[v] = load<wv>(tile + u * width + v * L);
    for (int r = 0; r < R; r++) {
      const xu xr = x[r * (k / PER) + u];
      for (int v = 0; v < V; v++) acc[r][v] = mac(acc[r][v], w[v], xr);
    }
  }
  for (int v = 0; v < V; v++) {
    const vi pair = load<vi>(pairs + v * L);
    for (int r = 0; r < R; r++) {
      float* at = sums + r * width + v * L;
      store(at, group_total(load<vf>(at), acc[r][v], pair, x_sum[r * groups]));
    }
  }
}

constexpr int TR = L == 16 ? 6 : 4;   // rows per FMA pass
constexpr int TV = L == 16 ? 4 : 2;   // vectors per FMA pass: TR TV sums + TV codes + a broadcast in registers

template <int R>
void tile_rows(int vectors, const uint32_t* tile, const int32_t* pairs, int64_t width, const xu* x, int64_t k,
               const float* x_sum, int64_t groups, float* sums) {
  by_vectors<TV>(vectors, [&](auto V, int v0) {
    tile_fma<R, decltype(V)::value>(tile + v0 * L, pairs + v0 * L, width, x, k, x_sum, groups, sums + v0 * L);
  });
}

template <int... Rs>
void tile_rows_for(int rows, int vectors, const uint32_t* tile, const int32_t* pairs, int64_t width, const xu* x,
                   int64_t k, const float* x_sum, int64_t groups, float* sums, std::integer_sequence<int, Rs...>) {
  ((rows == Rs + 1 ? tile_rows<Rs + 1>(vectors, tile, pairs, width, x, k, x_sum, groups, sums) : void()), ...);
}

constexpr int64_t CHUNK = 48;   // rows whose sums one block keeps (48 x 64 fp32: 12 KB)

void block_tiled(const xu* x, int64_t m, int64_t k, const float* x_sum, const int32_t* block, int vectors, int64_t n,
                 float* out, uint32_t* tile, float* sums) {
  const int64_t width = int64_t(vectors) * L, groups = k / 32;
  for (int64_t r0 = 0; r0 < m; r0 += CHUNK) {
    const int64_t rows = std::min(CHUNK, m - r0);
    std::fill(sums, sums + rows * width, 0.0f);
    for (int64_t g = 0; g < groups; g++) {
      const int32_t* group = block + g * GROUP_WORDS * width;
      codes_group(group, width, tile);
      for (int64_t r = 0; r < rows; r += TR)
        tile_rows_for(int(std::min<int64_t>(TR, rows - r)), vectors, tile, group + 4 * width, width,
                      x + ((r0 + r) * k + g * 32) / PER, k, x_sum + (r0 + r) * groups + g, groups, sums + r * width,
                      std::make_integer_sequence<int, TR>{});
    }
    for (int64_t r = 0; r < rows; r++)
      for (int64_t o = 0; o < width; o += L) store(out + (r0 + r) * n + o, round_bf16(load<vf>(sums + r * width + o)));
  }
}

// A call's inputs rounded to bf16 values, as torch's int4 kernel takes them, as units in a buffer of
// the call's own (through torch's dispatcher a cast cost ~10 us a call, 2 ms a verify), and each
// row's sum of each group's rounded inputs in order from 0 (`group_total`'s z term): (M, K/PER), (M, K/32).
struct Inputs {
  std::vector<xu> units;
  std::vector<float> sums;
};

Inputs inputs_of(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / 32;
  Inputs in{std::vector<xu>(m * k / PER), std::vector<float>(m * groups, 0.0f)};
  // One input per unit: the units are the rounded fp32 themselves; two: the fp32 first, packed below.
  std::vector<float> staged(PER == 1 ? 0 : m * k);
  float* xr = PER == 1 ? reinterpret_cast<float*>(in.units.data()) : staged.data();
  if (x.scalar_type() == at::kFloat) {
    const float* src = x.data_ptr<float>();
    for (int64_t i = 0; i < m * k; i += L) store(xr + i, round_bf16(load<vf>(src + i)));   // k is a multiple of L
  } else {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < m * k; i++) {
      const uint32_t bits = uint32_t(src[i]) << 16;
      std::memcpy(xr + i, &bits, 4);
    }
  }
  for (int64_t r = 0; r < m; r++)
    for (int64_t g = 0; g < groups; g++)
      for (int64_t i = 0; i < 32; i++) in.sums[r * groups + g] += xr[r * k + g * 32 + i];
  // A bf16 unit holds each of its two inputs' top 2 bytes (exact: they are rounded).
  if (PER == 2) {
    char* units = reinterpret_cast<char*>(in.units.data());
    for (int64_t i = 0; i < m * k; i++) std::memcpy(units + 2 * i, reinterpret_cast<const char*>(xr + i) + 2, 2);
  }
  return in;
}

// x (M, K) @ W^T -> (M, N) fp32: rows kept in registers below `tiles_from` rows, through an L1 tile
// from there (the same bits either way; where the tile pays is measured per machine, core/tune).
at::Tensor mm(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t tiles_from) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), "x must be (M, K) fp32 or bf16");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 32 == 0 && n % L == 0, "K must be a multiple of 32 and N of ", L);
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous() && packed.numel() == k / 32 * GROUP_WORDS * n,
              "a weight from pack() for this K and N");
  const Inputs in = inputs_of(x.contiguous());
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  const xu* xp = in.units.data();
  const float* xs = in.sums.data();
  const int32_t* pp = packed.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t block = NV * L, blocks = (n + block - 1) / block, groups = k / 32;
  // A task: one block of outputs for every row; a thread takes at least ~64K weights' work.
  at::parallel_for(0, blocks, std::max<int64_t>(1, 65536 / (k * block)), [&](int64_t lo, int64_t hi) {
    if (m >= tiles_from) {
      std::vector<uint32_t> tile(32 / PER * block);
      std::vector<float> sums(CHUNK * block);
      for (int64_t b = lo; b < hi; b++)
        block_tiled(xp, m, k, xs, pp + block_start(b, groups), int(std::min<int64_t>(NV, (n - b * block) / L)), n,
                    op + b * block, tile.data(), sums.data());
      return;
    }
    for (int64_t b = lo; b < hi; b++) {
      const int vectors = int(std::min<int64_t>(NV, (n - b * block) / L));
      for (int64_t r = 0; r < m; r += RB)
        rows_for(int(std::min<int64_t>(RB, m - r)), vectors, xp + r * k / PER, k, xs + r * groups, pp + block_start(b, groups), n,
                 op + r * n + b * block, std::make_integer_sequence<int, RB>{});
    }
  });
  return out;
}

// codes (N, K) uint8 0..15 and scale_zero (K/32, N, 2) bf16 -> the packed weight `mm` reads. A
// code word holds 8 inputs' codes, input 8j + i in nibble `nibble_of(i)`, each c as c ^ 8.
at::Tensor pack(const at::Tensor& codes, const at::Tensor& scale_zero) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "codes must be (N, K) uint8");
  const int64_t n = codes.size(0), k = codes.size(1), groups = k / 32;
  TORCH_CHECK(k % 32 == 0 && n % L == 0, "K must be a multiple of 32 and N of ", L);
  TORCH_CHECK(scale_zero.scalar_type() == at::kBFloat16 && scale_zero.numel() == groups * n * 2, "scale_zero (K/32, N, 2) bf16");
  const at::Tensor c = codes.contiguous(), sz = scale_zero.contiguous();
  at::Tensor out = at::empty({groups * GROUP_WORDS * n}, codes.options().dtype(at::kInt));
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const int32_t* sp = reinterpret_cast<const int32_t*>(sz.data_ptr<at::BFloat16>());
  int32_t* op = out.data_ptr<int32_t>();
  for (int64_t j = 0; j < n; j++) {
    const int64_t b = j / (NV * L), width = std::min<int64_t>(NV * L, n - b * NV * L), lane = j % (NV * L);
    int32_t* block = op + block_start(b, groups);
    for (int64_t g = 0; g < groups; g++) {
      for (int q = 0; q < 4; q++) {
        uint32_t word = 0;
        for (int i = 0; i < 8; i++) word |= uint32_t((cp[j * k + 32 * g + 8 * q + i] & 15) ^ 8) << (4 * nibble_of(i));
        block[(g * GROUP_WORDS + q) * width + lane] = int32_t(word);
      }
      block[(g * GROUP_WORDS + 4) * width + lane] = sp[g * n + j];
    }
  }
  return out;
}

// pack's inverse for the codes: -> (N, K) uint8.
at::Tensor unpack(const at::Tensor& packed, int64_t n, int64_t k) {
  const int64_t groups = k / 32;
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous() && packed.numel() == groups * GROUP_WORDS * n,
              "a weight from pack() for this K and N");
  at::Tensor out = at::empty({n, k}, packed.options().dtype(at::kByte));
  const int32_t* pp = packed.data_ptr<int32_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t j = 0; j < n; j++) {
    const int64_t b = j / (NV * L), width = std::min<int64_t>(NV * L, n - b * NV * L), lane = j % (NV * L);
    const int32_t* block = pp + block_start(b, groups);
    for (int64_t g = 0; g < groups; g++)
      for (int q = 0; q < 4; q++) {
        const uint32_t word = uint32_t(block[(g * GROUP_WORDS + q) * width + lane]);
        for (int i = 0; i < 8; i++) op[j * k + 32 * g + 8 * q + i] = uint8_t(((word >> (4 * nibble_of(i))) & 15) ^ 8);
      }
  }
  return out;
}

int64_t block_outputs() { return L; }

}  // namespace

TORCH_LIBRARY(aerie_q4, lib) {
  lib.def("mm(Tensor x, Tensor packed, int n, int tiles_from=1073741824) -> Tensor");   // default: never (q4_rows.NEVER)
  lib.def("pack(Tensor codes, Tensor scale_zero) -> Tensor");
  lib.def("unpack(Tensor packed, int n, int k) -> Tensor");
  lib.def("block_outputs() -> int", &block_outputs);
}
TORCH_LIBRARY_IMPL(aerie_q4, CPU, lib) {
  lib.impl("mm", &mm);
  lib.impl("pack", &pack);
  lib.impl("unpack", &unpack);
}
