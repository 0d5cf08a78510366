// A GGUF tensor's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) x bf16 activations on AMX tiles: the file's
// own numbers, not re-quantized, with scales exact in fp32.
//
// Weights, per group g of `group` (16 or 32) inputs (models/gguf_blocks.py maps every block type to this form):
//   W[n, c] = scale[n, g] * (code[n, c] + bias) + offset[n, g]
//   scale = float(d[n, s]) * float(sc[n, g]),  offset = float(dm[n, s]) * float(m[n, g]),  s = c / block
// (both products are exact in fp32: an fp16 times an integer of at most 8 bits).
// Codes: their low 4 bits in int4_amx.cpp's layout (`lo`: per N-tile of 16 outputs and chunk of 32 inputs, four loads
// of 32 16-bit words, nibble i of word w the B tile's row 4L + i); for 5-8 bit types the rest in `hi`, per word of
// `lo` the high bits of its nibble i at bit HS * i: HS = 2, one byte per word (5 and 6 bits), or HS = 4, 16 bits per
// word (8 bits). The B tile holds code + bias (4 and 8 bits; exact in bf16, magnitude <= 128) or, for 5 and 6 bits,
// 128 + code, whose bf16 bits are 0x4300 | code (no table): `offset` then subtracts (128 - bias) * scale.
// Scales per N-tile: d, dm [NT, K / block, 16] fp16 bits; sc [NT, K / group, 16] int8; m [NT, K / group, 16] uint8.
//
// Arithmetic, the same for every k (and in kernels/gguf_amx.py's `reference_mm`):
//   C[m, n]  = sum over group g's inputs c of x[m, c] * (code[n, c] + bias): products exact in fp32, the additions
//              inside one tile multiply ordered and rounded by the hardware, as in int4_amx.cpp
//   acc      = acc + C * scale;  acc = acc + xs[m, g] * offset'  (types with offsets, and 5 and 6 bits; xs: the
//              group's sum of x, as int4_amx.cpp's), offset' = offset - scale * (128 - bias) for 5 and 6 bits,
//              scale * (bias - 128) where they have no offset, else offset
// group after group. Each output row is the same sequence of operations whatever k is and whatever the other rows
// hold: bit-exact across k by construction. Built with -ffp-contract=off.

#include "amx.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

namespace {

using amx::kChunk, amx::kChunkBytes, amx::kMaxRows, amx::kPrefetch;

#ifdef SPECDECODE_AMX
struct Weights {  // one N-tile's
  const uint8_t* lo;
  const uint8_t* hi;
  const uint16_t* d;
  const int8_t* sc;
  const uint16_t* dm;  // nullptr: no offsets
  const uint8_t* m;
};

struct Shape {
  int64_t K, G, block, bias;  // G: groups per row
};

// entry j: bf16 of (j & 15) + bias, for 4-bit codes (vpermw reads 5 index bits, so the table repeats)
inline __m512i value_table(int bias) {
  alignas(64) uint16_t tab[32];
  for (int j = 0; j < 32; ++j) {
    const float f = static_cast<float>((j & 15) + bias);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    tab[j] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(tab);
}

// 32 codes + bias (int16, |v| <= 128) -> 32 bf16, exact
inline __m512i int16_to_bf16(__m512i v) {
  const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
  const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(f1, f0);
}

constexpr int hi_bytes(int HS) { return HS == 0 ? 0 : HS == 2 ? 128 : 256; }  // per chunk

// one chunk's codes (256 bytes of lo, hi_bytes(HS) of hi) -> the 1 KB B tile of values
template <int HS>
inline void dequantize_chunk(const uint8_t* lo, const uint8_t* hi, uint16_t* tile, __m512i table, __m512i bias) {
  const __m512i nib = _mm512_set1_epi16(0x0F);
  for (int L = 0; L < 4; ++L) {
    _mm_prefetch(reinterpret_cast<const char*>(lo + kPrefetch + 64 * L), _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(lo + 64 * L);
    if constexpr (HS == 0) {
      for (int i = 0; i < 4; ++i)
        _mm512_store_si512(tile + (4 * L + i) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4 * i), table));
    } else if constexpr (HS == 2) {  // bf16 bits 0x4300 | c are the number 128 + c (c < 128): no table
      if (L % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(hi + kPrefetch / 2 + 32 * L), _MM_HINT_T0);
      const __m512i h = _mm512_slli_epi16(
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + 32 * L))), 4);
      for (int i = 0; i < 4; ++i) {
        // bits 0-3 from the nibble, 4-5 from hi (0xE4: C ? A : B), then the rest cleared and 0x4300 set (0xEA)
        const __m512i code = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4 * i), _mm512_srli_epi16(h, 2 * i),
                                                       nib, 0xE4);
        _mm512_store_si512(tile + (4 * L + i) * 32,
                           _mm512_ternarylogic_epi32(code, _mm512_set1_epi16(0x3F), _mm512_set1_epi16(0x4300), 0xEA));
      }
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(hi + kPrefetch + 64 * L), _MM_HINT_T0);
      const __m512i h = _mm512_loadu_si512(hi + 64 * L);
      for (int i = 0; i < 4; ++i) {
        const __m512i code = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4 * i), nib),
                                             _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 4 * i), nib), 4));
        _mm512_store_si512(tile + (4 * L + i) * 32, int16_to_bf16(_mm512_add_epi16(code, bias)));
      }
    }
  }
}

// C tile `c` += group i's activations x its values (B tile rows of GROUP / 2 pair-rows at btile + i * GROUP * 16)
#define GROUP_MM(c, a, b, i)                                     \
  do {                                                           \
    _tile_loadd(a, x + (g0 + (i)) * GROUP, s.K * 2);             \
    _tile_loadd(b, btile + (i) * GROUP * 16, 64);                \
    _tile_dpbf16ps(c, a, b);                                     \
  } while (0)

// NG (1..4) groups from g0, each in its own C tile, then rescaled into acc
template <int M, int NG, int HS, int GROUP>
inline void groups(const Weights& w, const Shape& s, const uint16_t* x, const float* xs, int64_t g0, __m512* acc,
                   uint16_t* btile, float* cbuf, __m512i table, __m512i bias) {
  constexpr int chunks = (NG * GROUP + kChunk - 1) / kChunk;
  const int64_t c0 = g0 * GROUP / kChunk;
  _mm_prefetch(reinterpret_cast<const char*>(w.sc + g0 * 16 + 256), _MM_HINT_T0);  // 16 groups ahead
  if (w.dm != nullptr) _mm_prefetch(reinterpret_cast<const char*>(w.m + g0 * 16 + 256), _MM_HINT_T0);
  for (int i = 0; i < chunks; ++i)  // all first: a tile load of data just stored waits for the stores
    dequantize_chunk<HS>(w.lo + (c0 + i) * kChunkBytes, w.hi + (c0 + i) * hi_bytes(HS), btile + i * 512, table, bias);
  GROUP_MM(4, 0, 2, 0);
  if (NG > 1) GROUP_MM(5, 1, 3, 1);
  if (NG > 2) GROUP_MM(6, 0, 2, 2);
  if (NG > 3) GROUP_MM(7, 1, 3, 3);
  _tile_stored(4, cbuf, 64);
  _tile_zero(4);
  if (NG > 1) { _tile_stored(5, cbuf + 256, 64); _tile_zero(5); }
  if (NG > 2) { _tile_stored(6, cbuf + 512, 64); _tile_zero(6); }
  if (NG > 3) { _tile_stored(7, cbuf + 768, 64); _tile_zero(7); }
  for (int i = 0; i < NG; ++i) {
    const int64_t g = g0 + i, sb = g * GROUP / s.block;
    const __m512 scale = _mm512_mul_ps(
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + sb * 16))),
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + g * 16)))));
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_load_ps(cbuf + i * 256 + 16 * m), scale));
    if (w.dm != nullptr || HS == 2) {
      __m512 offset = _mm512_setzero_ps();
      if (w.dm != nullptr)
        offset = _mm512_mul_ps(
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.dm + sb * 16))),
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.m + g * 16)))));
      if constexpr (HS == 2)  // the tile held 128 + code, not code + bias
        offset = w.dm != nullptr ? _mm512_sub_ps(offset, _mm512_mul_ps(scale, _mm512_set1_ps(128.f - s.bias)))
                                 : _mm512_mul_ps(scale, _mm512_set1_ps(s.bias - 128.f));
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_set1_ps(xs[m * s.G + g]), offset));
    }
  }
}
#undef GROUP_MM

// 16 outputs for M rows
template <int M, int HS, int GROUP>
void n_tile(const Weights& w, const Shape& s, const uint16_t* x, const float* xs, void* out, bool bf16_out,
            int64_t ldo, uint16_t* btile, float* cbuf) {
  const __m512i table = value_table(static_cast<int>(s.bias));  // 4-bit codes only
  const __m512i bias = _mm512_set1_epi16(static_cast<int16_t>(s.bias));
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 4 <= s.G; g += 4) groups<M, 4, HS, GROUP>(w, s, x, xs, g, acc, btile, cbuf, table, bias);
  switch (s.G - g) {
    case 3: groups<M, 3, HS, GROUP>(w, s, x, xs, g, acc, btile, cbuf, table, bias); break;
    case 2: groups<M, 2, HS, GROUP>(w, s, x, xs, g, acc, btile, cbuf, table, bias); break;
    case 1: groups<M, 1, HS, GROUP>(w, s, x, xs, g, acc, btile, cbuf, table, bias); break;
    default: break;
  }
  for (int m = 0; m < M; ++m) amx::store_row(out, m, ldo, acc[m], bf16_out);
}

using TileFn = void (*)(const Weights&, const Shape&, const uint16_t*, const float*, void*, bool, int64_t, uint16_t*,
                        float*);
template <int HS, int GROUP, int... Ms>
constexpr std::array<TileFn, sizeof...(Ms) + 1> tile_fns(std::integer_sequence<int, Ms...>) {
  return {nullptr, n_tile<Ms + 1, HS, GROUP>...};
}
template <int HS, int GROUP>
constexpr auto kFns = tile_fns<HS, GROUP>(std::make_integer_sequence<int, kMaxRows>{});

TileFn tile_fn(int hs, int64_t group, int M) {
  if (group == 16) return hs == 0 ? kFns<0, 16>[M] : hs == 2 ? kFns<2, 16>[M] : kFns<4, 16>[M];
  return hs == 0 ? kFns<0, 32>[M] : hs == 2 ? kFns<2, 32>[M] : kFns<4, 32>[M];
}
#endif

}  // namespace

// x: [k, K] bf16; lo: [NT, K / 32, 256] uint8; hi: [NT, K / 32, 128 or 256] uint8 for 5 and 6 or 8 bits, else empty;
// d: [NT, K / block, 16] int16 (fp16 bits); sc: [NT, K / group, 16] int8; dm, m: like d and sc (uint8), or empty
// -> [k, 16 NT] float32, or bfloat16 if bf16_out
torch::Tensor gguf_amx_mm(torch::Tensor x, torch::Tensor lo, torch::Tensor hi, torch::Tensor d, torch::Tensor sc,
                          torch::Tensor dm, torch::Tensor m, int64_t group, int64_t block, int64_t bits, int64_t bias,
                          bool bf16_out) {
  TORCH_CHECK(available(), "the gguf-amx kernel needs a CPU with AMX-BF16 (and a Linux that grants it)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be [k, K] bfloat16");
  TORCH_CHECK(group == 16 || group == 32, "group must be 16 or 32");
  TORCH_CHECK(block % group == 0 && block % kChunk == 0, "block must be a multiple of the group and of 32");
  TORCH_CHECK(bits >= 4 && bits <= 8 && bias >= -128 && bias <= 0, "codes of 4 to 8 bits, bias -128..0");
  TORCH_CHECK(lo.dim() == 3 && lo.scalar_type() == torch::kUInt8 && lo.is_contiguous() && lo.size(2) == kChunkBytes,
              "lo must be contiguous [N / 16, K / 32, 256] uint8");
  const int64_t k = x.size(0), K = x.size(1), NT = lo.size(0), N = NT * 16, G = K / group, S = K / block;
  TORCH_CHECK(K % block == 0 && lo.size(1) * kChunk == K, "inputs of width ", K, " do not fit weights packed for ",
              lo.size(1) * kChunk);
  const int hs = bits == 4 ? 0 : bits <= 6 ? 2 : 4;
  if (hs)
    TORCH_CHECK(hi.scalar_type() == torch::kUInt8 && hi.is_contiguous() && hi.numel() == NT * (K / kChunk) * hs * 64,
                "hi must be contiguous uint8, ", hs * 64, " bytes per N-tile and chunk");
  TORCH_CHECK(d.scalar_type() == torch::kInt16 && d.is_contiguous() && d.numel() == NT * S * 16, "d must be [NT, S, 16]");
  TORCH_CHECK(sc.scalar_type() == torch::kInt8 && sc.is_contiguous() && sc.numel() == NT * G * 16,
              "sc must be [NT, G, 16] int8");
  const bool offsets = dm.numel() > 0, sums = offsets || hs == 2;  // xs: for offsets and for lifted codes
  if (offsets)
    TORCH_CHECK(dm.scalar_type() == torch::kInt16 && dm.is_contiguous() && dm.numel() == NT * S * 16 &&
                m.scalar_type() == torch::kUInt8 && m.is_contiguous() && m.numel() == NT * G * 16,
                "dm and m must be like d and sc");
  auto out = torch::empty({k, N}, bf16_out ? torch::kBFloat16 : torch::kFloat32);
#ifdef SPECDECODE_AMX
  const torch::Tensor xc = x.contiguous();
  auto xs = torch::empty({sums ? k : 0, G}, torch::kFloat32);
  if (sums) amx::group_sums(xc.data_ptr<at::BFloat16>(), k, K, group, xs.data_ptr<float>());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const Shape shape{K, G, block, bias};
  const int64_t chunks = K / kChunk;
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t osize = out.element_size();
  at::parallel_for(0, NT, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t btile[4 * 512];  // 4 groups of up to 32 inputs
    alignas(64) float cbuf[4 * 256];
    for (int64_t m0 = 0; m0 < k; m0 += kMaxRows) {
      const int M = static_cast<int>(std::min<int64_t>(kMaxRows, k - m0));
      amx::configure(M, static_cast<int>(group));
      const TileFn fn = tile_fn(hs, group, M);
      for (int64_t t = begin; t < end; ++t) {
        const Weights w{lo.data_ptr<uint8_t>() + t * chunks * kChunkBytes,
                        hs ? hi.data_ptr<uint8_t>() + t * chunks * hs * 64 : nullptr,
                        reinterpret_cast<const uint16_t*>(d.data_ptr<int16_t>()) + t * S * 16,
                        sc.data_ptr<int8_t>() + t * G * 16,
                        offsets ? reinterpret_cast<const uint16_t*>(dm.data_ptr<int16_t>()) + t * S * 16 : nullptr,
                        offsets ? m.data_ptr<uint8_t>() + t * G * 16 : nullptr};
        fn(w, shape, xp + m0 * K, sums ? xs.data_ptr<float>() + m0 * G : nullptr, op + (m0 * N + t * 16) * osize,
           bf16_out, N, btile, cbuf);
      }
    }
    _tile_release();
  });
#endif
  return out;
}
