// A GGUF tensor's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) x int8 activations, for CPUs without AMX:
// the file's own weights, not re-quantized, with activations quantized per token as llama.cpp's Q8 ones are.
// One arithmetic, in AVX-512 (VNNI or not), AVX2 and scalar code: the same bits on every path.
//
// Weights (kernels/gguf_int8.py packs them from models/gguf_blocks.Codes) in tiles of 16 rows, so that a vector
// holds one 32-bit lane per row and a row's output is one lane of one accumulator. Per tile, register after register
// (32 inputs of each of the 16 rows), a slice j of a register (its inputs 4j .. 4j + 3) is 64 bytes: byte 4r + i,
// input 4j + i of row r. Stored per register:
//   4, 5, 6 bits: 4 vectors of 64 bytes, vector v: slice 2v in the low nibbles, slice 2v + 1 in the high ones;
//     then bits 4 and up: 5 bits, 64 bytes, bit j of byte 4r + i is bit 4 of slice j's code (r, i);
//     6 bits, 2 vectors of 64 bytes, vector u: bits 2k, 2k + 1 of byte 4r + i are bits 4, 5 of slice 4u + k's code
//   8 bits: 8 vectors of 64 bytes, vector j: slice j, codes 0..255 (the file's int8 + 128)
// and per tile, block (32 inputs, or a super-block of 256 for the K types) and row d (and dm, for types with offsets)
// as float16 bits; the K types add integer sub-scales sc (and mins m) per tile, group (16 or 32 inputs) and row.
// In gguf_blocks' terms a weight is d * sc * (code + bias) + dm * m, with sc = m = 1 for the block-32 types.
// Activations (int8_act.h): per token and span of 256 inputs a scale A and q in -127..127; Qs: q's sums per 16 inputs.
//
// Arithmetic per output, token and block s, exact in int32:
//   J = sum over the block's groups g of sc_g * (sum of code * q over g)  +  bias * sum over g of sc_g * Qs(g)
//   M = sum over the block's groups g of m_g * Qs(g)                                (types with offsets; bias = 0)
// then in float32, block after block: acc = fma(float(J), d * A, acc); acc = fma(float(M), dm * A, acc) (offsets).
// Every output is the same sequence of operations whatever the number of tokens or rows in the call: bit-exact
// across k by construction. Built with -ffp-contract=off; the fused multiply-adds are explicit.
// Bounds: |J| <= 256 * 255 * 127 * 128 < 2^31; a code * q pair sum (AVX2) is at most 2 * 128 * 127 (int16).

#include "cpu_ops.h"
#include "int8_act.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <vector>

namespace {

constexpr int kTile = 16;  // rows per tile: one 32-bit lane each
constexpr int kReg = 32;  // inputs per register
constexpr int kSpan = 256;  // inputs per activation scale
constexpr int kChunk = 8;  // tokens per pass over a tile
constexpr int kMaxChunk = 10;  // up to this many in one pass (a verify of 9 rows: one pass; more spill registers)

// bytes per register of a tile
constexpr int reg_bytes(int bits) { return kTile * (bits == 4 ? 16 : bits == 5 ? 20 : bits == 6 ? 24 : 32); }

struct Tile {
  const uint8_t* w;  // codes, registers one after the other
  const uint16_t* d;  // [blocks][16] float16 bits
  const uint16_t* dm;  // [blocks][16] float16 bits (types with offsets)
  const int8_t* sc;  // [groups][16] (K types)
  const uint8_t* m;  // [groups][16] (K types with offsets)
};

struct Acts {  // k tokens' activations
  const int8_t* q;  // [k][K]
  const int16_t* qs;  // [k][K / 16]
  const float* a;  // [k][spans]
  int64_t K, spans;
};

struct Format {
  int bits, block, group, bias;
  bool offset;
};

inline float half(uint16_t bits) {
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline int32_t load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// both int16 halves of each 32-bit lane: v's low 16 bits
inline int32_t twice(int32_t v) { return static_cast<int32_t>(static_cast<uint32_t>(v & 0xFFFF) * 0x10001u); }

#if defined(SPECDECODE_HAS_AVX512)
#ifdef SPECDECODE_HAS_AVX512_VNNI
const char* kPath = "avx512-vnni";
#else
const char* kPath = "avx512";
#endif

// g += the 4-input dot products of each lane's unsigned codes u and the signed q (vpdpbusd)
inline __m512i dot4(__m512i g, __m512i u, __m512i q) {
#ifdef SPECDECODE_HAS_AVX512_VNNI
  return _mm512_dpbusd_epi32(g, u, q);
#else  // u <= 255, so u * q pairs can exceed int16: add the two halves of each pair in 32 bits
  const __m512i lo = _mm512_and_si512(u, _mm512_set1_epi16(0x00FF)), hi = _mm512_srli_epi16(u, 8);
  const __m512i qlo = _mm512_srai_epi16(_mm512_slli_epi16(q, 8), 8), qhi = _mm512_srai_epi16(q, 8);
  return _mm512_add_epi32(g, _mm512_add_epi32(_mm512_madd_epi16(lo, qlo), _mm512_madd_epi16(hi, qhi)));
#endif
}
// j += each lane's int16 pair times q's int16 pair (vpdpwssd)
inline __m512i dot2(__m512i j, __m512i c, __m512i q) {
#ifdef SPECDECODE_HAS_AVX512_VNNI
  return _mm512_dpwssd_epi32(j, c, q);
#else
  return _mm512_add_epi32(j, _mm512_madd_epi16(c, q));
#endif
}

// bits 4 and up of slice j, in place for an OR with its nibbles; p: the register's vectors of high bits
template <int Bits>
inline __m512i high_bits(const uint8_t* p, int j) {
  if constexpr (Bits == 5) {
    const __m512i h = _mm512_loadu_si512(p);
    const __m512i moved = j < 4 ? _mm512_slli_epi16(h, 4 - j) : _mm512_srli_epi16(h, j - 4);
    return _mm512_and_si512(moved, _mm512_set1_epi8(0x10));
  } else {
    const __m512i h = _mm512_loadu_si512(p + 64 * (j / 4));
    const int k = j % 4;
    const __m512i moved = k < 3 ? _mm512_slli_epi16(h, 4 - 2 * k) : _mm512_srli_epi16(h, 2);
    return _mm512_and_si512(moved, _mm512_set1_epi8(0x30));
  }
}

// slices 2v and 2v + 1 of the register at p
template <int Bits>
inline void load_slices(const uint8_t* p, int v, __m512i& s0, __m512i& s1) {
  if constexpr (Bits == 8) {
    s0 = _mm512_loadu_si512(p + 128 * v);
    s1 = _mm512_loadu_si512(p + 128 * v + 64);
  } else {
    const __m512i x = _mm512_loadu_si512(p + 64 * v), nib = _mm512_set1_epi8(0x0F);
    s0 = _mm512_and_si512(x, nib);
    s1 = _mm512_and_si512(_mm512_srli_epi16(x, 4), nib);
    if constexpr (Bits != 4) {
      s0 = _mm512_or_si512(s0, high_bits<Bits>(p + 256, 2 * v));
      s1 = _mm512_or_si512(s1, high_bits<Bits>(p + 256, 2 * v + 1));
    }
  }
}

// the coefficients of Qs for 16-input groups 2p, 2p + 1 of block s: one int16 pair per lane
inline __m512i coefficient_pair(const Tile& w, const Format& f, int64_t s, int p) {
  if (f.block == 32) return _mm512_set1_epi32(twice(f.offset ? 1 : f.bias));
  const int64_t g0 = (s * 256 + 32 * p) / f.group, g1 = (s * 256 + 32 * p + 16) / f.group;
  __m512i c0, c1;
  if (f.offset) {
    c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.m + g0 * kTile)));
    c1 = g1 == g0 ? c0 : _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.m + g1 * kTile)));
  } else {
    const __m512i bias = _mm512_set1_epi32(f.bias);
    c0 = _mm512_mullo_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + g0 * kTile))), bias);
    c1 = g1 == g0 ? c0 : _mm512_mullo_epi32(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + g1 * kTile))), bias);
  }
  return _mm512_or_si512(_mm512_and_si512(c0, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(c1, 16));
}

// T tokens' outputs of one tile of 16 rows
template <int T, int Bits>
void tile_chunk(const Tile& w, const Format& f, const Acts& x, int64_t t0, float* out, int64_t N,
                const uint8_t* ahead) {
  const int regs = f.block / kReg, slices = f.group / 4, pairs = f.block / 32;
  const bool ktype = f.block == 256;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  const uint8_t* p = w.w;
  for (int64_t s = 0; s < x.K / f.block; ++s) {
    __m512i J[T], G[T];
    for (int t = 0; t < T; ++t) J[t] = _mm512_setzero_si512();
    for (int r = 0; r < regs; ++r, p += reg_bytes(Bits)) {
      const int64_t reg = s * regs + r;
      if (ahead)
        for (int l = 0; l < reg_bytes(Bits); l += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + (p - w.w) + l), _MM_HINT_T0);
      for (int t = 0; t < T; ++t) G[t] = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) {
        __m512i s0, s1;
        load_slices<Bits>(p, v, s0, s1);
        const int8_t* q = x.q + (t0 * x.K) + reg * kReg + 8 * v;
        for (int t = 0; t < T; ++t, q += x.K) {
          G[t] = dot4(G[t], s0, _mm512_set1_epi32(load32(q)));
          G[t] = dot4(G[t], s1, _mm512_set1_epi32(load32(q + 4)));
        }
        if (ktype && (2 * v + 2) % slices == 0) {  // the end of a group: apply its sub-scale
          const int64_t g = (reg * kReg + 8 * v + 7) / f.group;
          const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + g * kTile)));
          for (int t = 0; t < T; ++t) {
            J[t] = _mm512_add_epi32(J[t], _mm512_mullo_epi32(G[t], sc));
            G[t] = _mm512_setzero_si512();
          }
        }
      }
      if (!ktype)
        for (int t = 0; t < T; ++t) J[t] = _mm512_add_epi32(J[t], G[t]);
    }
    // Qs's terms: into J (bias) or M (offsets, in G's registers)
    if (f.bias != 0 || f.offset) {
      for (int t = 0; t < T; ++t) G[t] = _mm512_setzero_si512();
      for (int pr = 0; pr < pairs; ++pr) {
        const __m512i c = coefficient_pair(w, f, s, pr);
        const int16_t* qs = x.qs + t0 * (x.K / 16) + s * f.block / 16 + 2 * pr;
        for (int t = 0; t < T; ++t, qs += x.K / 16) {
          const __m512i sums = _mm512_set1_epi32(load32(qs));
          if (f.offset) G[t] = dot2(G[t], c, sums);
          else J[t] = dot2(J[t], c, sums);
        }
      }
    }
    const int64_t span = s * f.block / kSpan;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + s * kTile)));
    const __m512 dm = f.offset ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.dm + s * kTile)))
                               : _mm512_setzero_ps();
    for (int t = 0; t < T; ++t) {
      const __m512 a = _mm512_set1_ps(x.a[(t0 + t) * x.spans + span]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(J[t]), _mm512_mul_ps(d, a), acc[t]);
      if (f.offset) acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(G[t]), _mm512_mul_ps(dm, a), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(out + (t0 + t) * N, acc[t]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
const char* kPath = "avx2";

// The same on AVX2, a tile as two halves of 8 rows. Without VNNI, codes * q in int16 pair sums (vpmaddubsw) times the
// sub-scales (vpmaddwd: no int32 multiply per group), 8-bit codes as signed code + bias (the bias then needs no Qs
// term: the same integer J).
template <int Bits>
inline __m256i high_bits(const uint8_t* p, int j) {
  if constexpr (Bits == 5) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i moved = j < 4 ? _mm256_slli_epi16(h, 4 - j) : _mm256_srli_epi16(h, j - 4);
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * (j / 4)));
    const int k = j % 4;
    const __m256i moved = k < 3 ? _mm256_slli_epi16(h, 4 - 2 * k) : _mm256_srli_epi16(h, 2);
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
  }
}

// slices 2v and 2v + 1 of the register at p, rows 8 * half .. 8 * half + 7 (the 8-bit ones as code + bias)
template <int Bits>
inline void load_slices(const uint8_t* p, int v, int half, __m256i& s0, __m256i& s1) {
  if constexpr (Bits == 8) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    s0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 * v + 32 * half)), flip);
    s1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 * v + 64 + 32 * half)), flip);
  } else {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * v + 32 * half));
    const __m256i nib = _mm256_set1_epi8(0x0F);
    s0 = _mm256_and_si256(x, nib);
    s1 = _mm256_and_si256(_mm256_srli_epi16(x, 4), nib);
    if constexpr (Bits != 4) {
      s0 = _mm256_or_si256(s0, high_bits<Bits>(p + 256 + 32 * half, 2 * v));
      s1 = _mm256_or_si256(s1, high_bits<Bits>(p + 256 + 32 * half, 2 * v + 1));
    }
  }
}

// one slice's codes u times one token's 4 q per lane, as vpmaddubsw's two int16 pair sums (8-bit codes signed: |u|
// times q with u's sign)
template <int Bits>
inline __m256i pair_sums(__m256i u, __m256i q) {
  if constexpr (Bits == 8) return _mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(q, u));
  else return _mm256_maddubs_epi16(u, q);
}

// per 32-bit lane, lo's low 16 bits in the low int16 and hi's in the high one
inline __m256i int16_pairs(__m256i lo, __m256i hi) {
  return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(hi, 16));
}

// a group's sub-scales for rows 8 * half .. 8 * half + 7, each in both int16 halves of its lane
inline __m256i group_scales(const int8_t* sc, int half) {
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * half)));
  return int16_pairs(v, v);
}

inline __m256i coefficient_pair(const Tile& w, const Format& f, int64_t s, int p, int half) {
  if (f.block == 32) return _mm256_set1_epi32(twice(f.offset ? 1 : f.bias));
  const int64_t g0 = (s * 256 + 32 * p) / f.group, g1 = (s * 256 + 32 * p + 16) / f.group;
  __m256i c0, c1;
  if (f.offset) {
    c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.m + g0 * kTile + 8 * half)));
    c1 = g1 == g0 ? c0 : _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.m + g1 * kTile + 8 * half)));
  } else {
    const __m256i bias = _mm256_set1_epi32(f.bias);
    c0 = _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + g0 * kTile + 8 * half))), bias);
    c1 = _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + g1 * kTile + 8 * half))), bias);
  }
  return int16_pairs(c0, c1);
}

// H halves of a tile at once: both for one or two tokens (fewer passes over the codes), one at a time for more
// (AVX2 has 16 registers)
template <int T, int Bits, int H = (T <= 2 ? 2 : 1)>
void tile_chunk(const Tile& w, const Format& f, const Acts& x, int64_t t0, float* out, int64_t N,
                const uint8_t* ahead) {
  const int regs = f.block / kReg, slices = f.group / 4, pairs = f.block / 32;
  const bool ktype = f.block == 256;
  const bool bias_term = f.bias != 0 && Bits != 8;  // 8-bit codes already hold their bias here
  for (int h0 = 0; h0 < 2; h0 += H) {
    __m256 acc[H][T];
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) acc[h][t] = _mm256_setzero_ps();
    const uint8_t* p = w.w;
    for (int64_t s = 0; s < x.K / f.block; ++s) {
      __m256i J[H][T], M[H][T];
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < T; ++t) J[h][t] = _mm256_setzero_si256();
      for (int r = 0; r < regs; ++r, p += reg_bytes(Bits)) {
        const int64_t reg = s * regs + r;
        if (ahead && h0 == 0)
          for (int l = 0; l < reg_bytes(Bits); l += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + (p - w.w) + l), _MM_HINT_T0);
        __m256i sc[H];
        for (int h = 0; h < H; ++h) sc[h] = _mm256_set1_epi16(1);
        for (int v = 0; v < 4; ++v) {
          for (int h = 0; h < H; ++h) {
            if (ktype && (2 * v) % slices == 0) sc[h] = group_scales(w.sc + (reg * kReg + 8 * v) / f.group * kTile, h0 + h);
            __m256i s0, s1;
            load_slices<Bits>(p, v, h0 + h, s0, s1);
            // the two slices' int16 sums added before vpmaddwd applies the sub-scale: at most 2 * 2 * 63 * 127
            // (6 bits), and the 8-bit codes' sums (up to 2 * 2 * 128 * 127) are kept apart
            const int8_t* q = x.q + (t0 * x.K) + reg * kReg + 8 * v;
            for (int t = 0; t < T; ++t, q += x.K) {
              const __m256i a0 = pair_sums<Bits>(s0, _mm256_set1_epi32(load32(q)));
              const __m256i a1 = pair_sums<Bits>(s1, _mm256_set1_epi32(load32(q + 4)));
              if constexpr (Bits == 8)
                J[h][t] = _mm256_add_epi32(J[h][t], _mm256_add_epi32(_mm256_madd_epi16(a0, sc[h]), _mm256_madd_epi16(a1, sc[h])));
              else
                J[h][t] = _mm256_add_epi32(J[h][t], _mm256_madd_epi16(_mm256_add_epi16(a0, a1), sc[h]));
            }
          }
        }
      }
      if (bias_term || f.offset) {
        for (int h = 0; h < H; ++h) {
          for (int t = 0; t < T; ++t) M[h][t] = _mm256_setzero_si256();
          for (int pr = 0; pr < pairs; ++pr) {
            const __m256i c = coefficient_pair(w, f, s, pr, h0 + h);
            const int16_t* qs = x.qs + t0 * (x.K / 16) + s * f.block / 16 + 2 * pr;
            for (int t = 0; t < T; ++t, qs += x.K / 16) {
              const __m256i prod = _mm256_madd_epi16(c, _mm256_set1_epi32(load32(qs)));
              if (f.offset) M[h][t] = _mm256_add_epi32(M[h][t], prod);
              else J[h][t] = _mm256_add_epi32(J[h][t], prod);
            }
          }
        }
      }
      const int64_t span = s * f.block / kSpan;
      for (int h = 0; h < H; ++h) {
        const int half = h0 + h;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d + s * kTile + 8 * half)));
        const __m256 dm = f.offset
            ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.dm + s * kTile + 8 * half)))
            : _mm256_setzero_ps();
        for (int t = 0; t < T; ++t) {
          const __m256 a = _mm256_set1_ps(x.a[(t0 + t) * x.spans + span]);
          acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(J[h][t]), _mm256_mul_ps(d, a), acc[h][t]);
          if (f.offset) acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M[h][t]), _mm256_mul_ps(dm, a), acc[h][t]);
        }
      }
    }
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + (t0 + t) * N + 8 * (h0 + h), acc[h][t]);
  }
}

#else  // the same arithmetic in scalar code
const char* kPath = "scalar";

// the coefficient of Qs of 16-input group h of block s for the tile's row r: bias * sc, or m (1 for the block-32
// types' offsets)
inline int32_t coefficient(const Tile& w, const Format& f, int64_t s, int h, int r) {
  if (f.block == 32) return f.offset ? 1 : f.bias;
  const int64_t g = (s * 256 + 16 * h) / f.group * kTile + r;
  return f.offset ? w.m[g] : f.bias * w.sc[g];
}

// the code of input j (0..31) of a register of a tile's row r (layout at the top)
template <int Bits>
inline int32_t code_at(const uint8_t* p, int r, int j) {
  const int slice = j / 4, byte = 4 * r + j % 4;
  if constexpr (Bits == 8) return p[64 * slice + byte];
  int32_t u = (p[64 * (slice / 2) + byte] >> (slice % 2 * 4)) & 0x0F;
  if constexpr (Bits == 5) u |= ((p[256 + byte] >> slice) & 1) << 4;
  if constexpr (Bits == 6) u |= ((p[256 + 64 * (slice / 4) + byte] >> (2 * (slice % 4))) & 3) << 4;
  return u;
}

template <int T, int Bits>
void tile_chunk(const Tile& w, const Format& f, const Acts& x, int64_t t0, float* out, int64_t N,
                const uint8_t* ahead) {
  const int regs = f.block / kReg;
  for (int r = 0; r < kTile; ++r) {
    for (int t = 0; t < T; ++t) {
      const int8_t* q = x.q + (t0 + t) * x.K;
      const int16_t* qs = x.qs + (t0 + t) * (x.K / 16);
      float acc = 0.f;
      const uint8_t* p = w.w;
      for (int64_t s = 0; s < x.K / f.block; ++s) {
        int32_t J = 0, M = 0;
        for (int i = 0; i < regs; ++i, p += reg_bytes(Bits)) {
          const int64_t reg = s * regs + i;
          for (int j = 0; j < kReg; ++j) {
            const int32_t sc = f.block == 256 ? w.sc[(reg * kReg + j) / f.group * kTile + r] : 1;
            J += sc * code_at<Bits>(p, r, j) * q[reg * kReg + j];
          }
        }
        for (int h = 0; h < f.block / 16; ++h) {
          const int32_t term = coefficient(w, f, s, h, r) * qs[s * f.block / 16 + h];
          if (f.offset) M += term;
          else J += term;
        }
        const float a = x.a[(t0 + t) * x.spans + s * f.block / kSpan];
        acc = std::fma(static_cast<float>(J), half(w.d[s * kTile + r]) * a, acc);
        if (f.offset) acc = std::fma(static_cast<float>(M), half(w.dm[s * kTile + r]) * a, acc);
      }
      out[(t0 + t) * N + r] = acc;
    }
  }
}
#endif

using TileFn = void (*)(const Tile&, const Format&, const Acts&, int64_t, float*, int64_t, const uint8_t*);

template <int Bits>
constexpr TileFn kChunks[kMaxChunk + 1] = {nullptr, tile_chunk<1, Bits>, tile_chunk<2, Bits>, tile_chunk<3, Bits>,
                                           tile_chunk<4, Bits>, tile_chunk<5, Bits>, tile_chunk<6, Bits>,
                                           tile_chunk<7, Bits>, tile_chunk<8, Bits>, tile_chunk<9, Bits>,
                                           tile_chunk<10, Bits>};

const TileFn* chunk_functions(int bits) {
  switch (bits) {
    case 4: return kChunks<4>;
    case 5: return kChunks<5>;
    case 6: return kChunks<6>;
    case 8: return kChunks<8>;
  }
  TORCH_CHECK(false, "no GGUF block type has ", bits, "-bit codes");
}

// k tokens' activations: q [k][K], their sums per 16 inputs, a scale per span of 256
struct Activations {
  std::vector<int8_t> q;
  std::vector<int16_t> qs;
  std::vector<float> a;
};

template <typename X>
void quantize(const X* x, int64_t k, int64_t K, Activations& act) {
  const int64_t spans = (K + kSpan - 1) / kSpan;
  act.q.assign(k * K, 0);
  act.qs.assign(k * (K / 16), 0);
  act.a.assign(k * spans, 0.f);
  at::parallel_for(0, k, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < K; ++i) row[i] = static_cast<float>(x[t * K + i]);  // exact from bfloat16
      int8_t* q = act.q.data() + t * K;
      for (int64_t s = 0; s < spans; ++s)
        act.a[t * spans + s] = quantize_span(row.data() + s * kSpan, std::min<int64_t>(kSpan, K - s * kSpan), q + s * kSpan);
      int16_t* qs = act.qs.data() + t * (K / 16);
      for (int64_t i = 0; i < K; ++i) qs[i / 16] = static_cast<int16_t>(qs[i / 16] + q[i]);
    }
  });
}

}  // namespace

namespace specdecode {

// x: [k, K] float32 or bfloat16; w: [N / 16, K / 32 * 16 * register bytes] uint8; d, dm: [N / 16, K / block, 16]
// int16 (float16 bits; dm empty without offsets); sc, m: [N / 16, K / group, 16] int8 (empty for the block-32 types)
// -> [k, N] float32 (N: whole tiles, the padding rows of the last one included)
torch::Tensor gguf_int8_mm(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor dm, torch::Tensor sc,
                           torch::Tensor m, int64_t bits, int64_t block, int64_t group, int64_t bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x must be [k, K] float32 or bfloat16");
  x = x.contiguous();
  const int64_t k = x.size(0), K = x.size(1), tiles = w.size(0);
  const bool ktype = block == 256, offset = dm.numel() > 0;
  const TileFn* chunks = chunk_functions(static_cast<int>(bits));
  TORCH_CHECK(K % block == 0 && (group == 16 || group == 32) && (block == 32 || block == 256) && w.dim() == 2 &&
              w.scalar_type() == torch::kUInt8 && w.is_contiguous() &&
              w.size(1) == K / kReg * reg_bytes(static_cast<int>(bits)),
              "codes must be contiguous [N / 16, K / 32 * ", reg_bytes(static_cast<int>(bits)), "] uint8 for K = ", K);
  TORCH_CHECK(d.scalar_type() == torch::kInt16 && d.is_contiguous() &&
              d.sizes() == torch::IntArrayRef({tiles, K / block, kTile}), "d must be contiguous [N / 16, K / block, 16] int16");
  TORCH_CHECK(!offset || (dm.scalar_type() == torch::kInt16 && dm.is_contiguous() && dm.sizes() == d.sizes()),
              "dm must be like d");
  TORCH_CHECK(!ktype || (sc.scalar_type() == torch::kInt8 && sc.is_contiguous() &&
                         sc.sizes() == torch::IntArrayRef({tiles, K / group, kTile})),
              "sc must be contiguous [N / 16, K / group, 16] int8");
  TORCH_CHECK(!(ktype && offset) || (m.scalar_type() == torch::kInt8 && m.is_contiguous() && m.sizes() == sc.sizes()),
              "m must be like sc");
  Activations act;
  if (x.scalar_type() == torch::kFloat32) quantize(x.data_ptr<float>(), k, K, act);
  else quantize(x.data_ptr<at::BFloat16>(), k, K, act);
  const int64_t N = tiles * kTile;
  torch::Tensor out = torch::empty({k, N}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  const Format f{static_cast<int>(bits), static_cast<int>(block), static_cast<int>(group), static_cast<int>(bias), offset};
  const Acts acts{act.q.data(), act.qs.data(), act.a.data(), K, (K + kSpan - 1) / kSpan};
  const int64_t tile_bytes = w.size(1), nb = K / block * kTile, ng = K / group * kTile;
  const auto* wp = w.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<int16_t>());
  const auto* dmp = offset ? reinterpret_cast<const uint16_t*>(dm.data_ptr<int16_t>()) : nullptr;
  const int8_t* scp = ktype ? sc.data_ptr<int8_t>() : nullptr;
  const auto* mp = ktype && offset ? reinterpret_cast<const uint8_t*>(m.data_ptr<int8_t>()) : nullptr;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Tile tile{wp + i * tile_bytes, dp + i * nb, dmp ? dmp + i * nb : nullptr, scp ? scp + i * ng : nullptr,
                      mp ? mp + i * ng : nullptr};
      // the next tile's codes are fetched while the first pass over this one computes
      const uint8_t* ahead = i + 1 < end ? tile.w + tile_bytes : nullptr;
      const int64_t chunk = k <= kMaxChunk ? k : kChunk;
      for (int64_t t0 = 0; t0 < k; t0 += chunk)
        chunks[std::min<int64_t>(chunk, k - t0)](tile, f, acts, t0, o + i * kTile, N, t0 == 0 ? ahead : nullptr);
    }
  });
  return out;
}

void bind_gguf_int8(pybind11::module_& m) {
  m.def("gguf_int8_mm", &gguf_int8_mm, "a GGUF tensor's blocks x int8 activations: [k, K] x [N, K]^T -> [k, rows]");
  m.def("gguf_simd_path", [] { return std::string(kPath); }, "which instruction set gguf_int8_mm was built for");
}

}  // namespace specdecode
