// int4 weights (asymmetric, groups of 32 / 64 / 128) x bf16 activations on AMX tiles, for decode and verify steps.
//
// Weights W[n, c] = (q - 8) * scale[n, g] + zero[n, g], q in 0..15, g = c / group; scale and zero are bf16
// (the same numbers as torch's int4 CPU kernel takes). Packed per "N-tile" of 16 outputs and "chunk" of 32
// inputs into 256 bytes: four 64-byte loads of 32 little-endian 16-bit words, each word holding 4 nibbles.
// Nibble i of word w of load L is the weight of output 16 * tile + w / 2 and input 32 * chunk + 2 * (4L + i)
// + w % 2: shifted down by 4i, the words are indices into a 32-entry table of bf16 (q - 8) (vpermw reads the
// low 5 bits, so the table repeats), which gives row 4L + i of the AMX B tile in its pair-interleaved layout.
//
// Arithmetic, the same for every k, and in the pure-torch reference (kernels/int4_amx.py):
//   C[m, n]  = sum over the group's inputs c of x[m, c] * (q[n, c] - 8): the products are exact in fp32; how
//              TDPBF16PS orders and rounds the additions inside one 32-input tile multiply is the hardware's
//              (Intel documents sequential fp32 adds; ours differs in the last bit now and then), the same
//              for every row, and rows are computed independently of each other
//   xs[m, g] = x[m, first] + x[m, first + 1] + ... left to right, in fp32
//   acc      = acc + C * scale;  acc = acc + xs * zero;   group after group      (mul, then add)
// Each output row is the same sequence of operations whatever k is and whatever the other rows hold, so the
// kernel is bit-exact across k by construction. Built with -ffp-contract=off (no fused multiply-adds).
//
// Cost: dequantizing to bf16 (two vector ops per 32 weights) and one tile multiply per 512 weights are
// independent of k; only the rescale (2 multiplies and 2 adds per row per group and 16 outputs) grows with
// it. So a 9-row verify step costs about what a 1-row decode step does.

#include "amx.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

namespace {

using amx::group_sums, amx::kChunk, amx::kChunkBytes, amx::kMaxRows, amx::kPrefetch;

#ifdef SPECDECODE_AMX
using amx::configure, amx::store_row;

inline __m512i bf16_table(int times = 1) {  // entry j: bf16 of times * ((j & 15) - 8), exact for times 1, 16
  alignas(64) uint16_t tab[32];
  for (int j = 0; j < 32; ++j) {
    const float f = static_cast<float>(times * ((j & 15) - 8));
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    tab[j] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(tab);
}

// 256 packed bytes -> the 1 KB B tile
inline void dequantize_chunk(const uint8_t* p, uint16_t* tile, __m512i table) {
  for (int L = 0; L < 4; ++L) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + 64 * L), _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(p + 64 * L);
    _mm512_store_si512(tile + (4 * L + 0) * 32, _mm512_permutexvar_epi16(v, table));
    _mm512_store_si512(tile + (4 * L + 1) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table));
    _mm512_store_si512(tile + (4 * L + 2) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), table));
    _mm512_store_si512(tile + (4 * L + 3) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table));
  }
}

// C tile `c` += activations of chunk `ch` x its weights, dequantized at `bt`; A and B tiles alternate so
// consecutive chunks overlap. (Tile numbers must be literals: the intrinsics paste them into the instruction.)
#define CHUNK_MM(c, a, b, ch, bt)                                    \
  do {                                                               \
    _tile_loadd(a, x + (ch) * kChunk, K * 2);                        \
    _tile_loadd(b, bt, 64);                                          \
    _tile_dpbf16ps(c, a, b);                                         \
  } while (0)

// acc[m] += C * scale + xs * zero for NG groups from g0, from the C tiles stored in cbuf
template <int M, int NG>
inline void rescale(__m512* acc, const float* cbuf, const uint16_t* sz, const float* xs, int64_t G, int64_t g0) {
  for (int i = 0; i < NG; ++i) {
    const __m512i both = _mm512_loadu_si512(sz + (g0 + i) * 32);  // 16 bf16 scales, 16 bf16 zeros
    const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(both)), 16));
    const __m512 zero = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(both, 1)), 16));
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_load_ps(cbuf + i * 256 + 16 * m), scale));
      acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_set1_ps(xs[m * G + g0 + i]), zero));
    }
  }
}

// NG (1..4) groups, each accumulating in its own C tile (4 + i), then rescaled into acc
template <int M, int NG>
inline void groups(const uint8_t* w, const uint16_t* sz, const uint16_t* x, int64_t K, const float* xs, int64_t G,
                   int cpg, int64_t g0, __m512* acc, uint16_t* btile, float* cbuf, __m512i table) {
  // all the batch's weights first: a tile load of data just stored waits for the stores to reach the cache
  for (int i = 0; i < NG * cpg; ++i) dequantize_chunk(w + (g0 * cpg + i) * kChunkBytes, btile + i * 512, table);
  for (int c = 0; c < cpg; ++c) {
    const int64_t ch = g0 * cpg + c;
    CHUNK_MM(4, 0, 2, ch, btile + c * 512);
    if (NG > 1) CHUNK_MM(5, 1, 3, ch + cpg, btile + (cpg + c) * 512);
    if (NG > 2) CHUNK_MM(6, 0, 2, ch + 2 * cpg, btile + (2 * cpg + c) * 512);
    if (NG > 3) CHUNK_MM(7, 1, 3, ch + 3 * cpg, btile + (3 * cpg + c) * 512);
  }
  _tile_stored(4, cbuf, 64);
  _tile_zero(4);
  if (NG > 1) { _tile_stored(5, cbuf + 256, 64); _tile_zero(5); }
  if (NG > 2) { _tile_stored(6, cbuf + 512, 64); _tile_zero(6); }
  if (NG > 3) { _tile_stored(7, cbuf + 768, 64); _tile_zero(7); }
  rescale<M, NG>(acc, cbuf, sz, xs, G, g0);
}

// 16 outputs for M rows: w, sz point at the N-tile's packed weights and scales; x, xs, out at row 0
template <int M>
void n_tile(const uint8_t* w, const uint16_t* sz, const uint16_t* x, int64_t K, const float* xs, int64_t G, int cpg,
            void* out, bool bf16_out, int64_t ldo, uint16_t* btile, float* cbuf) {
  const __m512i table = bf16_table();
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) groups<M, 4>(w, sz, x, K, xs, G, cpg, g, acc, btile, cbuf, table);
  switch (G - g) {
    case 3: groups<M, 3>(w, sz, x, K, xs, G, cpg, g, acc, btile, cbuf, table); break;
    case 2: groups<M, 2>(w, sz, x, K, xs, G, cpg, g, acc, btile, cbuf, table); break;
    case 1: groups<M, 1>(w, sz, x, K, xs, G, cpg, g, acc, btile, cbuf, table); break;
    default: break;
  }
  for (int m = 0; m < M; ++m) store_row(out, m, ldo, acc[m], bf16_out);
}

using TileFn = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, const float*, int64_t, int, void*,
                        bool, int64_t, uint16_t*, float*);
template <int... Ms>
constexpr std::array<TileFn, sizeof...(Ms) + 1> tile_fns(std::integer_sequence<int, Ms...>) {
  return {nullptr, n_tile<Ms + 1>...};
}
constexpr auto kTileFns = tile_fns(std::make_integer_sequence<int, kMaxRows>{});

// int8 (int8_amx_mm): chunk ch's 512 bytes hold the high nibbles of q + 128, then the low ones, in the int4
// layout. C = sum over the row of x * 16 (hi - 8) + x * (lo - 8), each chunk into C tile 4 + ch % 4 (four
// independent accumulation chains), the tiles added 4 + 5, + 6, + 7; then y = C * s + xs * 8s. No rescale per
// group: a row costs one multiply-add per 16 outputs, so k <= 16 rows cost about what one does.
template <int M>
void n_tile_int8(const uint8_t* w, const float* scale, const uint16_t* x, int64_t K, const float* xs, void* out,
                 bool bf16_out, int64_t ldo, uint16_t* btile, float* cbuf) {
  const __m512i hi_table = bf16_table(16), lo_table = bf16_table();
  const int64_t chunks = K / kChunk;
  _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
  for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
    const int n = static_cast<int>(std::min<int64_t>(4, chunks - c0));
    for (int i = 0; i < n; ++i) {  // dequantize first: a tile load of data just stored waits for the stores
      dequantize_chunk(w + (c0 + i) * 2 * kChunkBytes, btile + 2 * i * 512, hi_table);
      dequantize_chunk(w + (c0 + i) * 2 * kChunkBytes + kChunkBytes, btile + (2 * i + 1) * 512, lo_table);
    }
#define INT8_CHUNK(c, a, i)                                   \
    do {                                                      \
      _tile_loadd(a, x + (c0 + (i)) * kChunk, K * 2);         \
      _tile_loadd(2, btile + 2 * (i) * 512, 64);              \
      _tile_dpbf16ps(c, a, 2);                                \
      _tile_loadd(3, btile + (2 * (i) + 1) * 512, 64);        \
      _tile_dpbf16ps(c, a, 3);                                \
    } while (0)
    INT8_CHUNK(4, 0, 0);
    if (n > 1) INT8_CHUNK(5, 1, 1);
    if (n > 2) INT8_CHUNK(6, 0, 2);
    if (n > 3) INT8_CHUNK(7, 1, 3);
#undef INT8_CHUNK
  }
  _tile_stored(4, cbuf, 64);
  _tile_stored(5, cbuf + 256, 64);
  _tile_stored(6, cbuf + 512, 64);
  _tile_stored(7, cbuf + 768, 64);
  const __m512 s = _mm512_loadu_ps(scale), s8 = _mm512_mul_ps(s, _mm512_set1_ps(8.0f));
  for (int m = 0; m < M; ++m) {
    __m512 c = _mm512_add_ps(_mm512_load_ps(cbuf + 16 * m), _mm512_load_ps(cbuf + 256 + 16 * m));
    c = _mm512_add_ps(c, _mm512_load_ps(cbuf + 512 + 16 * m));
    c = _mm512_add_ps(c, _mm512_load_ps(cbuf + 768 + 16 * m));
    const __m512 y = _mm512_add_ps(_mm512_mul_ps(c, s), _mm512_mul_ps(_mm512_set1_ps(xs[m]), s8));
    if (bf16_out)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + m * ldo),
                          (__m256i)_mm512_cvtneps_pbh(y));
    else
      _mm512_storeu_ps(static_cast<float*>(out) + m * ldo, y);
  }
}

using Int8TileFn = void (*)(const uint8_t*, const float*, const uint16_t*, int64_t, const float*, void*, bool, int64_t,
                            uint16_t*, float*);
template <int... Ms>
constexpr std::array<Int8TileFn, sizeof...(Ms) + 1> int8_tile_fns(std::integer_sequence<int, Ms...>) {
  return {nullptr, n_tile_int8<Ms + 1>...};
}
constexpr auto kInt8TileFns = int8_tile_fns(std::make_integer_sequence<int, kMaxRows>{});
#endif

}  // namespace

bool available() {
#ifdef SPECDECODE_AMX
  return amx::permitted();
#else
  return false;
#endif
}

// x: [k, K] bf16; packed: [N / 16, K / 32, 256] uint8; scale_zero: [N / 16, K / group, 32] int16 (bf16 bits:
// 16 scales, then 16 zeros) -> [k, N] float32, or bfloat16 if bf16_out (what the model needs next: no copy)
torch::Tensor int4_amx_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_zero, int64_t group,
                          bool bf16_out) {
  TORCH_CHECK(available(), "the int4-amx kernel needs a CPU with AMX-BF16 (and a Linux that grants it)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be [k, K] bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
              packed.size(2) == kChunkBytes, "packed must be contiguous [N / 16, K / 32, 256] uint8");
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "group must be 32, 64 or 128");  // buffers below
  const int64_t k = x.size(0), K = x.size(1), NT = packed.size(0), N = NT * 16, G = K / group;
  TORCH_CHECK(K % group == 0 && packed.size(1) * kChunk == K, "inputs of width ", K, " do not fit weights packed for ",
              packed.size(1) * kChunk);
  TORCH_CHECK(scale_zero.dim() == 3 && scale_zero.scalar_type() == torch::kInt16 && scale_zero.is_contiguous() &&
              scale_zero.size(0) == NT && scale_zero.size(1) == G && scale_zero.size(2) == 32,
              "scale_zero must be contiguous [N / 16, K / group, 32] int16");
  auto out = torch::empty({k, N}, bf16_out ? torch::kBFloat16 : torch::kFloat32);
#ifdef SPECDECODE_AMX
  const torch::Tensor xc = x.contiguous();
  auto xs = torch::empty({k, G}, torch::kFloat32);
  group_sums(xc.data_ptr<at::BFloat16>(), k, K, group, xs.data_ptr<float>());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const auto* szp = reinterpret_cast<const uint16_t*>(scale_zero.data_ptr<int16_t>());
  const float* xsp = xs.data_ptr<float>();
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t osize = out.element_size();
  const int cpg = static_cast<int>(group / kChunk);
  at::parallel_for(0, NT, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t btile[16 * 512];  // 4 groups of up to 128 inputs
    alignas(64) float cbuf[4 * 256];
    for (int64_t m0 = 0; m0 < k; m0 += kMaxRows) {
      const int M = static_cast<int>(std::min<int64_t>(kMaxRows, k - m0));
      configure(M);
      for (int64_t t = begin; t < end; ++t)
        kTileFns[M](wp + t * (K / kChunk) * kChunkBytes, szp + t * G * 32, xp + m0 * K, K, xsp + m0 * G, G, cpg,
                    op + (m0 * N + t * 16) * osize, bf16_out, N, btile, cbuf);
    }
    _tile_release();  // other code (oneDNN) configures the tiles it uses itself
  });
#endif
  return out;
}

// x: [k, K] bf16; packed: [N / 16, K / 32, 2, 256] uint8 (high then low nibbles of q + 128, int4 layout);
// scale: [N] float32 (bf16 values) -> [k, N] float32, or bfloat16 if bf16_out
torch::Tensor int8_amx_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, bool bf16_out) {
  TORCH_CHECK(available(), "the int8-amx kernel needs a CPU with AMX-BF16 (and a Linux that grants it)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be [k, K] bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
              packed.size(2) == 2 && packed.size(3) == kChunkBytes, "packed must be contiguous [N / 16, K / 32, 2, 256]");
  const int64_t k = x.size(0), K = x.size(1), NT = packed.size(0), N = NT * 16;
  TORCH_CHECK(packed.size(1) * kChunk == K, "inputs of width ", K, " do not fit weights packed for ",
              packed.size(1) * kChunk);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == torch::kFloat32 && scale.is_contiguous(),
              "scale must be contiguous [N] float32");
  auto out = torch::empty({k, N}, bf16_out ? torch::kBFloat16 : torch::kFloat32);
#ifdef SPECDECODE_AMX
  const torch::Tensor xc = x.contiguous();
  auto xs = torch::empty({k}, torch::kFloat32);
  group_sums(xc.data_ptr<at::BFloat16>(), k, K, K, xs.data_ptr<float>());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* xsp = xs.data_ptr<float>();
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t osize = out.element_size();
  at::parallel_for(0, NT, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t btile[8 * 512];  // 4 chunks, high and low
    alignas(64) float cbuf[4 * 256];
    for (int64_t m0 = 0; m0 < k; m0 += kMaxRows) {
      const int M = static_cast<int>(std::min<int64_t>(kMaxRows, k - m0));
      configure(M);
      for (int64_t t = begin; t < end; ++t)
        kInt8TileFns[M](wp + t * (K / kChunk) * 2 * kChunkBytes, sp + t * 16, xp + m0 * K, K, xsp + m0,
                        op + (m0 * N + t * 16) * osize, bf16_out, N, btile, cbuf);
    }
    _tile_release();
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_amx_mm", &int8_amx_mm, "int8 weights (per-channel scale) x bf16 activations on AMX -> [k, N]");
  m.def("int4_amx_mm", &int4_amx_mm, "int4 weights x bf16 activations on AMX, [k, K] x [N, K]^T -> [k, N]");
  m.def("gguf_amx_mm", &gguf_amx_mm, "a GGUF tensor's blocks x bf16 activations on AMX -> [k, N]");
  m.def("available", &available, "whether this build and this CPU can run the kernel");
}
