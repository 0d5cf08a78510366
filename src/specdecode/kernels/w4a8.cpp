// int4 weights x int8 activations (W4A8), for decode and verify steps of k <= 16 tokens.
//
// Weights: symmetric int4 in blocks of 32 inputs, one float32 scale per block, stored as u = q + 8 in
// [0, 15]. Two consecutive blocks form a "pair" of 64 inputs, packed in 32 bytes in *register order*: byte i
// holds register position i in its low nibble and position 32 + i in its high nibble. Register position j
// is in lane l = j / 4 (4 bytes per int32 lane of vpdpbusd), and lane l holds elements of block l % 2
// (elements (l / 2) * 4 .. + 3 of it), so the weight scales of a pair broadcast as [s0, s1, s0, s1, ...].
// Activations: int8 per token in blocks of 32, scale = amax / 127 (float32), q = round-half-even(x / scale)
// clamped to +-127 (0 where x / scale is NaN; a NaN input makes its block's scale, and so the output, NaN),
// laid out per pair and token in the same register order (PairRecord).
//
// Arithmetic, per pair of blocks, in L lanes (the pure-torch reference in kernels/w4a8.py does the same):
//   lane[l] = sum of its products u * q - 8 * sum of its q                             (exact int32)
//   acc[l] += float(lane[l]) * (w_scale * a_scale) of block l % 2, pair after pair    (mul, then add)
//   out = acc[0] + acc[1] + ... + acc[L - 1], left to right.
// L = 16 on the AVX512-VNNI path (lane l: register positions 4l..4l+3, one vpdpbusd lane); L = 8 on the AVX2
// and scalar paths (lane l: positions 4l..4l+3 and 32+4l..32+4l+3, both of block l % 2), which halves the float
// work per token there. Each output is the same sequence of float operations whatever k is, so the kernel is
// bit-exact across k by construction. Built with -ffp-contract=off: a fused multiply-add would round differently.
//
// W8A8 (w8a8_mm, a w4a8 target's lm_head): the same blocks, scales, pairs, register order and float steps, with
// one signed byte per weight (q in -127..127, 64 bytes per pair), so lane[l] = the sum of its products q_w * q;
// 8 lanes on every path.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int kBlock = 32;
constexpr int kPair = 64;
constexpr int kMaxChunk = 8;  // tokens per pass over a weight row: accumulators must stay in registers
constexpr int kPrefetch = 2048;  // bytes ahead in a row's weights
constexpr int64_t kRowBlock = 16;  // weight rows per block of the loop over tokens

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPECDECODE_VNNI 1
#endif

// What the kernel reads for one pair of blocks and one token, in one record so one pointer walks it: the 64 int8
// activations in register order, -8 * the sum of each lane's activations (int4 weights are stored as q + 8) and
// the block scales: per each of 16 lanes on the AVX512-VNNI path; elsewhere per each of 8 lanes and the two block
// scales (scale[0], scale[1]) in a 104-byte record, so that 8 tokens' records for a 1536-wide row stay in L1.
#ifdef SPECDECODE_VNNI
struct alignas(64) PairRecord {
  int8_t q[64];
  int32_t neg8[16];
  float scale[16];  // [a0, a1, a0, a1, ...]
};
#else
struct PairRecord {
  int8_t q[64];
  int32_t neg8[8];
  float scale[2];
};
#endif

// the element of its pair (0..63) that register position j holds
constexpr int element_of(int j) { return (j / 4 % 2) * kBlock + (j / 8) * 4 + j % 4; }

// one block of 32 inputs (zeros past the row's end) -> its scale and q
float quantize_block(const float* x, int8_t* q) {
#if defined(__AVX2__)
  __m256 v[4], amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
  }
  alignas(32) float l[8];
  _mm256_store_ps(l, amax);
  float m = l[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, l[i]);
  if (!_mm256_testz_ps(nan, nan)) m = std::numeric_limits<float>::quiet_NaN();  // as torch's amax
  const float s = m / 127.f;
  if (!(s > 0.f)) {  // all zeros, NaN, or an underflowed scale of zero
    std::memset(q, 0, kBlock);
    return s;
  }
  const __m256 sv = _mm256_set1_ps(s), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 c = _mm256_min_ps(hi, _mm256_max_ps(lo, r));
    n[i] = _mm256_cvtps_epi32(_mm256_andnot_ps(_mm256_cmp_ps(r, r, _CMP_UNORD_Q), c));  // NaN (inf / inf) -> 0
  }
  const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  // the packs work per 128-bit half: dword j holds n[j % 4] elements 0..3 (j < 4) or 4..7; put them in order
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return s;
#else
  float amax = 0.f;  // NaN if any input is NaN, as torch's amax
  for (int i = 0; i < kBlock; ++i) {
    const float a = std::fabs(x[i]);
    if (!(a <= amax) && !std::isnan(amax)) amax = a;  // a NaN, once seen, stays
  }
  const float s = amax / 127.f;
  for (int i = 0; i < kBlock; ++i) {
    float v = s > 0.f ? std::nearbyint(x[i] / s) : 0.f;
    v = std::isnan(v) ? 0.f : std::min(127.f, std::max(-127.f, v));  // inf / inf; a denormal scale
    q[i] = static_cast<int8_t>(v);
  }
  return s;
#endif
}

// x: [k, K] -> q: [k, Kp] int8, scale: [k, Kp / 32], records: [chunks of kMaxChunk tokens][Kp / 64][kMaxChunk]
void quantize_rows(const float* x, int64_t k, int64_t K, int64_t Kp, int8_t* q, float* scale, PairRecord* records) {
  const int64_t nb = Kp / kBlock;
  for (int64_t t = 0; t < k; ++t) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t c = b * kBlock;
      if (c + kBlock <= K) {
        scale[t * nb + b] = quantize_block(x + t * K + c, q + t * Kp + c);
      } else {  // the row's end: zeros beyond it
        float buf[kBlock] = {0.f};
        std::memcpy(buf, x + t * K + c, std::max<int64_t>(0, K - c) * sizeof(float));
        scale[t * nb + b] = quantize_block(buf, q + t * Kp + c);
      }
    }
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

template <int L>
inline float sum_lanes(const float* lanes) {
  float s = lanes[0];
  for (int l = 1; l < L; ++l) s = s + lanes[l];
  return s;
}

#ifdef SPECDECODE_VNNI
const char* kPath = "avx512-vnni";
constexpr int kLanes4 = 16;

template <int T>
void row_chunk(const uint8_t* w, const float* ws, int64_t npairs, const PairRecord* rec, int64_t stride, float* out,
               int64_t ostride) {
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  for (int64_t p = 0; p < npairs; ++p, rec += stride) {
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
#endif

#if defined(__AVX2__)
// The AVX2 code, for int4 weights on AVX2 CPUs and for int8 weights on every AVX2 or AVX-512 CPU. Lane l of a
// pair's 8: the products at positions 4l..4l+3 and 32+4l..32+4l+3.
template <int Bits>
struct PairWeights;

// int4: u = q + 8 in 0..15 times q by vpmaddubsw (|4 * 15 * 127| fits int16), then -8 * sum(q) from the record
template <>
struct PairWeights<4> {
  __m256i lo, hi;  // positions 0..31 and 32..63
  void load(const uint8_t* pair) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    lo = _mm256_and_si256(packed, mask);
    hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
  }
  __m256i lanes(const PairRecord& r, __m256i ones) const {
    const __m256i p = _mm256_add_epi16(
        _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.q))),
        _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.q + 32))));
    return _mm256_add_epi32(_mm256_madd_epi16(p, ones), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.neg8)));
  }
};

// int8: signed weights, each product as |w| * (q * sign(w)) as llama.cpp's Q8_0 x Q8_0 (|2 * 127 * 127| fits int16)
template <>
struct PairWeights<8> {
  __m256i w0, w1, abs0, abs1;
  void load(const uint8_t* pair) {
    w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
    w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 32));
    abs0 = _mm256_sign_epi8(w0, w0);
    abs1 = _mm256_sign_epi8(w1, w1);
  }
  __m256i lanes(const PairRecord& r, __m256i ones) const {
    const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.q));
    const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.q + 32));
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(abs0, _mm256_sign_epi8(q0, w0)), ones),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(abs1, _mm256_sign_epi8(q1, w1)), ones));
  }
};

template <int Bits, int T>
void row_chunk_avx2(const uint8_t* w, const float* ws, int64_t npairs, const PairRecord* rec, int64_t stride,
                    float* out, int64_t ostride) {
  constexpr int kPairBytes = 8 * Bits;
  __m256 acc[T];  // 8 lanes per token
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t p = 0; p < npairs; ++p, rec += stride) {
    _mm_prefetch(reinterpret_cast<const char*>(w + p * kPairBytes + kPrefetch), _MM_HINT_T0);
    PairWeights<Bits> wp;
    wp.load(w + p * kPairBytes);
    double two_scales;
    std::memcpy(&two_scales, ws + 2 * p, sizeof two_scales);
    const __m256 wsv = _mm256_castpd_ps(_mm256_set1_pd(two_scales));  // [s0, s1, s0, s1, ...]
    for (int t = 0; t < T; ++t) {
      const PairRecord& r = rec[t];
      std::memcpy(&two_scales, r.scale, sizeof two_scales);
      const __m256 d = _mm256_mul_ps(wsv, _mm256_castpd_ps(_mm256_set1_pd(two_scales)));
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_cvtepi32_ps(wp.lanes(r, ones)), d));
    }
  }
  alignas(32) float lanes[8];
  for (int t = 0; t < T; ++t) {
    _mm256_store_ps(lanes, acc[t]);
    out[t * ostride] = sum_lanes<8>(lanes);
  }
}

#ifndef SPECDECODE_VNNI
template <int T>
void row_chunk(const uint8_t* w, const float* ws, int64_t npairs, const PairRecord* rec, int64_t stride, float* out,
               int64_t ostride) {
  row_chunk_avx2<4, T>(w, ws, npairs, rec, stride, out, ostride);
}
#endif

#else  // neither AVX2 nor AVX-512
const char* kPath = "scalar";
constexpr int kLanes4 = 8;

// the register value at position j of a pair: int4 weights (u, two per byte) or int8 ones
inline int32_t weight_at(const uint8_t* w, int j, int bits) {
  if (bits == 8) return reinterpret_cast<const int8_t*>(w)[j];
  return j < 32 ? (w[j] & 0x0F) : (w[j - 32] >> 4);
}

template <int Bits, int T>
void row_chunk_scalar(const uint8_t* w, const float* ws, int64_t npairs, const PairRecord* rec, int64_t stride, float* out,
                      int64_t ostride) {
  for (int t = 0; t < T; ++t) {
    float acc[8] = {0.f};
    for (int64_t p = 0; p < npairs; ++p) {
      const PairRecord& r = rec[p * stride + t];
      const uint8_t* wp = w + p * 8 * Bits;
      for (int l = 0; l < 8; ++l) {
        const int32_t offset = Bits == 4 ? 8 : 0;
        int32_t lane = 0;
        for (int j = 4 * l; j < 4 * l + 4; ++j)
          lane += (weight_at(wp, j, Bits) - offset) * r.q[j] + (weight_at(wp, j + 32, Bits) - offset) * r.q[j + 32];
        const float d = ws[2 * p + l % 2] * r.scale[l % 2];
        acc[l] = acc[l] + static_cast<float>(lane) * d;
      }
    }
    out[t * ostride] = sum_lanes<8>(acc);
  }
}

template <int T>
void row_chunk(const uint8_t* w, const float* ws, int64_t npairs, const PairRecord* rec, int64_t stride, float* out,
               int64_t ostride) {
  row_chunk_scalar<4, T>(w, ws, npairs, rec, stride, out, ostride);
}
#endif

// int8 weights: the AVX2 code on AVX2 and AVX-512 CPUs alike (a head's k is small: its weights' bytes bound it)
template <int T>
void row_chunk8(const uint8_t* w, const float* ws, int64_t npairs, const PairRecord* rec, int64_t stride, float* out,
                int64_t ostride) {
#if defined(__AVX2__)
  row_chunk_avx2<8, T>(w, ws, npairs, rec, stride, out, ostride);
#else
  row_chunk_scalar<8, T>(w, ws, npairs, rec, stride, out, ostride);
#endif
}

// one weight row for T tokens
using RowFn = void (*)(const uint8_t*, const float*, int64_t, const PairRecord*, int64_t, float*, int64_t);
const RowFn kChunks[kMaxChunk + 1] = {nullptr, row_chunk<1>, row_chunk<2>, row_chunk<3>, row_chunk<4>,
                                      row_chunk<5>, row_chunk<6>, row_chunk<7>, row_chunk<8>};
const RowFn kChunks8[kMaxChunk + 1] = {nullptr, row_chunk8<1>, row_chunk8<2>, row_chunk8<3>, row_chunk8<4>,
                                       row_chunk8<5>, row_chunk8<6>, row_chunk8<7>, row_chunk8<8>};

}  // namespace

struct Quantized {
  torch::Tensor q, scale, records;
};

Quantized quantize(const torch::Tensor& x, int64_t Kp) {
  const int64_t k = x.size(0);
  Quantized r{torch::zeros({k, Kp}, torch::kInt8), torch::empty({k, Kp / kBlock}, torch::kFloat32),
              torch::empty({(k + kMaxChunk - 1) / kMaxChunk * kMaxChunk * (Kp / kPair),
                            static_cast<int64_t>(sizeof(PairRecord))}, torch::kUInt8)};
  auto* records = reinterpret_cast<PairRecord*>(r.records.data_ptr<uint8_t>());
#ifdef SPECDECODE_VNNI
  TORCH_CHECK(reinterpret_cast<uintptr_t>(records) % 64 == 0, "unaligned activation buffer");  // aligned loads
#endif
  quantize_rows(x.data_ptr<float>(), k, x.size(1), Kp, r.q.data_ptr<int8_t>(), r.scale.data_ptr<float>(), records);
  return r;
}

// x: [k, K] float32 -> (q [k, Kp] int8, scale [k, Kp / 32] float32)
std::vector<torch::Tensor> quantize_activations(torch::Tensor x, int64_t Kp) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [k, K] float32");
  TORCH_CHECK(Kp % kPair == 0 && Kp >= x.size(1), "Kp must be a multiple of 64 and >= K");
  const Quantized r = quantize(x.contiguous(), Kp);
  return {r.q, r.scale};
}

// x: [k, K] float32; packed: [N, Kp * bits / 8] bytes; wscale: [N, Kp / 32] float32 -> [k, N] float32
torch::Tensor matmul(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& wscale, int bits) {
  const auto dtype = bits == 4 ? torch::kUInt8 : torch::kInt8;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [k, K] float32");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && wscale.device().is_cpu(),
              "the W4A8 kernel runs on the CPU");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == dtype && packed.is_contiguous(),
              "packed must be contiguous [N, Kp * ", bits, " / 8] ", bits == 4 ? "uint8" : "int8");
  const int64_t k = x.size(0), K = x.size(1), N = packed.size(0), Kp = packed.size(1) * 8 / bits;
  TORCH_CHECK(Kp % kPair == 0 && Kp >= K && Kp - K < kPair, "packed width ", Kp, " does not fit inputs of ", K);
  TORCH_CHECK(wscale.dim() == 2 && wscale.scalar_type() == torch::kFloat32 && wscale.is_contiguous() &&
              wscale.size(0) == N &&
              wscale.size(1) == Kp / kBlock, "wscale must be contiguous [N, Kp / 32] float32");
  const Quantized act = quantize(x.contiguous(), Kp);
  const auto* records = reinterpret_cast<const PairRecord*>(act.records.data_ptr<uint8_t>());
  auto out = torch::empty({k, N}, torch::kFloat32);
  const auto* w = static_cast<const uint8_t*>(packed.data_ptr());
  const float* ws = wscale.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t npairs = Kp / kPair, row_bytes = Kp * bits / 8;
  const RowFn* chunks = bits == 4 ? kChunks : kChunks8;
  // blocks of kRowBlock weight rows (kept in L2) times chunks of kMaxChunk tokens (their records in L1): a long
  // prefill reads each token's records once per block, not once per weight row
  at::parallel_for(0, N, kRowBlock, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kRowBlock) {
      const int64_t n1 = std::min(end, n0 + kRowBlock);
      for (int64_t t0 = 0; t0 < k; t0 += kMaxChunk) {
        const int64_t T = std::min<int64_t>(kMaxChunk, k - t0);
        for (int64_t n = n0; n < n1; ++n)
          chunks[T](w + n * row_bytes, ws + n * (Kp / kBlock), npairs, records + t0 * npairs, kMaxChunk,
                    o + t0 * N + n, N);
      }
    }
  });
  return out;
}

torch::Tensor w4a8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor wscale) {
  return matmul(x, packed, wscale, 4);
}

torch::Tensor w8a8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor wscale) {
  return matmul(x, packed, wscale, 8);
}

std::string simd_path() { return kPath; }

// the lanes L of the arithmetic (see the top of this file) for 4- or 8-bit weights
int64_t lanes(int64_t bits) { return bits == 4 ? kLanes4 : 8; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w4a8_mm", &w4a8_mm, "int4 weights x int8 activations, [k, K] x [N, K]^T -> [k, N]");
  m.def("w8a8_mm", &w8a8_mm, "int8 weights x int8 activations, [k, K] x [N, K]^T -> [k, N]");
  m.def("quantize_activations", &quantize_activations, "int8 per token in blocks of 32");
  m.def("simd_path", &simd_path, "which instruction set the kernel was built for");
  m.def("lanes", &lanes, "how many float lanes each output sums, for 4- or 8-bit weights");
}
