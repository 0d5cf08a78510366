// int4 weights x int8 activations (W4A8), for decode and verify steps of k <= 16 tokens, and prefills.
//
// Weights: symmetric int4 in blocks of 32 inputs, stored as u = q + 8 in [0, 15]. A block's scale is
// D * sc: D a float32 per super-block of 8 blocks (256 inputs) and sc an int8 sub-scale per block, as in
// llama.cpp's Q4_K; `wscale` holds the float32 products D * sc. Two consecutive blocks form a "pair" of 64
// inputs, packed in 32 bytes in *register order*: byte i holds register position i in its low nibble and
// position 32 + i in its high nibble. Register position j is in lane l = j / 4 (4 bytes per int32 lane of
// vpdpbusd), and lane l holds elements of block l % 2 (elements (l / 2) * 4 .. + 3 of it).
//
// Two arithmetics, one per path (the pure-torch reference in kernels/w4a8.py does each; `lanes(4)` says which):
// - AVX512-VNNI (16 lanes): activations int8 per token in blocks of 32 (scale = amax / 127, q =
//   round-half-even(x / scale) clamped to +-127, 0 where x / scale is NaN); per pair:
//     lane[l] = sum of its products u * q - 8 * sum of its q                          (exact int32, vpdpbusd)
//     acc[l] += float(lane[l]) * (wscale * a_scale) of block l % 2                      (mul, then add)
// - AVX2 and scalar (8 lanes: lane l holds positions 4l..4l+3 and 32+4l..32+4l+3, both of block l % 2):
//   activations int8 per token in super-blocks of 256 (one scale A, same rounding), fed as q + 128; per
//   super-block s, its integer sub-scales applied in the integer sums (vpmaddwd), so the float work is once
//   per 256 inputs instead of once per 64:
//     lane[l] = sum over its pairs of sc(block) * sum of its products (u - 8) * (q + 128), and lane[0] -= corr[s]
//               (corr[s] = 128 * sum of sc * the block's sum of q_w: what the + 128 added; exact int32)
//     acc[l] += float(lane[l]) * (D[s] * A[s])                                             (mul, then add)
// out = acc[0] + acc[1] + ... + acc[L - 1], left to right, then + bias (if any), then rounded once to the output
// dtype (float32 or bfloat16; bfloat16 inputs are widened exactly). Each output is the same sequence of float
// operations whatever k is, so the kernel is bit-exact across k by construction. Built with -ffp-contract=off: a fused
// multiply-add would round differently.
//
// W8A8 (w8a8_mm): blocks of 32 with a float32 scale each, the pairs and register order above, one signed byte per
// weight (q in -127..127, 64 bytes per pair), activations in blocks of 32, and the VNNI arithmetic in 8 lanes on
// every path: lane[l] = the sum of its products q_w * q.
// W6A8 (w6a8_mm, a w4a8 target's lm_head): the same arithmetic on 6-bit weights (q in -31..31, stored u = q + 32)
// in 48 bytes per pair: 32 bytes of low nibbles as the int4 layout (byte i: positions i and 32 + i), then 16 bytes
// of the two high bits, byte b holding positions b, 16 + b, 32 + b and 48 + b in bits 0-1, 2-3, 4-5 and 6-7. The
// kernel rebuilds the int8 q and runs the W8A8 code: the same bits as W8A8 on the same q.

#include "cpu_ops.h"
#include "int8_act.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int kBlock = 32;
constexpr int kPair = 64;
constexpr int kSuper = 4;  // pairs per super-block: 256 inputs
constexpr int kPair6 = 48;  // bytes of a pair of 6-bit weights
constexpr int kMaxChunk = 8;  // tokens per pass over a weight row: accumulators must stay in registers
constexpr int kPrefetch = 2048;  // bytes ahead in a row's weights
constexpr int64_t kRowBlock = 16;  // weight rows per block of the loop over tokens

#ifdef SPECDECODE_HAS_AVX512_VNNI
#define SPECDECODE_VNNI 1
#endif

// What the per-block arithmetic reads for one pair of blocks and one token, in one record so one pointer walks
// it: the 64 int8 activations in register order, -8 * the sum of each lane's activations (int4 weights are
// stored as q + 8) and the block scales: per each of 16 lanes on the AVX512-VNNI path; elsewhere (only int8
// weights use it there) the two block scales (scale[0], scale[1]) in a 104-byte record, so that 8 tokens'
// records for a 1536-wide row stay in L1.
#ifdef SPECDECODE_VNNI
struct alignas(64) PairRecord {
  int8_t q[64];
  int32_t neg8[16];
  float scale[16];  // [a0, a1, a0, a1, ...]
};
#ifndef __cpp_aligned_new
#error "the VNNI path keeps PairRecords in a std::vector: it needs C++17's aligned new for their 64-byte alignment"
#endif
#else
struct PairRecord {
  int8_t q[64];
  int32_t neg8[8];
  float scale[2];
};
#endif

// the element of its pair (0..63) that register position j holds
constexpr int element_of(int j) { return (j / 4 % 2) * kBlock + (j / 8) * 4 + j % 4; }

// x: [k, K] float32 or bfloat16 -> q: [k, Kp] int8 and scale: [k, ceil(Kp / span)], in spans of `span` inputs
// (the last may be shorter); row: Kp floats of scratch, zero beyond K
template <typename T>
void quantize_spans(const T* x, int64_t k, int64_t K, int64_t Kp, int64_t span, int8_t* q, float* scale, float* row) {
  const int64_t ns = (Kp + span - 1) / span;
  for (int64_t t = 0; t < k; ++t) {
    for (int64_t i = 0; i < K; ++i) row[i] = static_cast<float>(x[t * K + i]);  // exact from bfloat16
    for (int64_t s = 0; s < ns; ++s)
      scale[t * ns + s] = quantize_span(row + s * span, std::min(span, Kp - s * span), q + t * Kp + s * span);
  }
}

// q [k, Kp], scale [k, Kp / 32] -> records: [chunks of kMaxChunk tokens][Kp / 64][kMaxChunk]
void pair_records(const int8_t* q, const float* scale, int64_t k, int64_t Kp, PairRecord* records) {
  const int64_t nb = Kp / kBlock;
  for (int64_t t = 0; t < k; ++t) {
    for (int64_t p = 0; p < Kp / kPair; ++p) {
      PairRecord& r = records[(t / kMaxChunk * (Kp / kPair) + p) * kMaxChunk + t % kMaxChunk];
      for (int j = 0; j < kPair; ++j) r.q[j] = q[t * Kp + p * kPair + element_of(j)];
#ifdef SPECDECODE_VNNI
      for (int l = 0; l < 16; ++l) {
        r.neg8[l] = -8 * (r.q[4 * l] + r.q[4 * l + 1] + r.q[4 * l + 2] + r.q[4 * l + 3]);
        r.scale[l] = scale[t * nb + 2 * p + l % 2];
      }
#else
      for (int l = 0; l < 8; ++l) {
        int32_t sum = 0;
        for (int j = 4 * l; j < 4 * l + 4; ++j) sum += r.q[j] + r.q[j + 32];
        r.neg8[l] = -8 * sum;
      }
      r.scale[0] = scale[t * nb + 2 * p];
      r.scale[1] = scale[t * nb + 2 * p + 1];
#endif
    }
  }
}

// q [k, Kp] -> q + 128 in register order: [chunks of kMaxChunk tokens][Kp / 64][kMaxChunk][64] (the super path)
void super_records(const int8_t* q, int64_t k, int64_t Kp, uint8_t* act) {
  const int64_t npairs = Kp / kPair;
  for (int64_t t = 0; t < k; ++t)
    for (int64_t p = 0; p < npairs; ++p) {
      uint8_t* r = act + ((t / kMaxChunk * npairs + p) * kMaxChunk + t % kMaxChunk) * kPair;
      for (int j = 0; j < kPair; ++j) r[j] = static_cast<uint8_t>(q[t * Kp + p * kPair + element_of(j)] + 128);
    }
}

template <int L>
inline float sum_lanes(const float* lanes) {
  float s = lanes[0];
  for (int l = 1; l < L; ++l) s = s + lanes[l];
  return s;
}

// Everything one weight row reads: the packed weights and their scales (per block: wscale; per super-block: D,
// the int8 sub-scales and the correction)
struct Row {
  const uint8_t* w;
  const float* wscale;
  const float* d;
  const int8_t* sub;
  const int32_t* corr;
};

// One token chunk's activations: pair records (per-block arithmetic) or q + 128 bytes and super-block scales
struct Chunk {
  const PairRecord* rec;
  const uint8_t* act;
  const float* ascale;  // [super-blocks][kMaxChunk]
};

#ifdef SPECDECODE_VNNI
const char* kPath = "avx512-vnni";
constexpr int kLanes4 = 16;

template <int T>
void row_chunk(const Row& row, int64_t npairs, const Chunk& c, float* out, int64_t ostride) {
  const uint8_t* w = row.w;
  const float* ws = row.wscale;
  const PairRecord* rec = c.rec;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  for (int64_t p = 0; p < npairs; ++p, rec += kMaxChunk) {
    _mm_prefetch(reinterpret_cast<const char*>(w + p * 32 + kPrefetch), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ws + 2 * p + kPrefetch / 16), _MM_HINT_T0);
    // [32 bytes | the same 32 bytes] >> [0 | 4] & 0x0F: low nibbles, then high nibbles
    const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32)));
    const __m512i u = _mm512_and_si512(_mm512_srlv_epi16(both, shift), mask);
    double two_scales;
    std::memcpy(&two_scales, ws + 2 * p, sizeof two_scales);
    const __m512 wsv = _mm512_castpd_ps(_mm512_set1_pd(two_scales));  // [s0, s1, s0, s1, ...]
    for (int t = 0; t < T; ++t) {
      const __m512i lanes = _mm512_dpbusd_epi32(_mm512_load_si512(rec[t].neg8), u, _mm512_load_si512(rec[t].q));
      const __m512 d = _mm512_mul_ps(wsv, _mm512_load_ps(rec[t].scale));
      acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_cvtepi32_ps(lanes), d));
    }
  }
  alignas(64) float lanes[16];
  for (int t = 0; t < T; ++t) {
    _mm512_store_ps(lanes, acc[t]);
    out[t * ostride] = sum_lanes<16>(lanes);
  }
}

#elif defined(__AVX2__)
const char* kPath = "avx2";
constexpr int kLanes4 = 8;
#else
const char* kPath = "scalar";
constexpr int kLanes4 = 8;
#endif

#if defined(__AVX2__)
// 6-bit weights multiply as u = q + 32 where the records hold each 8-position lane's -8 * sum(q) (AVX2 builds):
// unsigned bytes need no sign trick, and adding 4 * that takes 32 * sum(q) off again, so the integer lanes are
// those of q. AVX-512 builds' records count 16 lanes of 4: there u - 32 takes the int8 path.
#ifdef SPECDECODE_VNNI
constexpr bool kUnsigned6 = false;
#else
constexpr bool kUnsigned6 = true;
#endif

// The 64 weights of a pair in register order (positions 0..31, 32..63): 8-bit ones as stored (q), 6-bit ones rebuilt
// from their nibbles and high bits (see the top of this file) as u = q + 32
template <int Bits>
inline void load_pair(const uint8_t* pair, __m256i& w0, __m256i& w1) {
  if constexpr (Bits == 8) {
    w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
    w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 32));
  } else {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
    const __m256i hi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + 32)));
    const __m256i nibble = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
    // positions 0..15 and 16..31 take bits 0-1 and 2-3 of the high bytes; 32..47 and 48..63 bits 4-5 and 6-7
    const __m256i h0 = _mm256_and_si256(_mm256_srlv_epi32(hi, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), two);
    const __m256i h1 = _mm256_and_si256(_mm256_srlv_epi32(hi, _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6)), two);
    w0 = _mm256_or_si256(_mm256_and_si256(lo, nibble), _mm256_slli_epi16(h0, 4));
    w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), nibble), _mm256_slli_epi16(h1, 4));
  }
}

// int8 (and 6-bit) weights on AVX2 and AVX-512 CPUs: signed weights, each product as |w| * (q * sign(w)) as
// llama.cpp's Q8_0 x Q8_0 (|2 * 127 * 127| fits int16). Lane l of a pair's 8: the products at positions 4l..4l+3
// and 32+4l..32+4l+3.
template <int T, int Bits>
void row_chunk8(const Row& row, int64_t npairs, const Chunk& c, float* out, int64_t ostride) {
  constexpr int64_t kBytes = Bits == 8 ? kPair : kPair6;
  const PairRecord* rec = c.rec;
  __m256 acc[T];  // 8 lanes per token
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t p = 0; p < npairs; ++p, rec += kMaxChunk) {
    const uint8_t* pair = row.w + p * kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(pair + kPrefetch), _MM_HINT_T0);
    __m256i w0, w1;
    load_pair<Bits>(pair, w0, w1);
    constexpr bool kUnsigned = Bits == 6 && kUnsigned6;
    if constexpr (Bits == 6 && !kUnsigned) {
      w0 = _mm256_sub_epi8(w0, _mm256_set1_epi8(32));
      w1 = _mm256_sub_epi8(w1, _mm256_set1_epi8(32));
    }
    const __m256i abs0 = kUnsigned ? w0 : _mm256_sign_epi8(w0, w0), abs1 = kUnsigned ? w1 : _mm256_sign_epi8(w1, w1);
    double two_scales;
    std::memcpy(&two_scales, row.wscale + 2 * p, sizeof two_scales);
    const __m256 wsv = _mm256_castpd_ps(_mm256_set1_pd(two_scales));  // [s0, s1, s0, s1, ...]
    for (int t = 0; t < T; ++t) {
      const PairRecord& r = rec[t];
      const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.q));
      const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.q + 32));
      __m256i lanes;
      if constexpr (kUnsigned)  // (|2 * 63 * 127| fits int16)
        lanes = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(abs0, q0), ones),
                             _mm256_madd_epi16(_mm256_maddubs_epi16(abs1, q1), ones)),
            _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.neg8)), 2));
      else
        lanes = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(abs0, _mm256_sign_epi8(q0, w0)), ones),
                                 _mm256_madd_epi16(_mm256_maddubs_epi16(abs1, _mm256_sign_epi8(q1, w1)), ones));
      std::memcpy(&two_scales, r.scale, sizeof two_scales);
      const __m256 d = _mm256_mul_ps(wsv, _mm256_castpd_ps(_mm256_set1_pd(two_scales)));
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_cvtepi32_ps(lanes), d));
    }
  }
  alignas(32) float lanes[8];
  for (int t = 0; t < T; ++t) {
    _mm256_store_ps(lanes, acc[t]);
    out[t * ostride] = sum_lanes<8>(lanes);
  }
}

#ifndef SPECDECODE_VNNI
// vpshufb masks: pair i of a super-block gives lane l the int16 sub-scale of block 2i + l % 2, twice
alignas(32) const int8_t kSubOfPair[kSuper][32] = {
#define SPECDECODE_SUB(b) 2 * (b), 2 * (b) + 1, 2 * (b), 2 * (b) + 1, 2 * (b) + 2, 2 * (b) + 3, 2 * (b) + 2, 2 * (b) + 3
#define SPECDECODE_SUBS(b) SPECDECODE_SUB(b), SPECDECODE_SUB(b), SPECDECODE_SUB(b), SPECDECODE_SUB(b)
    {SPECDECODE_SUBS(0)}, {SPECDECODE_SUBS(2)}, {SPECDECODE_SUBS(4)}, {SPECDECODE_SUBS(6)}};
#undef SPECDECODE_SUBS
#undef SPECDECODE_SUB

// int4 weights on AVX2 CPUs, in super-blocks: per pair and token two vpmaddubsw ((q + 128) * (u - 8): |2 * 255 *
// 8| fits int16), their sum, one vpmaddwd by the sub-scales and one integer add; per super-block the float steps.
template <int T>
void row_chunk(const Row& row, int64_t npairs, const Chunk& c, float* out, int64_t ostride) {
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  for (int64_t s = 0, p0 = 0; p0 < npairs; ++s, p0 += kSuper) {
    const int64_t p1 = std::min<int64_t>(npairs, p0 + kSuper);
    // the 8 sub-scales as int16 in both 128-bit halves
    const __m256i sc = _mm256_broadcastsi128_si256(
        _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row.sub + s * 2 * kSuper))));
    __m256i lanes[T];
    const __m256i first = _mm256_setr_epi32(-row.corr[s], 0, 0, 0, 0, 0, 0, 0);
    for (int t = 0; t < T; ++t) lanes[t] = first;
    for (int64_t p = p0; p < p1; ++p) {
      _mm_prefetch(reinterpret_cast<const char*>(row.w + p * 32 + kPrefetch), _MM_HINT_T0);
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.w + p * 32));
      const __m256i lo = _mm256_sub_epi8(_mm256_and_si256(packed, mask), eight);  // positions 0..31, q_w
      const __m256i hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(packed, 4), mask), eight);  // 32..63
      const __m256i scp =
          _mm256_shuffle_epi8(sc, _mm256_load_si256(reinterpret_cast<const __m256i*>(kSubOfPair[p - p0])));
      const uint8_t* a = c.act + p * kMaxChunk * kPair;
      for (int t = 0; t < T; ++t, a += kPair) {
        const __m256i prod = _mm256_add_epi16(
            _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)), lo),
            _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32)), hi));
        lanes[t] = _mm256_add_epi32(lanes[t], _mm256_madd_epi16(prod, scp));
      }
    }
    const __m256 dw = _mm256_set1_ps(row.d[s]);
    for (int t = 0; t < T; ++t) {
      const __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(c.ascale[s * kMaxChunk + t]));
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_cvtepi32_ps(lanes[t]), d));
    }
  }
  alignas(32) float lanes[8];
  for (int t = 0; t < T; ++t) {
    _mm256_store_ps(lanes, acc[t]);
    out[t * ostride] = sum_lanes<8>(lanes);
  }
}
#endif

#else  // neither AVX2 nor AVX-512: the same arithmetic in scalar code
// the register value at position j of a pair: int4 weights (u, two per byte), int8 ones, or 6-bit ones (q)
inline int32_t weight_at(const uint8_t* w, int j, int bits) {
  if (bits == 8) return reinterpret_cast<const int8_t*>(w)[j];
  const int32_t nibble = j < 32 ? (w[j] & 0x0F) : (w[j - 32] >> 4);
  if (bits == 4) return nibble;
  return (nibble | ((w[32 + j % 16] >> (2 * (j / 16))) & 3) << 4) - 32;
}

template <int T, int Bits>
void row_chunk8(const Row& row, int64_t npairs, const Chunk& c, float* out, int64_t ostride) {
  constexpr int64_t kBytes = Bits == 8 ? kPair : kPair6;
  for (int t = 0; t < T; ++t) {
    float acc[8] = {0.f};
    for (int64_t p = 0; p < npairs; ++p) {
      const PairRecord& r = c.rec[p * kMaxChunk + t];
      const uint8_t* w = row.w + p * kBytes;
      for (int l = 0; l < 8; ++l) {
        int32_t lane = 0;
        for (int j = 4 * l; j < 4 * l + 4; ++j)
          lane += weight_at(w, j, Bits) * r.q[j] + weight_at(w, j + 32, Bits) * r.q[j + 32];
        const float d = row.wscale[2 * p + l % 2] * r.scale[l % 2];
        acc[l] = acc[l] + static_cast<float>(lane) * d;
      }
    }
    out[t * ostride] = sum_lanes<8>(acc);
  }
}

template <int T>
void row_chunk(const Row& row, int64_t npairs, const Chunk& c, float* out, int64_t ostride) {
  for (int t = 0; t < T; ++t) {
    float acc[8] = {0.f};
    for (int64_t s = 0, p0 = 0; p0 < npairs; ++s, p0 += kSuper) {
      int32_t lane[8] = {-row.corr[s], 0, 0, 0, 0, 0, 0, 0};
      for (int64_t p = p0; p < std::min<int64_t>(npairs, p0 + kSuper); ++p) {
        const uint8_t* a = c.act + (p * kMaxChunk + t) * kPair;
        for (int l = 0; l < 8; ++l) {
          int32_t sum = 0;
          for (int j = 4 * l; j < 4 * l + 4; ++j) {
            const uint8_t* w = row.w + p * 32;
            sum += (weight_at(w, j, 4) - 8) * a[j] + (weight_at(w, j + 32, 4) - 8) * a[j + 32];
          }
          lane[l] += row.sub[2 * p + l % 2] * sum;
        }
      }
      const float d = row.d[s] * c.ascale[s * kMaxChunk + t];
      for (int l = 0; l < 8; ++l) acc[l] = acc[l] + static_cast<float>(lane[l]) * d;
    }
    out[t * ostride] = sum_lanes<8>(acc);
  }
}
#endif

// one weight row for T tokens
using RowFn = void (*)(const Row&, int64_t, const Chunk&, float*, int64_t);
const RowFn kChunks[kMaxChunk + 1] = {nullptr, row_chunk<1>, row_chunk<2>, row_chunk<3>, row_chunk<4>,
                                      row_chunk<5>, row_chunk<6>, row_chunk<7>, row_chunk<8>};
template <int Bits>
constexpr RowFn kChunks8[kMaxChunk + 1] = {nullptr, row_chunk8<1, Bits>, row_chunk8<2, Bits>, row_chunk8<3, Bits>,
                                           row_chunk8<4, Bits>, row_chunk8<5, Bits>, row_chunk8<6, Bits>,
                                           row_chunk8<7, Bits>, row_chunk8<8, Bits>};

// whether int4 weights take the super-block arithmetic in this build
constexpr bool kSuperPath = kLanes4 == 8;

// The activations of one matmul, as its arithmetic reads them. A decode or verify step makes about a hundred small
// calls, where allocating them anew would cost as much as the arithmetic: calls of up to kScratchBytes of int8
// activations (k * Kp; the records take 1-3 times that again) reuse the calling thread's scratch. A prefill's (2-4
// bytes per input and token: 150-300 MB for 8192 tokens into 8960 inputs) are freed after the call.
constexpr int64_t kScratchBytes = 1 << 20;

struct Activations {
  std::vector<int8_t> q;  // [k, Kp]
  std::vector<float> scale;  // [k, ceil(Kp / span)]
  std::vector<uint8_t> super;  // the super path's records: q + 128 (see super_records)
  std::vector<PairRecord> pairs;  // the per-block path's records (see pair_records)
  std::vector<float> row;  // one token's inputs as float32, zero-padded to Kp
  std::vector<float> ascale;  // the super path's activation scales per chunk of tokens (see matmul)
};

// Where the activations of k tokens of Kp inputs go: this thread's scratch, or `own` for a large call
Activations& scratch_for(int64_t k, int64_t Kp, Activations& own) {
  thread_local Activations scratch;
  return k * Kp <= kScratchBytes ? scratch : own;
}

// x: k rows of K inputs (contiguous, any leading shape) -> a, filled
void quantize(const torch::Tensor& x, int64_t k, int64_t Kp, bool super, Activations& a) {
  const int64_t chunks = (k + kMaxChunk - 1) / kMaxChunk, span = super ? kSuper * kPair : kBlock;
  const int64_t records = chunks * kMaxChunk * (Kp / kPair);
  a.q.resize(k * Kp);
  a.scale.resize(k * ((Kp + span - 1) / span));
  a.row.assign(Kp, 0.f);
  if (x.scalar_type() == torch::kFloat32)
    quantize_spans(x.data_ptr<float>(), k, x.size(-1), Kp, span, a.q.data(), a.scale.data(), a.row.data());
  else
    quantize_spans(x.data_ptr<at::BFloat16>(), k, x.size(-1), Kp, span, a.q.data(), a.scale.data(), a.row.data());
  if (super) {
    a.super.resize(records * kPair);
    super_records(a.q.data(), k, Kp, a.super.data());
  } else {
    a.pairs.resize(records);  // PairRecord is 64-byte aligned on the VNNI path: its aligned loads
    pair_records(a.q.data(), a.scale.data(), k, Kp, a.pairs.data());
  }
}

void check_inputs(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x must be [..., K] float32 or bfloat16");
}

// Where a block of outputs goes: the float32 sums plus the bias (its float32 value), rounded once to the output's dtype
struct Output {
  torch::Tensor tensor;  // [..., N] float32 or bfloat16: x's shape with N for K
  torch::Tensor bias;  // [N] float32 or bfloat16 (read as float32: exact), or undefined

  Output(const torch::Tensor& x, int64_t N, const c10::optional<torch::Tensor>& b, c10::optional<at::ScalarType> dtype)
      : tensor(torch::empty(out_shape(x, N), torch::TensorOptions().dtype(dtype.value_or(torch::kFloat32)))) {
    TORCH_CHECK(tensor.scalar_type() == torch::kFloat32 || tensor.scalar_type() == torch::kBFloat16,
                "dtype must be float32 or bfloat16");
    if (b.has_value()) {
      TORCH_CHECK(b->dim() == 1 && b->size(0) == N && b->device().is_cpu(), "bias must be [N]");
      const bool kept = b->scalar_type() == torch::kFloat32 || b->scalar_type() == torch::kBFloat16;
      bias = (kept ? *b : b->to(torch::kFloat32)).contiguous();
    }
  }

  static std::vector<int64_t> out_shape(const torch::Tensor& x, int64_t N) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    return shape;
  }

  // sums [T][kRowBlock] of rows n0..n1 - 1 for tokens t0..t0 + T - 1
  void store(const float* sums, int64_t T, int64_t t0, int64_t n0, int64_t n1) {
    const auto with_bias = [&](const auto* b) {  // the output's dtype, for a bias of either dtype (or none)
      if (tensor.scalar_type() == torch::kFloat32) store_as(tensor.data_ptr<float>(), b, sums, T, t0, n0, n1);
      else store_as(tensor.data_ptr<at::BFloat16>(), b, sums, T, t0, n0, n1);
    };
    if (bias.defined() && bias.scalar_type() == torch::kBFloat16) with_bias(bias.data_ptr<at::BFloat16>());
    else with_bias(bias.defined() ? bias.data_ptr<float>() : nullptr);
  }

  template <typename Out, typename Bias>
  void store_as(Out* out, const Bias* b, const float* sums, int64_t T, int64_t t0, int64_t n0, int64_t n1) {
    const int64_t N = tensor.size(-1);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = n0; n < n1; ++n) {
        const float sum = sums[t * kRowBlock + n - n0];
        out[(t0 + t) * N + n] = static_cast<Out>(b ? sum + static_cast<float>(b[n]) : sum);
      }
  }
};

void check_weights(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& wscale, int bits) {
  const auto dtype = bits == 8 ? torch::kInt8 : torch::kUInt8;
  check_inputs(x);
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && wscale.device().is_cpu(),
              "the W4A8 kernel runs on the CPU");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == dtype && packed.is_contiguous(),
              "packed must be contiguous [N, Kp * ", bits, " / 8] ", bits == 8 ? "int8" : "uint8");
  const int64_t K = x.size(-1), Kp = packed.size(1) * 8 / bits;
  TORCH_CHECK(Kp % kPair == 0 && Kp >= K && Kp - K < kPair, "packed width ", Kp, " does not fit inputs of ", K);
  // int4 weights on the super-block path do not read the block scales: they may be left out ([N, 0])
  const bool optional = bits == 4 && kSuperPath;
  TORCH_CHECK(wscale.dim() == 2 && wscale.scalar_type() == torch::kFloat32 && wscale.is_contiguous() &&
              wscale.size(0) == packed.size(0) && (wscale.size(1) == Kp / kBlock || optional && wscale.size(1) == 0),
              "wscale must be contiguous [N, Kp / 32] float32", optional ? " (or [N, 0]: not read here)" : "");
}

// x: [..., K] float32 or bfloat16 (k rows: the product of the leading sizes) times the weights of `row(n)` -> `out`
// ([..., N], its dtype, plus its bias)
template <typename RowOf>
torch::Tensor matmul(const torch::Tensor& x, int64_t N, int64_t Kp, bool super, const RowFn* chunks, RowOf row_of,
                     Output out) {
  const int64_t k = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  const int64_t npairs = Kp / kPair, nsuper = (npairs + kSuper - 1) / kSuper;
  Activations own;
  Activations& act = scratch_for(k, Kp, own);
  quantize(x.contiguous(), k, Kp, super, act);
  const uint8_t* records = super ? act.super.data() : reinterpret_cast<const uint8_t*>(act.pairs.data());
  const int64_t chunk_bytes = kMaxChunk * npairs * (super ? kPair : static_cast<int64_t>(sizeof(PairRecord)));
  // the super path's activation scales per chunk: [super-blocks][kMaxChunk]
  act.ascale.assign(super ? (k + kMaxChunk - 1) / kMaxChunk * nsuper * kMaxChunk : 0, 0.f);
  float* ascale = act.ascale.data();
  for (int64_t t = 0; super && t < k; ++t)
    for (int64_t s = 0; s < nsuper; ++s)
      ascale[(t / kMaxChunk * nsuper + s) * kMaxChunk + t % kMaxChunk] = act.scale[t * nsuper + s];
  // blocks of kRowBlock weight rows (kept in L2) times chunks of kMaxChunk tokens (their records in L1): a long
  // prefill reads each token's records once per block, not once per weight row
  at::parallel_for(0, N, kRowBlock, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kRowBlock) {
      const int64_t n1 = std::min(end, n0 + kRowBlock);
      for (int64_t t0 = 0; t0 < k; t0 += kMaxChunk) {
        const int64_t T = std::min<int64_t>(kMaxChunk, k - t0);
        const uint8_t* r = records + t0 / kMaxChunk * chunk_bytes;
        const Chunk c{reinterpret_cast<const PairRecord*>(r), r,
                      super ? ascale + t0 / kMaxChunk * nsuper * kMaxChunk : nullptr};
        float sums[kMaxChunk * kRowBlock];
        for (int64_t n = n0; n < n1; ++n) chunks[T](row_of(n), npairs, c, sums + n - n0, kRowBlock);
        out.store(sums, T, t0, n0, n1);
      }
    }
  });
  return out.tensor;
}

}  // namespace

namespace specdecode {

// x: [k, K] float32 or bfloat16 -> (q [k, Kp] int8, scale [k, ceil(Kp / span)] float32), in spans of 32 or 256
// inputs
std::vector<torch::Tensor> quantize_activations(torch::Tensor x, int64_t Kp, int64_t span) {
  check_inputs(x);
  TORCH_CHECK(x.dim() == 2 && Kp % kPair == 0 && Kp >= x.size(1), "x must be [k, K]; Kp a multiple of 64 and >= K");
  TORCH_CHECK(span == kBlock || span == kSuper * kPair, "span must be 32 or 256");
  const int64_t k = x.size(0);
  Activations a;
  quantize(x.contiguous(), k, Kp, span != kBlock, a);
  torch::Tensor q = torch::empty({k, Kp}, torch::kInt8);
  torch::Tensor scale = torch::empty({k, (Kp + span - 1) / span}, torch::kFloat32);
  std::copy(a.q.begin(), a.q.end(), q.data_ptr<int8_t>());
  std::copy(a.scale.begin(), a.scale.end(), scale.data_ptr<float>());
  return {q, scale};
}

// x: [..., K] float32 or bfloat16; packed: [N, Kp / 2] uint8; wscale: [N, Kp / 32] float32 (D * sc; [N, 0] on the
// super-block path, which does not read it); d: [N, S] float32; sub: [N, 8 S] int8; corr: [N, S] int32
// (S = ceil(Kp / 256)); bias: [N] or None -> [..., N] in dtype
torch::Tensor w4a8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor wscale, torch::Tensor d, torch::Tensor sub,
                      torch::Tensor corr, c10::optional<torch::Tensor> bias, c10::optional<at::ScalarType> dtype) {
  check_weights(x, packed, wscale, 4);
  const int64_t N = packed.size(0), Kp = packed.size(1) * 2, S = (Kp / kPair + kSuper - 1) / kSuper;
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.is_contiguous() && d.sizes() == torch::IntArrayRef({N, S}) &&
              sub.scalar_type() == torch::kInt8 && sub.is_contiguous() &&
              sub.sizes() == torch::IntArrayRef({N, 2 * kSuper * S}) && corr.scalar_type() == torch::kInt32 &&
              corr.is_contiguous() && corr.sizes() == torch::IntArrayRef({N, S}),
              "super-block scales must be contiguous d [N, S] float32, sub [N, 8 S] int8, corr [N, S] int32, S = ",
              S);
  const auto* w = packed.data_ptr<uint8_t>();
  const float *ws = wscale.data_ptr<float>(), *dp = d.data_ptr<float>();
  const int64_t wstride = wscale.size(1);  // 0 where the block scales are left out
  const int8_t* sp = sub.data_ptr<int8_t>();
  const int32_t* cp = corr.data_ptr<int32_t>();
  return matmul(x, N, Kp, kSuperPath, kChunks, [&](int64_t n) {
    return Row{w + n * Kp / 2, ws + n * wstride, dp + n * S, sp + n * 2 * kSuper * S, cp + n * S};
  }, Output(x, N, bias, dtype));
}

// W8A8's arithmetic on Bits-bit weights (8 or 6) with a float32 scale per block: [..., K] -> [..., N] in dtype
template <int Bits>
torch::Tensor block_scaled_mm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& wscale,
                              const c10::optional<torch::Tensor>& bias, c10::optional<at::ScalarType> dtype) {
  check_weights(x, packed, wscale, Bits);
  const int64_t N = packed.size(0), bytes = packed.size(1), Kp = bytes * 8 / Bits;
  const auto* w = static_cast<const uint8_t*>(packed.data_ptr());
  const float* ws = wscale.data_ptr<float>();
  return matmul(x, N, Kp, false, kChunks8<Bits>,
                [&](int64_t n) { return Row{w + n * bytes, ws + n * (Kp / kBlock), nullptr, nullptr, nullptr}; },
                Output(x, N, bias, dtype));
}

// x: [..., K] float32 or bfloat16; packed: [N, Kp] int8; wscale: [N, Kp / 32] float32; bias: [N] or None ->
// [..., N] in dtype
torch::Tensor w8a8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor wscale, c10::optional<torch::Tensor> bias,
                      c10::optional<at::ScalarType> dtype) {
  return block_scaled_mm<8>(x, packed, wscale, bias, dtype);
}

// x: [..., K] float32 or bfloat16; packed: [N, Kp * 3 / 4] uint8 (48 bytes per pair); wscale: [N, Kp / 32] float32;
// bias: [N] or None -> [..., N] in dtype
torch::Tensor w6a8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor wscale, c10::optional<torch::Tensor> bias,
                      c10::optional<at::ScalarType> dtype) {
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) % kPair6 == 0,
              "6-bit weights take 48 bytes per pair of blocks: packed must be [N, Kp * 3 / 4]");
  return block_scaled_mm<6>(x, packed, wscale, bias, dtype);
}

std::string simd_path() { return kPath; }

// the lanes L of the arithmetic (see the top of this file) for 4-, 6- or 8-bit weights
int64_t lanes(int64_t bits) { return bits == 4 ? kLanes4 : 8; }

void bind_w4a8(pybind11::module_& m) {
  m.def("w4a8_mm", &w4a8_mm, "int4 weights x int8 activations, [..., K] x [N, K]^T (+ bias) -> [..., N] in dtype",
        py::arg("x"), py::arg("packed"), py::arg("wscale"), py::arg("d"), py::arg("sub"), py::arg("corr"),
        py::arg("bias") = py::none(), py::arg("dtype") = py::none());
  m.def("w8a8_mm", &w8a8_mm, "int8 weights x int8 activations, [..., K] x [N, K]^T (+ bias) -> [..., N] in dtype",
        py::arg("x"), py::arg("packed"), py::arg("wscale"), py::arg("bias") = py::none(),
        py::arg("dtype") = py::none());
  m.def("w6a8_mm", &w6a8_mm, "6-bit weights x int8 activations, [..., K] x [N, K]^T (+ bias) -> [..., N] in dtype",
        py::arg("x"), py::arg("packed"), py::arg("wscale"), py::arg("bias") = py::none(),
        py::arg("dtype") = py::none());
  m.def("quantize_activations", &quantize_activations, "int8 per token in spans of 32 or 256 inputs");
  m.def("simd_path", &simd_path, "which instruction set the kernel was built for");
  m.def("lanes", &lanes, "how many float lanes each output sums, for 4-, 6- or 8-bit weights (16: the per-block "
                         "VNNI arithmetic; 8 for int4: the super-block one)");
}

}  // namespace specdecode
