// y (M, N) fp32 = x (M, K) bf16 @ W^T for a 4-bit weight W[n, k] = d[g, n] * (c[n, k] - 8) + z[g, n]
// (codes c in 0..15, groups g of 32 inputs, d and z bf16: torch's int4 layout), on AMX. See
// models/amx.py for the layout and why.
//
// Per group: sum_k x_k w_k = d * (sum_k x_k c_k - 8 sum_k x_k) + z * sum_k x_k. A code is an integer below 16,
// exact in bf16, so one TDPBF16PS multiplies up to 16 rows of x by a tile of 32 x 16 codes with
// exact products and fp32 sums; the group's sums are then scaled with fp32 FMAs. Each row is
// computed on its own, in the same order whatever the number of rows: a tree's rows get the very
// values one row at a time gets. Two groups are in flight at once (tiles 0-2 and 3-5): one chain of
// tile loads, product and store per group left AMX idle most of the time at one row.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include <ATen/core/Tensor.h>   // not ATen.h: every op's declaration costs each build seconds
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

struct TileConfig {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure(int rows) {  // A: rows x 32 bf16; B: 16 pairs of k x 16 columns x 2 bf16 (VNNI); C: rows x 16 fp32
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t : {0, 3}) { c.rows[t] = rows; c.colsb[t] = 64; }
  for (int t : {1, 4}) { c.rows[t] = 16; c.colsb[t] = 64; }
  for (int t : {2, 5}) { c.rows[t] = rows; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
}

bool tiles_granted() {  // Linux hands a process AMX's tile state only when asked (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// One group's 512 codes, 256 bytes: 4 chunks of 64, a chunk's low nibbles are tile rows 4q and 4q+1
// (32 codes each, in VNNI order), its high nibbles rows 4q+2 and 4q+3 -> bf16 values in `tile`.
inline void expand(const uint8_t* codes, uint16_t* tile, __m512i table) {
  const __m512i low = _mm512_set1_epi8(15);
  for (int q = 0; q < 4; q++) {
    const __m512i v = _mm512_loadu_si512(codes + q * 64);
    const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    _mm512_store_si512(tile + (4 * q + 0) * 32, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo)), table));
    _mm512_store_si512(tile + (4 * q + 1) * 32, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo, 1)), table));
    _mm512_store_si512(tile + (4 * q + 2) * 32, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi)), table));
    _mm512_store_si512(tile + (4 * q + 3) * 32, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi, 1)), table));
  }
}

// Rows [t0, t0 + R) of y for the column blocks [nb0, nb1), R <= 16.
void block(const uint16_t* x, const float* xsum, const uint8_t* codes, const uint16_t* d, const uint16_t* z, float* y,
           int t0, int R, int K, int N, int64_t nb0, int64_t nb1, __m512i table) {
  const int G = K / 32;
  alignas(64) uint16_t b[2][16 * 32];
  alignas(64) float c[2][16 * 16];
  configure(R);
  for (int64_t nb = nb0; nb < nb1; nb++) {
    __m512 total[16];
    for (int r = 0; r < 16; r++) total[r] = _mm512_setzero_ps();
    const uint8_t* block_codes = codes + nb * G * 256;
    for (int g = 0; g < G; g += 2) {
      expand(block_codes + g * 256, b[0], table);
      expand(block_codes + (g + 1) * 256, b[1], table);
      _tile_zero(2);
      _tile_zero(5);
      _tile_loadd(0, x + (size_t)t0 * K + g * 32, K * 2);
      _tile_loadd(3, x + (size_t)t0 * K + (g + 1) * 32, K * 2);
      _tile_loadd(1, b[0], 64);
      _tile_loadd(4, b[1], 64);
      _tile_dpbf16ps(2, 0, 1);
      _tile_dpbf16ps(5, 3, 4);
      _tile_stored(2, c[0], 64);
      _tile_stored(5, c[1], 64);
      for (int j = 0; j < 2; j++) {
        const __m512 dv = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(d + (size_t)(g + j) * N + nb * 16)));
        const __m512 zv = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(z + (size_t)(g + j) * N + nb * 16)));
        for (int r = 0; r < R; r++) {
          const __m512 sum = _mm512_set1_ps(xsum[(size_t)(t0 + r) * G + g + j]);
          const __m512 p = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), sum, _mm512_load_ps(c[j] + r * 16));  // P - 8 sum
          total[r] = _mm512_fmadd_ps(zv, sum, _mm512_fmadd_ps(p, dv, total[r]));
        }
      }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (size_t)(t0 + r) * N + nb * 16, total[r]);
  }
  // No _tile_release(): releasing and configuring again at every call cost ~3 us at one row; the
  // next AMX user in this thread (this kernel, oneDNN) loads its own configuration first.
}

at::Tensor q41_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& z, int64_t n) {
  TORCH_CHECK(tiles_granted(), "the kernel could not get AMX's tile state from Linux (arch_prctl)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be (M, K) bf16");
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  TORCH_CHECK(K % 64 == 0 && n % 16 == 0, "K must be a multiple of 64 and N of 16");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.numel() == n * K / 2, "codes must hold N * K / 2 bytes");
  TORCH_CHECK(d.scalar_type() == at::kBFloat16 && z.scalar_type() == at::kBFloat16 && d.numel() == G * n &&
              z.numel() == G * n, "d and z must be (K / 32, N) bf16");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, n}, x.options().dtype(at::kFloat));
  uint16_t values[32];
  for (int i = 0; i < 32; i++) {  // bf16 of 0..15 (twice: the permute's table has 32 entries)
    float f = float(i & 15);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    values[i] = uint16_t(u >> 16);
  }
  const __m512i table = _mm512_loadu_si512(values);
  TORCH_CHECK(codes.is_contiguous(), "codes must be contiguous (models/amx.py pack)");
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Tensor dc = d.contiguous(), zc = z.contiguous();
  const auto* dp = reinterpret_cast<const uint16_t*>(dc.data_ptr<at::BFloat16>());
  const auto* zp = reinterpret_cast<const uint16_t*>(zc.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  std::vector<float> xsum(M * G);  // (M, G): each row's own group sums, in input order
  for (int64_t i = 0; i < M * G; i++) {
    float sum = 0.f;
    for (int k = 0; k < 32; k++) {
      const uint32_t bits = uint32_t(xp[i * 32 + k]) << 16;
      float v;
      std::memcpy(&v, &bits, 4);
      sum += v;
    }
    xsum[i] = sum;
  }
  const float* sp = xsum.data();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n / 16, 1, [&](int64_t nb0, int64_t nb1) {
    for (int64_t t0 = 0; t0 < M; t0 += 16)
      block(xp, sp, cp, dp, zp, yp, int(t0), int(std::min<int64_t>(16, M - t0)), int(K), int(n), nb0, nb1, table);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(aerie_amx, lib) { lib.def("q41_mm(Tensor x, Tensor codes, Tensor d, Tensor z, int n) -> Tensor"); }
TORCH_LIBRARY_IMPL(aerie_amx, CPU, lib) { lib.impl("q41_mm", &q41_mm); }
