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
// W = 16 floats per vector on AVX-512 CPUs, 8 on AVX2 + FMA ones (one code path below, written once over a
// traits struct per ISA, `Avx512` or `Avx2`, and instantiated for the one this build has: the same steps).
//   rms_norm:  ss = sum of x^2 in W interleaved partial sums (fused multiply-add), added 0..W-1 in order;
//              y = dtype(x * (1 / sqrt(ss / D + eps))); out = dtype(w * y)  (transformers' RMSNorm, up to rounding)
//   silu_mul:  out = dtype(dtype(g / (1 + exp(-g))) * u)
//   attention: rope on q and k in float32 (k rounded to the cache's dtype as it is written); for each query row,
//              s_j = q . k_j over the keys it sees, q pre-scaled by 1 / sqrt(hd) (products in W lanes by head
//              dimension, the first a product then fused multiply-adds; the W lanes summed by one fixed tree),
//              m = max s_j; p_j = exp(s_j - m); out = (sum_j p_j v_j) / (sum_j p_j), sums in cache order.
//   exp:       a Cephes-style polynomial with the same operations for every element (no libm).
// Built with -ffp-contract=off: the only fused multiply-adds are the explicit ones (the traits' fma).

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

#ifdef SPECDECODE_OPS
using BF16 = at::BFloat16;
const float kNegInf = -std::numeric_limits<float>::infinity();

// Vector traits: all that differs between the ISAs, as in ggml's simd-mappings; the kernels below use only these.
//   V: W float32 lanes; M: a lane mask (what lt, gt and visible give, what select takes: m ? b : a, lane by lane)
//   zero .. fma: one instruction each (fma(a, b, c) = a * b + c rounded once; min and max x86's: the second
//     operand where either is NaN); floor: round toward -inf; exp2i(n): 2^n for integral n in float32's exponent
//     range, from the bits (n + 127) << 23
//   load(p, n), store(p, v, n): the first min(n, W) elements at p (float or bf16: widened exactly, rounded to
//     nearest even by round_bf16), no others read or written (lanes from n read as 0); loadu/storeu: W floats at
//     any address; load_aligned/store_aligned: W floats at a multiple of their size (W * 4 bytes)
//   lane_sums(v[W]): lane l = the sum of v[l]'s W lanes, by one fixed tree; reduce_max: the max of the W lanes
//     (in one fixed order);
//   visible(vis, n): lanes l < n with vis[l] set (of n <= W bools)
#ifdef SPECDECODE_AVX512
struct Avx512 {  // AVX-512 F + BW + VL: tails through mask registers
  using V = __m512;
  using M = __mmask16;
  static constexpr int W = 16;

  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V floor(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static V exp2i(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static M lt(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M gt(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static V select(M m, V a, V b) { return _mm512_mask_mov_ps(a, m, b); }

  static M tail(int64_t n) { return n >= W ? 0xFFFF : static_cast<M>((1u << n) - 1); }
  static V load(const float* p, int64_t n = W) { return _mm512_maskz_loadu_ps(tail(n), p); }
  static V load(const BF16* p, int64_t n = W) {
    return from_bf16_bits(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(tail(n), p)));
  }
  static void store(float* p, V v, int64_t n = W) { _mm512_mask_storeu_ps(p, tail(n), v); }
  static void store(BF16* p, V v, int64_t n = W) {
    _mm256_mask_storeu_epi16(p, tail(n), _mm512_cvtepi32_epi16(bf16_bits(v)));
  }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V load_aligned(const float* p) { return _mm512_load_ps(p); }
  static void store_aligned(float* p, V v) { _mm512_store_ps(p, v); }

  // float32 -> bf16 bits in int32 lanes, rounded to nearest even (NaN -> 0x7fc0), as torch's .to(torch.bfloat16)
  static __m512i bf16_bits(V v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  }
  static V from_bf16_bits(__m512i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)); }
  static V round_bf16(V v) { return from_bf16_bits(bf16_bits(v)); }

  static V lane_sums(const V* v) {
    V a[8], b[4];
    for (int i = 0; i < 8; ++i)
      a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
      const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
      b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const V c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const V c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  static M visible(const bool* vis, int64_t n) {
    const __m128i b = _mm_maskz_loadu_epi8(tail(n), vis);
    return _mm_test_epi8_mask(b, b);
  }
};
using Isa = Avx512;
#else
struct Avx2 {  // AVX2 + FMA: no mask registers; a tail is read and written through a lane mask (floats) or a
               // zero-padded copy (bf16)
  using V = __m256;
  using M = __m256;  // all ones in the lanes set
  static constexpr int W = 8;

  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V floor(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static V exp2i(V n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static M lt(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static M gt(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static V select(M m, V a, V b) { return _mm256_blendv_ps(a, b, m); }

  static __m256i lanes_below(int64_t n) {  // all ones in lanes < n
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, W))),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static V load(const float* p, int64_t n = W) {
    return n >= W ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes_below(n));
  }
  static V load(const BF16* p, int64_t n = W) {
    __m128i h;
    if (n >= W) {
      h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    } else {
      alignas(16) uint16_t buf[W] = {0};
      std::memcpy(buf, p, n * sizeof(BF16));
      h = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
    }
    return from_bf16_bits(_mm256_cvtepu16_epi32(h));
  }
  static void store(float* p, V v, int64_t n = W) {
    if (n >= W) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, lanes_below(n), v);
  }
  static void store(BF16* p, V v, int64_t n = W) {
    const __m256i b = bf16_bits(v);  // values <= 0xffff: the unsigned saturating pack keeps them
    const __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08));
    if (n >= W) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
    } else {
      alignas(16) uint16_t buf[W];
      _mm_store_si128(reinterpret_cast<__m128i*>(buf), h);
      std::memcpy(p, buf, n * sizeof(BF16));
    }
  }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V load_aligned(const float* p) { return _mm256_load_ps(p); }
  static void store_aligned(float* p, V v) { _mm256_store_ps(p, v); }

  static __m256i bf16_bits(V v) {  // as Avx512::bf16_bits
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  }
  static V from_bf16_bits(__m256i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)); }
  static V round_bf16(V v) { return from_bf16_bits(bf16_bits(v)); }

  static V lane_sums(const V* v) {
    V a[4], b[2];
    for (int i = 0; i < 4; ++i)
      a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i) {
      const __m256d x = _mm256_castps_pd(a[2 * i]), y = _mm256_castps_pd(a[2 * i + 1]);
      b[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    // b[0]: [v0, v1, v2, v3 | v0, v1, v2, v3] (halves of each v's sum), b[1] the same for v4..v7
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
  }
  static float reduce_max(V v) {  // lanes 0..7 in order
    alignas(32) float l[W];
    _mm256_store_ps(l, v);
    float m = l[0];
    for (int i = 1; i < W; ++i) m = std::max(m, l[i]);
    return m;
  }
  static M visible(const bool* vis, int64_t n) {
    alignas(8) uint8_t buf[W] = {0};
    std::memcpy(buf, vis, std::min<int64_t>(n, W));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(buf)));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(b, _mm256_setzero_si256()));
  }
};
using Isa = Avx2;
#endif
constexpr int kW = Isa::W;  // floats per vector

// The kernels, over the traits S (instantiated for Isa only).

// v rounded to T and widened back: what storing then loading would give
template <class S>
inline typename S::V round_to(float*, typename S::V v) { return v; }
template <class S>
inline typename S::V round_to(BF16*, typename S::V v) { return S::round_bf16(v); }

// the W lanes of v added in order, 0..W-1 (from 0.0f)
template <class S>
inline float sum_in_order(typename S::V v) {
  alignas(64) float lanes[S::W];
  S::store_aligned(lanes, v);
  float sum = 0.0f;
  for (const float l : lanes) sum += l;
  return sum;
}

// exp(x): 0 below -87.3 (and for -inf), inf above 88.7, NaN for NaN; the same operations for every lane
template <class S>
inline typename S::V vexp(typename S::V x) {
  using V = typename S::V;
  const V lo = S::set1(-87.3f), hi = S::set1(88.7f);
  const V xc = S::min(hi, S::max(lo, x));  // (lo, x) and (hi, .): a NaN x passes through
  const V n = S::floor(S::add(S::mul(xc, S::set1(1.44269504088896341f)), S::set1(0.5f)));
  V r = S::sub(xc, S::mul(n, S::set1(0.693359375f)));
  r = S::sub(r, S::mul(n, S::set1(-2.12194440e-4f)));
  const V z = S::mul(r, r);
  V y = S::set1(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = S::add(S::mul(y, r), S::set1(c));
  y = S::add(S::add(S::mul(y, z), r), S::set1(1.0f));
  const V out = S::mul(y, S::exp2i(n));
  const V low = S::select(S::lt(x, lo), out, S::zero());
  return S::select(S::gt(x, hi), low, S::set1(std::numeric_limits<float>::infinity()));
}

template <class S, typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t D, float eps) {
  using V = typename S::V;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      V part = S::zero();  // W interleaved partial sums of squares
      for (int64_t j = 0; j < D; j += S::W) {
        const V v = S::load(xr + j, D - j);
        part = S::fma(v, v, part);
      }
      const float ss = sum_in_order<S>(part);
      const V inv = S::set1(1.0f / std::sqrt(ss / static_cast<float>(D) + eps));
      T* o = out + r * D;
      for (int64_t j = 0; j < D; j += S::W) {
        const int64_t n = D - j;  // a local: one tail mask for the three accesses
        const V y = round_to<S>(o, S::mul(S::load(xr + j, n), inv));
        S::store(o + j, S::mul(S::load(w + j, n), y), n);
      }
    }
  });
}

template <class S, typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t I) {
  using V = typename S::V;
  constexpr int64_t kSeg = 512;  // elements per task; a row's element i always takes the same path
  const int64_t segs = (I + kSeg - 1) / kSeg;
  at::parallel_for(0, rows * segs, 1, [&](int64_t begin, int64_t end) {
    const V one = S::set1(1.0f);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / segs, i0 = (task % segs) * kSeg, i1 = std::min(I, i0 + kSeg);
      const T* g = gate_up + r * 2 * I;
      for (int64_t i = i0; i < i1; i += S::W) {
        const V gi = S::load(g + i, i1 - i);
        const V s = round_to<S>(out, S::div(gi, S::add(one, vexp<S>(S::sub(S::zero(), gi)))));
        S::store(out + r * I + i, S::mul(s, S::load(g + I + i, i1 - i)), i1 - i);
      }
    }
  });
}

// rotary embedding of one head vector (transformers' rotate_half convention) in float32, times `scale`
template <class S, typename T>
inline void rope(const T* x, const float* cos, const float* sin, float* out, int64_t hd, float scale) {
  using V = typename S::V;
  const int64_t half = hd / 2;
  const V sc = S::set1(scale);
  for (int64_t d = 0; d < half; d += S::W) {
    const int64_t n = half - d;
    const V lo = S::load(x + d, n), hi = S::load(x + half + d, n);
    const V a = S::sub(S::mul(lo, S::load(cos + d, n)), S::mul(hi, S::load(sin + d, n)));
    const V b = S::add(S::mul(hi, S::load(cos + half + d, n)), S::mul(lo, S::load(sin + half + d, n)));
    S::store(out + d, S::mul(a, sc), n);
    S::store(out + half + d, S::mul(b, sc), n);
  }
}

// C = head_dim / W vectors per head vector. One task per (sequence, kv head): it writes its new keys and values,
// then attends. Keys and values are widened to float a tile at a time into buffers that stay in L1 while every
// query row of the group uses them (so the cache is read once per task, not once per query row); each row's sums
// still run over the keys in cache order, its partial sums parked between tiles, so the result is the same
// whatever the tile size.
template <class S, typename T, int C>
void attention(const T* qkv, const float* cos, const float* sin, T* kc, T* vc, const int64_t* rows,
               const int64_t* slots, const bool* mask, T* out, int64_t B, int64_t Tn, int64_t H, int64_t KVH,
               int64_t cap, int64_t K) {
  using V = typename S::V;
  constexpr int W = S::W;
  constexpr int64_t hd = C * W;
  constexpr int64_t kTile = 32 * 128 / hd;  // values per tile: 16 KB of floats
  const int64_t width = (H + 2 * KVH) * hd, G = H / KVH, R = G * Tn;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    // per-thread buffers, grown but never cleared: every entry a row reads is written first
    thread_local std::vector<float> q, s, m, acc, denom;
    thread_local std::vector<char> any;
    q.resize(R * hd); s.resize(R * K); m.resize(R); acc.resize(R * hd); denom.resize(R); any.resize(K);
    alignas(64) float kb[W * hd], vt[kTile * hd];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kvh = task % KVH;
      T* keys = kc + (rows[b] * KVH + kvh) * cap * hd;
      T* vals = vc + (rows[b] * KVH + kvh) * cap * hd;
      for (int64_t t = 0; t < Tn; ++t) {  // this head's new keys (rotated, rounded to the cache dtype) and values
        const int64_t bt = b * Tn + t;
        const T* src = qkv + bt * width + (H + kvh) * hd;
        rope<S>(src, cos + bt * hd, sin + bt * hd, kb, hd, 1.0f);
        for (int c = 0; c < C; ++c) {
          S::store(keys + slots[bt] * hd + c * W, S::load_aligned(kb + c * W));
          S::store(vals + slots[bt] * hd + c * W, S::load(src + KVH * hd + c * W));
        }
      }
      const bool* vis = mask + b * Tn * K;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t g = r / Tn, t = r % Tn, bt = b * Tn + t;
        rope<S>(qkv + bt * width + (kvh * G + g) * hd, cos + bt * hd, sin + bt * hd, q.data() + r * hd, hd, scale);
        m[r] = kNegInf;
      }
      for (int64_t j = 0; j < K; ++j) {  // which keys some row sees
        bool seen = false;
        for (int64_t t = 0; t < Tn; ++t) seen |= vis[t * K + j];
        any[j] = seen;
      }
      // scores, W keys at a time; each dot product: C vectors of products summed lane by lane (the first a product,
      // then fused multiply-adds), then the W lanes by the fixed tree of `lane_sums`
      for (int64_t j0 = 0; j0 < K; j0 += W) {
        const int64_t n = std::min<int64_t>(W, K - j0);
        bool some = false;
        for (int64_t l = 0; l < n; ++l) some |= any[j0 + l];
        if (!some) {
          for (int64_t r = 0; r < R; ++r) std::fill_n(s.data() + r * K + j0, n, kNegInf);
          continue;
        }
        for (int64_t l = 0; l < W; ++l)  // unseen keys (and lanes beyond n) are zeros: their lanes become -inf
          for (int c = 0; c < C; ++c)
            S::store_aligned(kb + l * hd + c * W, l < n && any[j0 + l] ? S::load(keys + (j0 + l) * hd + c * W)
                                                                      : S::zero());
        for (int64_t r = 0; r < R; ++r) {
          const float* qr = q.data() + r * hd;
          V dots[W];
          for (int l = 0; l < W; ++l) {  // q from L1 in the loop: C may exceed the registers
            V a = S::mul(S::loadu(qr), S::load_aligned(kb + l * hd));
            for (int c = 1; c < C; ++c) a = S::fma(S::loadu(qr + c * W), S::load_aligned(kb + l * hd + c * W), a);
            dots[l] = a;
          }
          const V v = S::select(S::visible(vis + (r % Tn) * K + j0, n), S::set1(kNegInf), S::lane_sums(dots));
          S::store(s.data() + r * K + j0, v, n);
          m[r] = std::max(m[r], S::reduce_max(v));  // lanes beyond n hold -inf
        }
      }
      for (int64_t r = 0; r < R; ++r) {  // p_j = exp(s_j - m)
        float* sr = s.data() + r * K;
        const V mr = S::set1(m[r]);
        for (int64_t j = 0; j < K; j += W) {
          const int64_t n = K - j;
          S::store(sr + j, vexp<S>(S::sub(S::load(sr + j, n), mr)), n);
        }
        std::fill_n(acc.data() + r * hd, hd, 0.0f);
        denom[r] = 0.0f;
      }
      for (int64_t j0 = 0; j0 < K; j0 += kTile) {  // sum_j p_j v_j and sum_j p_j, a tile of values at a time
        const int64_t j1 = std::min(K, j0 + kTile);
        for (int64_t j = j0; j < j1; ++j)
          if (any[j])
            for (int c = 0; c < C; ++c) S::store_aligned(vt + (j - j0) * hd + c * W, S::load(vals + j * hd + c * W));
        for (int64_t r = 0; r < R; ++r) {
          const float* sr = s.data() + r * K;
          const bool* vr = vis + (r % Tn) * K;
          float* ar = acc.data() + r * hd;
          V a[C];
          for (int c = 0; c < C; ++c) a[c] = S::loadu(ar + c * W);
          float d = denom[r];
          for (int64_t j = j0; j < j1; ++j) {
            if (!vr[j]) continue;
            d += sr[j];
            const V p = S::set1(sr[j]);
            for (int c = 0; c < C; ++c) a[c] = S::fma(p, S::load_aligned(vt + (j - j0) * hd + c * W), a[c]);
          }
          for (int c = 0; c < C; ++c) S::storeu(ar + c * W, a[c]);
          denom[r] = d;
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const V dn = S::set1(denom[r]);
        const int64_t g = r / Tn, t = r % Tn;
        T* o = out + (b * Tn + t) * H * hd + (kvh * G + g) * hd;
        const float* ar = acc.data() + r * hd;
        for (int c = 0; c < C; ++c) S::store(o + c * W, S::div(S::loadu(ar + c * W), dn));
      }
    }
  });
}

template <typename F>
void dispatch(at::ScalarType t, F&& f) {  // float32 or bfloat16
  if (t == at::kFloat) f(static_cast<float*>(nullptr));
  else f(static_cast<BF16*>(nullptr));
}
#endif  // SPECDECODE_OPS

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
    rms_norm_rows<Isa>(static_cast<const T*>(x.data_ptr()), static_cast<const T*>(w.data_ptr()),
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
    silu_mul_rows<Isa>(static_cast<const T*>(gate_up.data_ptr()), static_cast<T*>(out.data_ptr()),
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
      attention<Isa, T, decltype(c)::value>(static_cast<const T*>(qkv.data_ptr()), cos.data_ptr<float>(),
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
