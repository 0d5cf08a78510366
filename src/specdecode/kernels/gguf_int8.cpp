// A GGUF tensor's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) x int8 activations, for CPUs without AMX:
// the file's own weights, not re-quantized, with activations quantized per token as llama.cpp's Q8 ones are.
// One arithmetic, in AVX-512 (VNNI or not) for the K types, AVX2, and scalar code: the same bits on every path.
//
// Weights (kernels/gguf_int8.py packs them from models/gguf_blocks.Codes), per row, in registers of 32 inputs:
//   K types (Q4_K, Q5_K, Q6_K), per pair of registers (64 inputs): 32 bytes, byte i: the code of input i in its low
//     nibble, of input 32 + i in its high one; then bits 4 and up of inputs 0..31, then of 32..63, as below
//   block-32 types, per register: 16 bytes, byte i: input i in the low nibble, input 16 + i in the high one; then
//     its bits 4 and up; 8 bits: 32 signed bytes, code + bias (Q8_0's int8 as stored)
//   bits 4 and up of a register: 5 bits: 4 bytes, bit j of their little-endian uint32 is bit 4 of input j;
//     6 bits: 8 bytes, bits 2k, 2k + 1 of byte i are bits 4, 5 of input 8k + i
// and per block of the type (32 inputs, or a super-block of 256 for the K types) d (and, for types with offsets, dm)
// as float16 bits; the K types add integer sub-scales sc (and mins m) per group of 16 or 32 inputs. In gguf_blocks'
// terms a weight is d * sc * (code + bias) + dm * m, with sc = m = 1 for the block-32 types.
// Activations (int8_act.h): per token and span of 256 inputs a scale A and q in -127..127; Qs: q's sums per 16 inputs.
//
// Arithmetic per output, token and block s, in 8 int32 lanes (lane l: inputs 4l .. 4l + 3 of each register), exact:
//   J[l] = sum over the block's registers of sc(group) * (sum of code * q over the lane's inputs)
//          + bias * sum over groups g = 2l, 2l + 1 (of 16 inputs, counted in the block) of sc_g * Qs_g
//   M[l] = sum over the same groups of m_g * Qs_g                                         (types with offsets)
// then in float32, block after block: acc[l] = acc[l] + float(J[l]) * (d * A);  acc[l] = acc[l] + float(M[l]) * (dm * A)
// and out = acc[0] + acc[1] + ... + acc[7], left to right. Every output is the same sequence of operations whatever
// the number of tokens: bit-exact across k by construction. Built with -ffp-contract=off.
// Bounds: a code * q pair sum is at most 2 * 128 * 127 (int16: vpmaddubsw does not saturate), |sc| <= 128.

#include "int8_act.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <vector>

namespace {

constexpr int kReg = 32;  // inputs per register
constexpr int kSpan = 256;  // inputs per activation scale
constexpr int kMaxChunk = 8;  // tokens per pass over a weight row
constexpr int64_t kRowBlock = 16;  // weight rows per task
constexpr int kPrefetch = 1024;  // bytes ahead in a row's codes

constexpr int reg_bytes(int bits) { return bits == 4 ? 16 : bits == 5 ? 20 : bits == 6 ? 24 : 32; }

struct Row {
  const uint8_t* w;  // codes
  const uint16_t* d;  // per block, float16 bits
  const uint16_t* dm;  // per block, float16 bits (types with offsets)
  const int8_t* sc;  // per group (K types)
  const int8_t* m;  // per group (K types with offsets)
};

struct Chunk {  // up to kMaxChunk tokens' activations
  const int8_t* q;  // [pairs of registers][kMaxChunk][64]
  const int16_t* qs;  // [spans][kMaxChunk][16]
  const float* a;  // [spans][kMaxChunk]
};

struct Shape {
  int64_t K;
  int group, bias;
};

inline float half(uint16_t bits) {
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}


constexpr int high_bytes(int bits) { return bits == 5 ? 4 : bits == 6 ? 8 : 0; }  // per register

#if defined(__AVX2__) && defined(__FMA__)
// bits 4 and up of a register's 32 codes (5 or 6 bits), in place for an OR with their nibbles
template <int Bits>
inline __m256i high_bits(const uint8_t* h) {
  if constexpr (Bits == 5) {
    uint32_t v;
    std::memcpy(&v, h, 4);
    const __m256i bytes = _mm256_shuffle_epi8(  // byte j: byte j / 8 of v
        _mm256_set1_epi32(static_cast<int32_t>(v)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
  } else if constexpr (Bits == 6) {
    int64_t v;
    std::memcpy(&v, h, 8);
    const __m256i two = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(v), _mm256_setr_epi64x(0, 2, 4, 6)),
                                         _mm256_set1_epi8(3));
    return _mm256_slli_epi16(two, 4);
  } else {
    return _mm256_setzero_si256();
  }
}

// a K type's pair of registers at p -> the codes of inputs 0..31 (u0) and 32..63 (u1)
template <int Bits>
inline void load_pair(const uint8_t* p, __m256i& u0, __m256i& u1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), nib = _mm256_set1_epi8(0x0F);
  u0 = _mm256_and_si256(v, nib);
  u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
  if constexpr (Bits != 4) {
    u0 = _mm256_or_si256(u0, high_bits<Bits>(p + 32));
    u1 = _mm256_or_si256(u1, high_bits<Bits>(p + 32 + high_bytes(Bits)));
  }
}

// a block-32 type's register at p -> its 32 codes: unsigned (4, 5 bits) or signed (8 bits)
template <int Bits>
inline __m256i load_register(const uint8_t* p) {
  if constexpr (Bits == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), nib = _mm_set1_epi8(0x0F);
    const __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), nib), _mm_and_si128(v, nib));
    return Bits == 4 ? u : _mm256_or_si256(u, high_bits<Bits>(p + 16));
  }
}

// one register's codes times one token's 32 q -> 16 int16 pair sums
template <int Bits>
inline __m256i products(__m256i u, __m256i q) {
  if constexpr (Bits == 8) return _mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(q, u));
  else return _mm256_maddubs_epi16(u, q);
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// A super-block's int8 sub-scales (8 for groups of 32, 16 for groups of 16), in both halves of a register
inline __m256i block_scales(const int8_t* sc, int group) {
  return _mm256_broadcastsi128_si256(group == 32 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))
                                                 : _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
}
// vpshufb masks [groups of 32][register r of the block]: byte i, the index of the sub-scale of inputs 2i, 2i + 1
alignas(16) constexpr int8_t kScaleOf[2][8][16] = {
    {{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1}, {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
     {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5}, {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
     {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9}, {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
     {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
     {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}},  // groups of 16
    {{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
     {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2}, {3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3},
     {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4}, {5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5},
     {6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6}, {7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7}}};  // of 32

// registers r and r + 1 of a block: per int16 pair of each, the sub-scale of its inputs' group (16 or 32 inputs)
inline __m256i register_pair_scales(__m256i scales, int r, int group) {
  const int8_t (*masks)[16] = kScaleOf[group == 32];
  const __m256i mask = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(masks[r + 1]),
                                           reinterpret_cast<const __m128i*>(masks[r]));
  return _mm256_shuffle_epi8(scales, mask);  // bytes: [register r's 16 int16 | register r + 1's], as int8
}

// sc (or m) of a super-block's 16 groups of 16 inputs as int16, from its values per `group` (16 or 32) inputs
inline __m256i groups16(const int8_t* v, int group) {
  if (group == 16) return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
  const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v)));
  return _mm256_set_m128i(_mm_unpackhi_epi16(w, w), _mm_unpacklo_epi16(w, w));
}

// AVX2: a block's sub-scales as int16 in both 128-bit halves, 8 groups per register: the K types with groups of 32
// hold all 8 in each; with groups of 16, half h of the block (registers 4h .. 4h + 3) holds groups 8h .. 8h + 7
template <int Group>
inline void block_scales16(const int8_t* sc, __m256i* halves) {
  for (int h = 0; h < (Group == 16 ? 2 : 1); ++h)
    halves[h] = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * h))));
}
// vpshufb masks [groups of 32][register r of the block]: int16 i, the sub-scale of inputs 2i, 2i + 1 in those halves
alignas(32) constexpr int8_t kScale16Of[2][8][32] = {
#define SPECDECODE_W(g) 2 * (g), 2 * (g) + 1
#define SPECDECODE_8(g) SPECDECODE_W(g), SPECDECODE_W(g), SPECDECODE_W(g), SPECDECODE_W(g), SPECDECODE_W(g), \
                        SPECDECODE_W(g), SPECDECODE_W(g), SPECDECODE_W(g)
#define SPECDECODE_16(r) {SPECDECODE_8(2 * (r) % 8), SPECDECODE_8((2 * (r) + 1) % 8)}
#define SPECDECODE_32(r) {SPECDECODE_8(r), SPECDECODE_8(r)}
    {SPECDECODE_16(0), SPECDECODE_16(1), SPECDECODE_16(2), SPECDECODE_16(3), SPECDECODE_16(4), SPECDECODE_16(5),
     SPECDECODE_16(6), SPECDECODE_16(7)},
    {SPECDECODE_32(0), SPECDECODE_32(1), SPECDECODE_32(2), SPECDECODE_32(3), SPECDECODE_32(4), SPECDECODE_32(5),
     SPECDECODE_32(6), SPECDECODE_32(7)}};
#undef SPECDECODE_32
#undef SPECDECODE_16
#undef SPECDECODE_8
#undef SPECDECODE_W

// register r of a block: per int16 pair, the sub-scale of its inputs' group
template <int Group>
inline __m256i register_scales16(const __m256i* halves, int r) {
  return _mm256_shuffle_epi8(halves[Group == 16 ? r / 4 : 0],
                             _mm256_load_si256(reinterpret_cast<const __m256i*>(kScale16Of[Group == 32][r])));
}

// block s's float steps for T tokens, given their exact code * q lanes J
template <int T, bool KType, bool Offset>
inline void add_block(const Row& row, const Shape& sh, const Chunk& c, int64_t s, const __m256i* J, __m256* acc) {
  constexpr int block = KType ? 256 : 32;
  const int64_t span = s * block / kSpan, first = s * block % kSpan / 16;  // the block's first 16-group in its span
  const float d = half(row.d[s]), dm = Offset ? half(row.dm[s]) : 0.f;
  __m256i bias_sc = _mm256_setzero_si256(), mins = _mm256_setzero_si256();  // per 16-group of the block
  if constexpr (KType) {
    if constexpr (Offset) mins = groups16(row.m + s * block / sh.group, sh.group);
    else bias_sc = _mm256_mullo_epi16(groups16(row.sc + s * block / sh.group, sh.group),
                                      _mm256_set1_epi16(static_cast<int16_t>(sh.bias)));
  } else {  // groups 0 and 1 (lane 0), sc = m = 1
    const auto b = static_cast<int16_t>(sh.bias);
    bias_sc = _mm256_setr_epi16(b, b, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    mins = _mm256_setr_epi16(1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  }
  for (int t = 0; t < T; ++t) {
    const int16_t* qs = c.qs + (span * kMaxChunk + t) * 16 + first;
    const __m256i sums = KType ? load256(qs) : _mm256_setr_epi16(qs[0], qs[1], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const float a = c.a[span * kMaxChunk + t];
    const __m256i j = Offset ? J[t] : _mm256_add_epi32(J[t], _mm256_madd_epi16(bias_sc, sums));  // no type has both
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(j), _mm256_set1_ps(d * a), acc[t]);
    if constexpr (Offset)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mins, sums)), _mm256_set1_ps(dm * a), acc[t]);
  }
}

template <int T>
inline void store_sums(const __m256* acc, float* out, int64_t ostride) {
  alignas(32) float lanes[8];
  for (int t = 0; t < T; ++t) {
    _mm256_store_ps(lanes, acc[t]);
    float sum = lanes[0];
    for (int l = 1; l < 8; ++l) sum = sum + lanes[l];
    out[t * ostride] = sum;
  }
}

// The block-32 types, and on AVX2 CPUs the K types: a register's code * q products in 8 int32 lanes
template <int T, int Bits, bool KType, bool Offset>
void row_chunk_avx2(const Row& row, const Shape& sh, const Chunk& c, float* out, int64_t ostride) {
  constexpr int block = KType ? 256 : 32;
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* w = row.w;
  for (int64_t s = 0; s < sh.K / block; ++s) {
    __m256i J[T];
    for (int t = 0; t < T; ++t) J[t] = _mm256_setzero_si256();
    if constexpr (KType) {
      constexpr int group = Bits == 6 ? 16 : 32;  // Q6_K; Q4_K and Q5_K
      __m256i halves[2];
      block_scales16<group>(row.sc + s * 256 / group, halves);
      for (int r = 0; r < 8; r += 2, w += 2 * reg_bytes(Bits)) {
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
        __m256i u0, u1;
        load_pair<Bits>(w, u0, u1);
        const __m256i sc0 = register_scales16<group>(halves, r), sc1 = register_scales16<group>(halves, r + 1);
        const int8_t* a = c.q + (s * 4 + r / 2) * kMaxChunk * 64;
        for (int t = 0; t < T; ++t, a += 64)
          J[t] = _mm256_add_epi32(J[t], _mm256_add_epi32(_mm256_madd_epi16(products<Bits>(u0, load256(a)), sc0),
                                                         _mm256_madd_epi16(products<Bits>(u1, load256(a + 32)), sc1)));
      }
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
      const __m256i u = load_register<Bits>(w);
      w += reg_bytes(Bits);
      const int8_t* a = c.q + s / 2 * kMaxChunk * 64 + s % 2 * 32;
      for (int t = 0; t < T; ++t, a += 64)
        J[t] = _mm256_add_epi32(J[t], _mm256_madd_epi16(products<Bits>(u, load256(a)), ones));
    }
    add_block<T, KType, Offset>(row, sh, c, s, J, acc);
  }
  store_sums<T>(acc, out, ostride);
}

#ifdef SPECDECODE_HAS_AVX512
#ifdef SPECDECODE_HAS_AVX512_VNNI
const char* kPath = "avx512-vnni";
#else
const char* kPath = "avx512";
#endif

// The K types on AVX-512 CPUs: a pair of registers per 512-bit multiply; vpdpwssd (VNNI) applies the sub-scales
// and accumulates in one instruction. Folding the two halves at the end of a block gives each of the 8 lanes the
// same integers as the AVX2 code, so the same floats follow: the same bits on every path.
template <int T, int Bits, bool Offset>
void row_chunk_avx512(const Row& row, const Shape& sh, const Chunk& c, float* out, int64_t ostride) {
  static_assert(Bits < 8, "the K types' codes are unsigned");
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  const uint8_t* w = row.w;
  for (int64_t s = 0; s < sh.K / 256; ++s) {
    __m512i J[T];
    for (int t = 0; t < T; ++t) J[t] = _mm512_setzero_si512();
    const __m256i scales = block_scales(row.sc + s * 256 / sh.group, sh.group);
    for (int64_t pair = s * 4; pair < s * 4 + 4; ++pair, w += 2 * reg_bytes(Bits)) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
      __m256i u0, u1;
      load_pair<Bits>(w, u0, u1);
      const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1);
      const __m512i sc =
          _mm512_cvtepi8_epi16(register_pair_scales(scales, static_cast<int>(2 * (pair - s * 4)), sh.group));
      const int8_t* a = c.q + pair * kMaxChunk * 64;
      for (int t = 0; t < T; ++t, a += 64) {
        const __m512i p = _mm512_maddubs_epi16(u, _mm512_loadu_si512(a));
#ifdef SPECDECODE_HAS_AVX512_VNNI
        J[t] = _mm512_dpwssd_epi32(J[t], p, sc);
#else
        J[t] = _mm512_add_epi32(J[t], _mm512_madd_epi16(p, sc));
#endif
      }
    }
    __m256i folded[T];
    for (int t = 0; t < T; ++t)
      folded[t] = _mm256_add_epi32(_mm512_castsi512_si256(J[t]), _mm512_extracti64x4_epi64(J[t], 1));
    add_block<T, true, Offset>(row, sh, c, s, folded, acc);
  }
  store_sums<T>(acc, out, ostride);
}

template <int T, int Bits, bool KType, bool Offset>
void row_chunk(const Row& row, const Shape& sh, const Chunk& c, float* out, int64_t ostride) {
  if constexpr (KType) row_chunk_avx512<T, Bits, Offset>(row, sh, c, out, ostride);
  else row_chunk_avx2<T, Bits, KType, Offset>(row, sh, c, out, ostride);
}
#else
const char* kPath = "avx2";

template <int T, int Bits, bool KType, bool Offset>
void row_chunk(const Row& row, const Shape& sh, const Chunk& c, float* out, int64_t ostride) {
  row_chunk_avx2<T, Bits, KType, Offset>(row, sh, c, out, ostride);
}
#endif

#else  // the same arithmetic in scalar code
const char* kPath = "scalar";

// the code (code + bias for 8 bits) of input j of register `reg` of a row's codes w (layout at the top)
template <int Bits, bool KType>
inline int32_t code_at(const uint8_t* w, int64_t reg, int j) {
  if constexpr (Bits == 8) return reinterpret_cast<const int8_t*>(w + reg * kReg)[j];
  int32_t u;
  const uint8_t* high;
  if constexpr (KType) {  // pairs of registers
    const uint8_t* p = w + reg / 2 * 2 * reg_bytes(Bits);
    u = (p[j] >> (reg % 2 * 4)) & 0x0F;
    high = p + 32 + reg % 2 * high_bytes(Bits);
  } else {
    const uint8_t* p = w + reg * reg_bytes(Bits);
    u = (p[j % 16] >> (j / 16 * 4)) & 0x0F;
    high = p + 16;
  }
  if constexpr (Bits == 5) u |= ((high[j / 8] >> (j % 8)) & 1) << 4;
  if constexpr (Bits == 6) u |= ((high[j % 8] >> (2 * (j / 8))) & 3) << 4;
  return u;
}

template <int T, int Bits, bool KType, bool Offset>
void row_chunk(const Row& row, const Shape& sh, const Chunk& c, float* out, int64_t ostride) {
  constexpr int block = KType ? 256 : 32, regs = block / kReg;
  float acc[T][8] = {};
  const int64_t blocks = sh.K / block;
  for (int64_t s = 0; s < blocks; ++s) {
    int32_t J[T][8] = {};
    for (int r = 0; r < regs; ++r) {
      const int64_t reg = s * regs + r;
      for (int t = 0; t < T; ++t) {
        const int8_t* q = c.q + (reg / 2 * kMaxChunk + t) * 64 + reg % 2 * 32;
        for (int j = 0; j < kReg; ++j) {
          const int32_t sc = KType ? row.sc[(reg * kReg + j) / sh.group] : 1;
          J[t][j / 4] += sc * code_at<Bits, KType>(row.w, reg, j) * q[j];
        }
      }
    }
    const int64_t span = s * block / kSpan, first = s * block % kSpan / 16;
    const float d = half(row.d[s]), dm = Offset ? half(row.dm[s]) : 0.f;
    int16_t sc16[16] = {}, m16[16] = {};  // per 16-group of the block
    if constexpr (KType) {
      for (int g = 0; g < 16; ++g) {
        sc16[g] = row.sc[(s * block + 16 * g) / sh.group];
        if constexpr (Offset) m16[g] = row.m[(s * block + 16 * g) / sh.group];
      }
    } else {
      sc16[0] = sc16[1] = 1;
      if constexpr (Offset) m16[0] = m16[1] = 1;
    }
    for (int t = 0; t < T; ++t) {
      const int16_t* qs = c.qs + (span * kMaxChunk + t) * 16 + first;
      const int groups = KType ? 16 : 2;
      int32_t M[8] = {};
      for (int g = 0; g < groups; ++g) {
        J[t][g / 2] += sh.bias * sc16[g] * qs[g];
        M[g / 2] += m16[g] * qs[g];
      }
      const float a = c.a[span * kMaxChunk + t];
      for (int l = 0; l < 8; ++l) {
        acc[t][l] = std::fma(static_cast<float>(J[t][l]), d * a, acc[t][l]);
        if constexpr (Offset) acc[t][l] = std::fma(static_cast<float>(M[l]), dm * a, acc[t][l]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    float sum = acc[t][0];
    for (int l = 1; l < 8; ++l) sum = sum + acc[t][l];
    out[t * ostride] = sum;
  }
}
#endif

using RowFn = void (*)(const Row&, const Shape&, const Chunk&, float*, int64_t);

template <int Bits, bool KType, bool Offset>
constexpr RowFn kChunks[kMaxChunk + 1] = {nullptr, row_chunk<1, Bits, KType, Offset>, row_chunk<2, Bits, KType, Offset>,
                                          row_chunk<3, Bits, KType, Offset>, row_chunk<4, Bits, KType, Offset>,
                                          row_chunk<5, Bits, KType, Offset>, row_chunk<6, Bits, KType, Offset>,
                                          row_chunk<7, Bits, KType, Offset>, row_chunk<8, Bits, KType, Offset>};

const RowFn* chunk_functions(int bits, bool ktype, bool offset) {
  if (ktype) {
    if (bits == 4 && offset) return kChunks<4, true, true>;
    if (bits == 5 && offset) return kChunks<5, true, true>;
    if (bits == 6 && !offset) return kChunks<6, true, false>;
  } else {
    if (bits == 4) return offset ? kChunks<4, false, true> : kChunks<4, false, false>;
    if (bits == 5) return offset ? kChunks<5, false, true> : kChunks<5, false, false>;
    if (bits == 8 && !offset) return kChunks<8, false, false>;
  }
  TORCH_CHECK(false, "no GGUF block type has ", bits, " bits with ", ktype ? "super-blocks" : "blocks of 32",
              offset ? " and offsets" : "");
}

// k tokens' activations in the chunk layout (see Chunk), chunks of kMaxChunk tokens one after the other
struct Activations {
  std::vector<int8_t> q;
  std::vector<int16_t> qs;
  std::vector<float> a;
};

template <typename X>
void quantize(const X* x, int64_t k, int64_t K, Activations& act) {
  const int64_t regs = K / kReg, pairs = (regs + 1) / 2, spans = (K + kSpan - 1) / kSpan;
  const int64_t chunks = (k + kMaxChunk - 1) / kMaxChunk;
  act.q.assign(chunks * pairs * kMaxChunk * 64, 0);
  act.qs.assign(chunks * spans * kMaxChunk * 16, 0);
  act.a.assign(chunks * spans * kMaxChunk, 0.f);
  std::vector<float> row(K);
  std::vector<int8_t> q(K);
  for (int64_t t = 0; t < k; ++t) {
    for (int64_t i = 0; i < K; ++i) row[i] = static_cast<float>(x[t * K + i]);  // exact from bfloat16
    const int64_t chunk = t / kMaxChunk, tt = t % kMaxChunk;
    for (int64_t s = 0; s < spans; ++s) {
      const int64_t n = std::min<int64_t>(kSpan, K - s * kSpan);
      act.a[(chunk * spans + s) * kMaxChunk + tt] = quantize_span(row.data() + s * kSpan, n, q.data() + s * kSpan);
      int16_t* qs = act.qs.data() + ((chunk * spans + s) * kMaxChunk + tt) * 16;
      for (int64_t i = 0; i < n; ++i) qs[i / 16] = static_cast<int16_t>(qs[i / 16] + q[s * kSpan + i]);
    }
    for (int64_t r = 0; r < regs; ++r)
      std::memcpy(act.q.data() + ((chunk * pairs + r / 2) * kMaxChunk + tt) * 64 + r % 2 * kReg, q.data() + r * kReg,
                  kReg);
  }
}

}  // namespace

// x: [k, K] float32 or bfloat16; w: [N, K / 32 * register bytes] uint8; d, dm: [N, K / block] int16 (float16 bits;
// dm empty without offsets); sc, m: [N, K / group] int8 (empty for the block-32 types) -> [k, N] float32
torch::Tensor gguf_int8_mm(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor dm, torch::Tensor sc,
                           torch::Tensor m, int64_t bits, int64_t block, int64_t group, int64_t bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x must be [k, K] float32 or bfloat16");
  x = x.contiguous();
  const int64_t k = x.size(0), K = x.size(1), N = w.size(0);
  const bool ktype = block == 256, offset = dm.numel() > 0;
  const RowFn* chunks = chunk_functions(static_cast<int>(bits), ktype, offset);
  TORCH_CHECK(K % block == 0 && (group == 16 || group == 32) && w.dim() == 2 && w.scalar_type() == torch::kUInt8 &&
              w.is_contiguous() && w.size(1) == K / kReg * reg_bytes(static_cast<int>(bits)),
              "codes must be contiguous [N, K / 32 * ", reg_bytes(static_cast<int>(bits)), "] uint8 for K = ", K);
  TORCH_CHECK(d.scalar_type() == torch::kInt16 && d.is_contiguous() && d.sizes() == torch::IntArrayRef({N, K / block}),
              "d must be contiguous [N, K / block] int16 (float16 bits)");
  TORCH_CHECK(!offset || (dm.scalar_type() == torch::kInt16 && dm.is_contiguous() && dm.sizes() == d.sizes()),
              "dm must be like d");
  TORCH_CHECK(!ktype || (sc.scalar_type() == torch::kInt8 && sc.is_contiguous() &&
                         sc.sizes() == torch::IntArrayRef({N, K / group})), "sc must be contiguous [N, K / group] int8");
  TORCH_CHECK(!(ktype && offset) || (m.scalar_type() == torch::kInt8 && m.is_contiguous() && m.sizes() == sc.sizes()),
              "m must be like sc");
  Activations act;
  if (x.scalar_type() == torch::kFloat32) quantize(x.data_ptr<float>(), k, K, act);
  else quantize(x.data_ptr<at::BFloat16>(), k, K, act);
  torch::Tensor out = torch::empty({k, N}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  const Shape shape{K, static_cast<int>(group), static_cast<int>(bias)};
  const int64_t row_bytes = w.size(1), nb = K / block, ng = K / group, pairs = (K / kReg + 1) / 2;
  const int64_t spans = (K + kSpan - 1) / kSpan;
  const auto* wp = w.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<int16_t>());
  const auto* dmp = offset ? reinterpret_cast<const uint16_t*>(dm.data_ptr<int16_t>()) : nullptr;
  const int8_t* scp = ktype ? sc.data_ptr<int8_t>() : nullptr;
  const int8_t* mp = ktype && offset ? m.data_ptr<int8_t>() : nullptr;
  at::parallel_for(0, N, kRowBlock, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kRowBlock) {
      const int64_t n1 = std::min(end, n0 + kRowBlock);
      for (int64_t t0 = 0; t0 < k; t0 += kMaxChunk) {
        const int64_t T = std::min<int64_t>(kMaxChunk, k - t0), chunk = t0 / kMaxChunk;
        const Chunk c{act.q.data() + chunk * pairs * kMaxChunk * 64, act.qs.data() + chunk * spans * kMaxChunk * 16,
                      act.a.data() + chunk * spans * kMaxChunk};
        for (int64_t n = n0; n < n1; ++n) {
          const Row row{wp + n * row_bytes, dp + n * nb, dmp ? dmp + n * nb : nullptr, scp ? scp + n * ng : nullptr,
                        mp ? mp + n * ng : nullptr};
          chunks[T](row, shape, c, o + t0 * N + n, N);
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("gguf_int8_mm", &gguf_int8_mm, "a GGUF tensor's blocks x int8 activations: [k, K] x [N, K]^T -> [k, N]");
  mod.def("available", [] { return true; }, "whether the kernel runs here (it does once built)");
  mod.def("simd_path", [] { return std::string(kPath); }, "which instruction set the kernel was built for");
}
