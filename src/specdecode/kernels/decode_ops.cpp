// The non-linear part of a decoder layer for decode and verify steps (a few new tokens per sequence), row by row:
// RMSNorm, rotary embedding + KV-cache write + attention, and SiLU(gate) * up.
//
// Why: in PyTorch these are ~40 small ops per layer (about 1 ms per layer of dispatch on our 2-core CPUs), and
// torch's matmuls inside attention reduce in an order that depends on how many query rows share a call, which
// is why bit-exact mode padded every forward to a fixed width. Here every output row is computed by its own
// fixed sequence of operations, whatever the number of rows, sequences or threads: a token's result depends
// only on its own inputs and on the keys it sees, in cache order. So these ops are bit-exact across k by
// construction, and a forward needs no padding where its linears are row-invariant too.
//
// Arithmetic (float32 throughout; bf16 inputs are widened exactly, bf16 outputs rounded to nearest even):
// W = 16 floats per vector on AVX-512 CPUs, 8 on AVX2 + FMA ones (two sections below, the same steps).
//   rms_norm:  ss = sum of x^2 in W interleaved partial sums (fused multiply-add), added 0..W-1 in order;
//              y = dtype(x * (1 / sqrt(ss / D + eps))); out = dtype(w * y)  (transformers' RMSNorm, up to rounding)
//   silu_mul:  out = dtype(dtype(g / (1 + exp(-g))) * u)
//   attention: rope on q and k in float32 (k rounded to the cache's dtype as it is written); for each query row,
//              s_j = q . k_j over the keys it sees, q pre-scaled by 1 / sqrt(hd) (products in W lanes by head
//              dimension, the first a product then fused multiply-adds; the W lanes summed by one fixed tree),
//              m = max s_j; p_j = exp(s_j - m); out = (sum_j p_j v_j) / (sum_j p_j), sums in cache order.
//   exp:       a Cephes-style polynomial with the same operations for every element (no libm).
// Built with -ffp-contract=off: the only fused multiply-adds are the explicit std::fma ones.

#include "cpu_ops.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#ifdef SPECDECODE_HAS_AVX512
#define SPECDECODE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define SPECDECODE_AVX2 1
#endif
#if defined(SPECDECODE_AVX512) || defined(SPECDECODE_AVX2)
#define SPECDECODE_OPS 1
#endif

namespace {

bool available() {
#ifdef SPECDECODE_OPS
  return true;
#else
  return false;  // the decoder keeps PyTorch's ops (and pads bit-exact forwards) on CPUs without AVX2 + FMA
#endif
}

#ifdef SPECDECODE_AVX512
using BF16 = at::BFloat16;
constexpr int kW = 16;  // floats per vector
const float kNegInf = -std::numeric_limits<float>::infinity();

inline __mmask16 tail(int64_t n) { return n >= kW ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// 16 values widened to float32 (exact for bf16); lanes outside the mask read 0
inline __m512 load16(const float* p, __mmask16 k = 0xFFFF) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16(const BF16* p, __mmask16 k = 0xFFFF) {
  const __m256i h = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// float32 -> bf16 bits, rounded to nearest even (NaN -> 0x7fc0), as torch's .to(torch.bfloat16)
inline __m512i bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
inline void store16(float* p, __m512 v, __mmask16 k = 0xFFFF) { _mm512_mask_storeu_ps(p, k, v); }
inline void store16(BF16* p, __m512 v, __mmask16 k = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(bf16_bits(v)));
}
// v rounded to T and widened back: what storing then loading would give
inline __m512 round_to(float*, __m512 v) { return v; }
inline __m512 round_to(BF16*, __m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }

// exp(x): 0 below -87.3 (and for -inf), inf above 88.7, NaN for NaN; the same operations for every lane
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.7f);
  const __m512 xc = _mm512_min_ps(hi, _mm512_max_ps(lo, x));  // (lo, x) and (hi, .): a NaN x passes through
  const __m512 n = _mm512_roundscale_ps(
      _mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(c));
  y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(y, z), r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 out = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  const __m512 low = _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), _mm512_setzero_ps());
  return _mm512_mask_mov_ps(low, _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ),
                            _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}

// lane l of the result: the sum of v[l]'s 16 lanes, by one fixed tree of additions
inline __m512 lane_sums(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// which of n <= 16 keys a query sees, as a mask
inline __mmask16 visible16(const bool* vis, int64_t n) {
  const __m128i b = _mm_maskz_loadu_epi8(tail(n), vis);
  return _mm_test_epi8_mask(b, b);
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      __m512 part = _mm512_setzero_ps();  // 16 interleaved partial sums of squares
      for (int64_t j = 0; j < D; j += kW) {
        const __m512 v = load16(xr + j, tail(D - j));
        part = _mm512_fmadd_ps(v, v, part);
      }
      alignas(64) float lanes[kW];
      _mm512_store_ps(lanes, part);
      float ss = 0.0f;
      for (const float l : lanes) ss += l;
      const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(ss / static_cast<float>(D) + eps));
      T* o = out + r * D;
      for (int64_t j = 0; j < D; j += kW) {
        const __mmask16 k = tail(D - j);
        const __m512 y = round_to(o, _mm512_mul_ps(load16(xr + j, k), inv));
        store16(o + j, _mm512_mul_ps(load16(w + j, k), y), k);
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t I) {
  constexpr int64_t kSeg = 512;  // elements per task; a row's element i always takes the same path
  const int64_t segs = (I + kSeg - 1) / kSeg;
  at::parallel_for(0, rows * segs, 1, [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / segs, i0 = (task % segs) * kSeg, i1 = std::min(I, i0 + kSeg);
      const T* g = gate_up + r * 2 * I;
      for (int64_t i = i0; i < i1; i += kW) {
        const __mmask16 k = tail(i1 - i);
        const __m512 gi = load16(g + i, k);
        const __m512 s = round_to(out, _mm512_div_ps(gi, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gi)))));
        store16(out + r * I + i, _mm512_mul_ps(s, load16(g + I + i, k)), k);
      }
    }
  });
}

// rotary embedding of one head vector (transformers' rotate_half convention) in float32, times `scale`
template <typename T>
inline void rope(const T* x, const float* cos, const float* sin, float* out, int64_t hd, float scale) {
  const int64_t half = hd / 2;
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t d = 0; d < half; d += kW) {
    const __mmask16 k = tail(half - d);
    const __m512 lo = load16(x + d, k), hi = load16(x + half + d, k);
    const __m512 a = _mm512_sub_ps(_mm512_mul_ps(lo, load16(cos + d, k)), _mm512_mul_ps(hi, load16(sin + d, k)));
    const __m512 b = _mm512_add_ps(_mm512_mul_ps(hi, load16(cos + half + d, k)),
                                   _mm512_mul_ps(lo, load16(sin + half + d, k)));
    store16(out + d, _mm512_mul_ps(a, sc), k);
    store16(out + half + d, _mm512_mul_ps(b, sc), k);
  }
}

// C = head_dim / 16 vectors per head vector
template <typename T, int C>
void attention(const T* qkv, const float* cos, const float* sin, T* kc, T* vc, const int64_t* rows,
               const int64_t* slots, const bool* mask, T* out, int64_t B, int64_t Tn, int64_t H, int64_t KVH,
               int64_t cap, int64_t K) {
  constexpr int64_t hd = C * kW;
  const int64_t width = (H + 2 * KVH) * hd, G = H / KVH, R = G * Tn;
  // 1. rope the new keys and write keys and values into the cache [batch, KVH, cap, hd]
  at::parallel_for(0, B * Tn * KVH, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float kf[hd];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (Tn * KVH), t = (i / KVH) % Tn, h = i % KVH, bt = b * Tn + t;
      const T* src = qkv + bt * width + (H + h) * hd;
      const int64_t dst = ((rows[b] * KVH + h) * cap + slots[bt]) * hd;
      rope(src, cos + bt * hd, sin + bt * hd, kf, hd, 1.0f);
      for (int c = 0; c < C; ++c) {
        store16(kc + dst + c * kW, _mm512_load_ps(kf + c * kW));
        store16(vc + dst + c * kW, load16(src + KVH * hd + c * kW));
      }
    }
  });
  // 2. per (sequence, kv head): its G * Tn query rows (row r = g * Tn + t) against the keys each sees
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    // per-thread buffers, grown but never cleared: every entry a row reads is written first (stale keys past a
    // block's end or unseen by every row are only read into lanes the mask then discards)
    thread_local std::vector<float> q, s, kf, vf, m;
    thread_local std::vector<char> any;
    q.resize(R * hd); s.resize(R * K); kf.resize((K + kW) * hd); vf.resize(K * hd); m.resize(R); any.resize(K);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kvh = task % KVH;
      const T* keys = kc + (rows[b] * KVH + kvh) * cap * hd;
      const T* vals = vc + (rows[b] * KVH + kvh) * cap * hd;
      const bool* vis = mask + b * Tn * K;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t g = r / Tn, t = r % Tn, bt = b * Tn + t;
        rope(qkv + bt * width + (kvh * G + g) * hd, cos + bt * hd, sin + bt * hd, q.data() + r * hd, hd, scale);
        m[r] = kNegInf;
      }
      for (int64_t j = 0; j < K; ++j) {  // widen the keys and values some row sees, once for all rows
        bool seen = false;
        for (int64_t t = 0; t < Tn; ++t) seen |= vis[t * K + j];
        any[j] = seen;
        if (!seen) continue;
        for (int c = 0; c < C; ++c) {
          _mm512_storeu_ps(kf.data() + j * hd + c * kW, load16(keys + j * hd + c * kW));
          _mm512_storeu_ps(vf.data() + j * hd + c * kW, load16(vals + j * hd + c * kW));
        }
      }
      // first pass: scores, 16 keys at a time; each dot product: C vectors of products summed lane by lane
      // (the first a product, then fused multiply-adds), then the 16 lanes by the fixed tree of `lane_sums`
      for (int64_t j0 = 0; j0 < K; j0 += kW) {
        const int64_t n = std::min<int64_t>(kW, K - j0);
        bool some = false;
        for (int64_t l = 0; l < n; ++l) some |= any[j0 + l];
        if (!some) {
          for (int64_t r = 0; r < R; ++r) std::fill_n(s.data() + r * K + j0, n, kNegInf);
          continue;
        }
        const float* kb = kf.data() + j0 * hd;  // keys beyond n (or unseen) are stale floats: masked below
        for (int64_t r = 0; r < R; ++r) {
          const float* qr = q.data() + r * hd;
          __m512 qv[C];
          for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qr + c * kW);
          __m512 dots[kW];
          for (int l = 0; l < kW; ++l) {
            __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kb + l * hd));
            for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kb + l * hd + c * kW), acc);
            dots[l] = acc;
          }
          const __m512 sc = lane_sums(dots);
          const __mmask16 seen = visible16(vis + (r % Tn) * K + j0, n);
          const __m512 v = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), seen, sc);
          _mm512_mask_storeu_ps(s.data() + r * K + j0, tail(n), v);
          m[r] = std::max(m[r], _mm512_reduce_max_ps(v));
        }
      }
      // second pass, per row: softmax weights, then the weighted sum of values, in cache order
      for (int64_t r = 0; r < R; ++r) {
        float* sr = s.data() + r * K;
        const bool* vr = vis + (r % Tn) * K;
        const __m512 mr = _mm512_set1_ps(m[r]);
        for (int64_t j = 0; j < K; j += kW) {
          const __mmask16 k = tail(K - j);
          _mm512_mask_storeu_ps(sr + j, k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sr + j), mr)));
        }
        __m512 acc[C];
        for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
        float denom = 0.0f;
        for (int64_t j = 0; j < K; ++j) {
          if (!vr[j]) continue;
          denom += sr[j];
          const __m512 p = _mm512_set1_ps(sr[j]);
          for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vf.data() + j * hd + c * kW), acc[c]);
        }
        const __m512 dn = _mm512_set1_ps(denom);
        const int64_t g = r / Tn, t = r % Tn;
        T* o = out + (b * Tn + t) * H * hd + (kvh * G + g) * hd;
        for (int c = 0; c < C; ++c) store16(o + c * kW, _mm512_div_ps(acc[c], dn));
      }
    }
  });
}
#endif  // SPECDECODE_AVX512

#ifdef SPECDECODE_AVX2
// The same ops in 8-float vectors. AVX2 has no mask registers: a tail of n < 8 elements is read and written
// through a lane mask (floats) or a zero-padded copy (bf16).
using BF16 = at::BFloat16;
constexpr int kW = 8;
const float kNegInf = -std::numeric_limits<float>::infinity();

inline __m256i lanes_below(int64_t n) {  // all ones in lanes < n
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, kW))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256 load8(const float* p, int64_t n = kW) {
  return n >= kW ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes_below(n));
}
inline __m256 load8(const BF16* p, int64_t n = kW) {
  __m128i h;
  if (n >= kW) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint16_t buf[kW] = {0};
    std::memcpy(buf, p, n * sizeof(BF16));
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// float32 -> bf16 bits in int32 lanes, rounded to nearest even (NaN -> 0x7fc0), as torch's .to(torch.bfloat16)
inline __m256i bf16_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}
inline void store8(float* p, __m256 v, int64_t n = kW) {
  if (n >= kW) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, lanes_below(n), v);
}
inline void store8(BF16* p, __m256 v, int64_t n = kW) {
  const __m256i b = bf16_bits(v);  // values <= 0xffff: the unsigned saturating pack keeps them
  const __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08));
  if (n >= kW) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  } else {
    alignas(16) uint16_t buf[kW];
    _mm_store_si128(reinterpret_cast<__m128i*>(buf), h);
    std::memcpy(p, buf, n * sizeof(BF16));
  }
}
inline __m256 round_to(float*, __m256 v) { return v; }
inline __m256 round_to(BF16*, __m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }

// exp(x) as exp16 of the AVX-512 section
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.7f);
  const __m256 xc = _mm256_min_ps(hi, _mm256_max_ps(lo, x));  // a NaN x passes through
  const __m256 n = _mm256_round_ps(
      _mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(xc, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  const __m256 z = _mm256_mul_ps(r, r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(c));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  const __m256 low = _mm256_blendv_ps(out, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  return _mm256_blendv_ps(low, _mm256_set1_ps(std::numeric_limits<float>::infinity()), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
}

// lane l of the result: the sum of v[l]'s 8 lanes, by one fixed tree of additions
inline __m256 lane_sums(const __m256* v) {
  __m256 a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(a[2 * i]), y = _mm256_castps_pd(a[2 * i + 1]);
    b[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  // b[0]: [v0, v1, v2, v3 | v0, v1, v2, v3] (halves of each v's sum), b[1] the same for v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

// which of n <= 8 keys a query sees: all ones in those lanes
inline __m256 visible8(const bool* vis, int64_t n) {
  alignas(8) uint8_t buf[kW] = {0};
  std::memcpy(buf, vis, std::min<int64_t>(n, kW));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(buf)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(b, _mm256_setzero_si256()));
}

inline float reduce_max8(__m256 v) {
  alignas(32) float l[kW];
  _mm256_store_ps(l, v);
  float m = l[0];
  for (int i = 1; i < kW; ++i) m = std::max(m, l[i]);
  return m;
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      __m256 part = _mm256_setzero_ps();  // 8 interleaved partial sums of squares
      for (int64_t j = 0; j < D; j += kW) {
        const __m256 v = load8(xr + j, D - j);
        part = _mm256_fmadd_ps(v, v, part);
      }
      alignas(32) float lanes[kW];
      _mm256_store_ps(lanes, part);
      float ss = 0.0f;
      for (const float l : lanes) ss += l;
      const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(ss / static_cast<float>(D) + eps));
      T* o = out + r * D;
      for (int64_t j = 0; j < D; j += kW) {
        const __m256 y = round_to(o, _mm256_mul_ps(load8(xr + j, D - j), inv));
        store8(o + j, _mm256_mul_ps(load8(w + j, D - j), y), D - j);
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t I) {
  constexpr int64_t kSeg = 512;  // elements per task; a row's element i always takes the same path
  const int64_t segs = (I + kSeg - 1) / kSeg;
  at::parallel_for(0, rows * segs, 1, [&](int64_t begin, int64_t end) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / segs, i0 = (task % segs) * kSeg, i1 = std::min(I, i0 + kSeg);
      const T* g = gate_up + r * 2 * I;
      for (int64_t i = i0; i < i1; i += kW) {
        const __m256 gi = load8(g + i, i1 - i);
        const __m256 s = round_to(out, _mm256_div_ps(gi, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gi)))));
        store8(out + r * I + i, _mm256_mul_ps(s, load8(g + I + i, i1 - i)), i1 - i);
      }
    }
  });
}

template <typename T>
inline void rope(const T* x, const float* cos, const float* sin, float* out, int64_t hd, float scale) {
  const int64_t half = hd / 2;
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t d = 0; d < half; d += kW) {
    const int64_t n = half - d;
    const __m256 lo = load8(x + d, n), hi = load8(x + half + d, n);
    const __m256 a = _mm256_sub_ps(_mm256_mul_ps(lo, load8(cos + d, n)), _mm256_mul_ps(hi, load8(sin + d, n)));
    const __m256 b = _mm256_add_ps(_mm256_mul_ps(hi, load8(cos + half + d, n)), _mm256_mul_ps(lo, load8(sin + half + d, n)));
    store8(out + d, _mm256_mul_ps(a, sc), n);
    store8(out + half + d, _mm256_mul_ps(b, sc), n);
  }
}

// C = head_dim / 8 vectors per head vector; the arithmetic of the AVX-512 attention, 8 keys at a time. One task
// per (sequence, kv head): it writes its new keys and values, then attends. Keys and values are widened to float
// a tile at a time into buffers that stay in L1 while every query row of the group uses them (so the cache is
// read once per task, not once per query row); each row's sums still run over the keys in cache order, its
// partial sums parked between tiles, so the result is the same whatever the tile size.
template <typename T, int C>
void attention(const T* qkv, const float* cos, const float* sin, T* kc, T* vc, const int64_t* rows,
               const int64_t* slots, const bool* mask, T* out, int64_t B, int64_t Tn, int64_t H, int64_t KVH,
               int64_t cap, int64_t K) {
  constexpr int64_t hd = C * kW;
  constexpr int64_t kTile = 32 * 128 / hd;  // values per tile: 16 KB of floats
  const int64_t width = (H + 2 * KVH) * hd, G = H / KVH, R = G * Tn;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> q, s, m, acc, denom;  // as in the AVX-512 section: grown, never cleared
    thread_local std::vector<char> any;
    q.resize(R * hd); s.resize(R * K); m.resize(R); acc.resize(R * hd); denom.resize(R); any.resize(K);
    alignas(32) float kb[kW * hd], vt[kTile * hd];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kvh = task % KVH;
      T* keys = kc + (rows[b] * KVH + kvh) * cap * hd;
      T* vals = vc + (rows[b] * KVH + kvh) * cap * hd;
      for (int64_t t = 0; t < Tn; ++t) {  // this head's new keys (rotated, rounded to the cache dtype) and values
        const int64_t bt = b * Tn + t;
        const T* src = qkv + bt * width + (H + kvh) * hd;
        rope(src, cos + bt * hd, sin + bt * hd, kb, hd, 1.0f);
        for (int c = 0; c < C; ++c) {
          store8(keys + slots[bt] * hd + c * kW, _mm256_load_ps(kb + c * kW));
          store8(vals + slots[bt] * hd + c * kW, load8(src + KVH * hd + c * kW));
        }
      }
      const bool* vis = mask + b * Tn * K;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t g = r / Tn, t = r % Tn, bt = b * Tn + t;
        rope(qkv + bt * width + (kvh * G + g) * hd, cos + bt * hd, sin + bt * hd, q.data() + r * hd, hd, scale);
        m[r] = kNegInf;
      }
      for (int64_t j = 0; j < K; ++j) {
        bool seen = false;
        for (int64_t t = 0; t < Tn; ++t) seen |= vis[t * K + j];
        any[j] = seen;
      }
      for (int64_t j0 = 0; j0 < K; j0 += kW) {  // scores, 8 keys at a time
        const int64_t n = std::min<int64_t>(kW, K - j0);
        bool some = false;
        for (int64_t l = 0; l < n; ++l) some |= any[j0 + l];
        if (!some) {
          for (int64_t r = 0; r < R; ++r) std::fill_n(s.data() + r * K + j0, n, kNegInf);
          continue;
        }
        for (int64_t l = 0; l < kW; ++l)  // unseen keys (and lanes beyond n) are zeros: their lanes become -inf
          for (int c = 0; c < C; ++c)
            _mm256_store_ps(kb + l * hd + c * kW, l < n && any[j0 + l] ? load8(keys + (j0 + l) * hd + c * kW)
                                                                      : _mm256_setzero_ps());
        for (int64_t r = 0; r < R; ++r) {
          const float* qr = q.data() + r * hd;
          __m256 dots[kW];
          for (int l = 0; l < kW; ++l) {  // q from L1 in the loop: C may exceed the 16 registers
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qr), _mm256_load_ps(kb + l * hd));
            for (int c = 1; c < C; ++c)
              a = _mm256_fmadd_ps(_mm256_loadu_ps(qr + c * kW), _mm256_load_ps(kb + l * hd + c * kW), a);
            dots[l] = a;
          }
          const __m256 v = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), lane_sums(dots),
                                            visible8(vis + (r % Tn) * K + j0, n));
          store8(s.data() + r * K + j0, v, n);
          m[r] = std::max(m[r], reduce_max8(v));  // lanes beyond n hold -inf
        }
      }
      for (int64_t r = 0; r < R; ++r) {  // p_j = exp(s_j - m)
        float* sr = s.data() + r * K;
        const __m256 mr = _mm256_set1_ps(m[r]);
        for (int64_t j = 0; j < K; j += kW) store8(sr + j, exp8(_mm256_sub_ps(load8(sr + j, K - j), mr)), K - j);
        std::fill_n(acc.data() + r * hd, hd, 0.0f);
        denom[r] = 0.0f;
      }
      for (int64_t j0 = 0; j0 < K; j0 += kTile) {  // sum_j p_j v_j and sum_j p_j, a tile of values at a time
        const int64_t j1 = std::min(K, j0 + kTile);
        for (int64_t j = j0; j < j1; ++j)
          if (any[j])
            for (int c = 0; c < C; ++c) _mm256_store_ps(vt + (j - j0) * hd + c * kW, load8(vals + j * hd + c * kW));
        for (int64_t r = 0; r < R; ++r) {
          const float* sr = s.data() + r * K;
          const bool* vr = vis + (r % Tn) * K;
          float* ar = acc.data() + r * hd;
          __m256 a[C];
          for (int c = 0; c < C; ++c) a[c] = _mm256_loadu_ps(ar + c * kW);
          float d = denom[r];
          for (int64_t j = j0; j < j1; ++j) {
            if (!vr[j]) continue;
            d += sr[j];
            const __m256 p = _mm256_set1_ps(sr[j]);
            for (int c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(p, _mm256_load_ps(vt + (j - j0) * hd + c * kW), a[c]);
          }
          for (int c = 0; c < C; ++c) _mm256_storeu_ps(ar + c * kW, a[c]);
          denom[r] = d;
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const __m256 dn = _mm256_set1_ps(denom[r]);
        const int64_t g = r / Tn, t = r % Tn;
        T* o = out + (b * Tn + t) * H * hd + (kvh * G + g) * hd;
        const float* ar = acc.data() + r * hd;
        for (int c = 0; c < C; ++c) store8(o + c * kW, _mm256_div_ps(_mm256_loadu_ps(ar + c * kW), dn));
      }
    }
  });
}
#endif  // SPECDECODE_AVX2

#ifdef SPECDECODE_OPS
template <typename F>
void dispatch(at::ScalarType t, F&& f) {  // float32 or bfloat16
  if (t == at::kFloat) f(static_cast<float*>(nullptr));
  else f(static_cast<BF16*>(nullptr));
}
#endif

}  // namespace

namespace specdecode {

static void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(available(), "the decode ops need a CPU with AVX-512 (BW, VL) or AVX2 + FMA");
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, not ", t.scalar_type());
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.numel() == x.size(-1),
              "the norm's weight must be contiguous, of x's dtype and width");
  auto out = torch::empty_like(x);
#ifdef SPECDECODE_OPS
  const int64_t D = x.size(-1), rows = x.numel() / D;
  dispatch(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows(static_cast<const T*>(x.data_ptr()), static_cast<const T*>(w.data_ptr()),
                  static_cast<T*>(out.data_ptr()), rows, D, static_cast<float>(eps));
  });
#endif
  return out;
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t I = gate_up.size(-1) / 2;
  TORCH_CHECK(gate_up.size(-1) == 2 * I, "gate_up must hold gate then up: an even width");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
#ifdef SPECDECODE_OPS
  dispatch(gate_up.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_mul_rows(static_cast<const T*>(gate_up.data_ptr()), static_cast<T*>(out.data_ptr()),
                  gate_up.numel() / (2 * I), I);
  });
#endif
  return out;
}

// qkv [B, T, (H + 2 KVH) hd]; cos, sin [B, T, hd] float32; k_cache, v_cache [batch, KVH, cap, hd] (written at
// rows x slots); rows [B], slots [B, T] int64; mask [B, T, K] bool (K <= cap: which cache slots each query sees)
torch::Tensor rope_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                             torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& rows,
                             const torch::Tensor& slots, const torch::Tensor& mask, int64_t H, int64_t KVH) {
  check_rows(qkv, "qkv");
  const int64_t B = qkv.size(0), Tn = qkv.size(1), hd = k_cache.size(3), cap = k_cache.size(2), K = mask.size(2);
  TORCH_CHECK(hd % 16 == 0 && hd <= 256 && hd / 16 != 7 && hd / 16 < 9 || hd == 256,
              "the decode attention takes head_dim 16, 32, ..., 128 (not 112) or 256, not ", hd);
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(2) == (H + 2 * KVH) * hd && H % KVH == 0, "qkv has the wrong width");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == qkv.scalar_type() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == qkv.scalar_type() &&
              k_cache.size(1) == KVH, "the caches must be contiguous [batch, KVH, capacity, head_dim] of qkv's dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.numel() == B * Tn * hd && sin.numel() == B * Tn * hd,
              "cos and sin must be contiguous float32 [B, T, head_dim]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && rows.numel() == B &&
              slots.numel() == B * Tn && rows.is_contiguous() && slots.is_contiguous(), "rows [B], slots [B, T] int64");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 3 && mask.size(0) == B &&
              mask.size(1) == Tn && K <= cap, "mask must be contiguous bool [B, T, K <= capacity]");
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(r[b] >= 0 && r[b] < k_cache.size(0), "cache row out of range");
    for (int64_t other = 0; other < b; ++other)  // one task writes and reads a row's cache: no two sequences share it
      TORCH_CHECK(r[other] != r[b], "two sequences in one cache row");
    for (int64_t t = 0; t < Tn; ++t) TORCH_CHECK(sl[b * Tn + t] >= 0 && sl[b * Tn + t] < cap, "slot out of range");
  }
  auto out = torch::empty({B, Tn, H * hd}, qkv.options());
#ifdef SPECDECODE_OPS
  dispatch(qkv.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto run = [&](auto c) {
      attention<T, decltype(c)::value>(static_cast<const T*>(qkv.data_ptr()), cos.data_ptr<float>(),
                                       sin.data_ptr<float>(), static_cast<T*>(k_cache.data_ptr()),
                                       static_cast<T*>(v_cache.data_ptr()), r, sl, mask.data_ptr<bool>(),
                                       static_cast<T*>(out.data_ptr()), B, Tn, H, KVH, cap, K);
    };
    switch (hd / kW) {  // head_dim 16, 32, 48, 64, 80, 96, 128 or 256
      case 1: run(std::integral_constant<int, 1>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      case 3: run(std::integral_constant<int, 3>{}); break;
      case 4: run(std::integral_constant<int, 4>{}); break;
      case 5: run(std::integral_constant<int, 5>{}); break;
      case 6: run(std::integral_constant<int, 6>{}); break;
      case 8: run(std::integral_constant<int, 8>{}); break;
      case 10: run(std::integral_constant<int, 10>{}); break;
      case 12: run(std::integral_constant<int, 12>{}); break;
      case 16: run(std::integral_constant<int, 16>{}); break;
      default: run(std::integral_constant<int, 256 / kW>{});
    }
  });
#endif
  return out;
}

void bind_decode_ops(pybind11::module_& m) {
  m.def("available", &available, "whether this build can run the ops (AVX-512 or AVX2 + FMA)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, row-invariant");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of each row of [.., 2I], row-invariant");
  m.def("rope_attention", &rope_attention, "rotary embedding, KV-cache write and attention, row-invariant");
}

}  // namespace specdecode
