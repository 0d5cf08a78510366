// The vector intrinsics of our CPU kernels, and which AVX-512 paths a build compiles.
//
// A normal build takes the compiler's <immintrin.h> and the paths this CPU has (-march=native). A build with
// -DSPECDECODE_EMULATE_AVX512 (tests only) compiles the AVX-512 paths on any x86 CPU through SIMDe's portable
// versions of the same intrinsics (the simde-py package), so the tests hold those paths to the reference and to
// the per-op path on CPUs without AVX-512. That checks the code's logic (packing, lanes, masks, tails) and the
// alignment of its aligned 64-byte loads and stores, not the hardware's speed.
#pragma once

#ifdef SPECDECODE_EMULATE_AVX512
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define SPECDECODE_HAS_AVX512 1       // F, BW and VL: the decode ops
#define SPECDECODE_HAS_AVX512_VNNI 1  // and VNNI: w4a8's per-block path
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <cstring>
// Intrinsics as the instructions define them where SIMDe 0.8.2 lacks them or differs: its masked loads and stores
// touch every lane (a masked store writes zeros over the bytes it must leave alone; here only the masked elements
// are read or written), its vrndscaleps misreads the immediate, and its aligned loads and stores do not check the
// alignment the hardware requires (here they raise an error).
namespace specdecode_simde {
// 16 elements of type E at p, only those of mask k read (the others 0) or written
template <typename E, typename V, V (*Loadu)(const void*)>
inline V maskz_loadu(simde__mmask16 k, const void* p) {
  E v[16] = {};
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(v + i, static_cast<const E*>(p) + i, sizeof(E));
  return Loadu(v);
}
template <typename E, typename V, void (*Storeu)(void*, V)>
inline void mask_storeu(void* p, simde__mmask16 k, V a) {
  E v[16];
  Storeu(v, a);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(static_cast<E*>(p) + i, v + i, sizeof(E));
}
inline simde__mmask16 test_epi8_mask(simde__m128i a, simde__m128i b) {  // bit i: a[i] & b[i] != 0
  int8_t x[16], y[16];
  simde_mm_storeu_si128(x, a);
  simde_mm_storeu_si128(y, b);
  simde__mmask16 k = 0;
  for (int i = 0; i < 16; ++i) k |= static_cast<simde__mmask16>((x[i] & y[i]) != 0) << i;
  return k;
}
inline simde__m256i cvtepi32_epi16(simde__m512i a) {  // vpmovdw: each int32's low 16 bits
  int32_t in[16];
  int16_t out[16];
  simde_mm512_storeu_si512(in, a);
  for (int i = 0; i < 16; ++i) out[i] = static_cast<int16_t>(in[i]);
  return simde_mm256_loadu_si256(out);
}
// vpmovsxbd, vpmovzxbd: 16 int8 or uint8 to int32 (missing in SIMDe 0.8.2)
template <typename E>
inline simde__m512i cvt8_epi32(simde__m128i a) {
  E in[16];
  int32_t out[16];
  simde_mm_storeu_si128(in, a);
  for (int i = 0; i < 16; ++i) out[i] = in[i];
  return simde_mm512_loadu_si512(out);
}
// aligned 64-byte loads and stores, which fault on hardware where the address is not a multiple of 64
inline void check_aligned(const void* p) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(p) % 64 == 0, "a 64-byte aligned AVX-512 load or store at ", p,
              ": AVX-512 hardware faults there");
}
inline simde__m512 load_ps(const void* p) { return check_aligned(p), simde_mm512_loadu_ps(p); }
inline simde__m512i load_si512(const void* p) { return check_aligned(p), simde_mm512_loadu_si512(p); }
inline void store_ps(void* p, simde__m512 a) { check_aligned(p), simde_mm512_storeu_ps(p, a); }
// vrndscaleps: imm8 bits 7..4 keep that many fraction bits, bits 1..0 the rounding (SIMDe 0.8.2 misreads
// _MM_FROUND_NO_EXC, bit 3, and rounds to halves)
inline simde__m512 roundscale_ps(simde__m512 a, int imm8) {
  float v[16];
  simde_mm512_storeu_ps(v, a);
  const float scale = static_cast<float>(1 << (imm8 >> 4));
  for (float& x : v) {
    const float y = x * scale;
    switch (imm8 & 3) {
      case 0: x = std::nearbyint(y) / scale; break;  // to nearest even (the default rounding mode)
      case 1: x = std::floor(y) / scale; break;
      case 2: x = std::ceil(y) / scale; break;
      default: x = std::trunc(y) / scale;
    }
  }
  return simde_mm512_loadu_ps(v);
}
}  // namespace specdecode_simde
#undef _mm512_load_ps
#undef _mm512_load_si512
#undef _mm512_store_ps
#undef _mm512_roundscale_ps
#undef _mm512_cvtepi8_epi32
#undef _mm512_cvtepu8_epi32
#undef _mm512_maskz_loadu_ps
#undef _mm512_mask_storeu_ps
#undef _mm256_maskz_loadu_epi16
#undef _mm256_mask_storeu_epi16
#define _mm512_maskz_loadu_ps specdecode_simde::maskz_loadu<float, simde__m512, simde_mm512_loadu_ps>
#define _mm512_mask_storeu_ps specdecode_simde::mask_storeu<float, simde__m512, simde_mm512_storeu_ps>
#define _mm256_maskz_loadu_epi16 specdecode_simde::maskz_loadu<int16_t, simde__m256i, simde_mm256_loadu_si256>
#define _mm256_mask_storeu_epi16 specdecode_simde::mask_storeu<int16_t, simde__m256i, simde_mm256_storeu_si256>
#define _mm_maskz_loadu_epi8 specdecode_simde::maskz_loadu<int8_t, simde__m128i, simde_mm_loadu_si128>
#define _mm_test_epi8_mask specdecode_simde::test_epi8_mask
#define _mm512_cvtepi32_epi16 specdecode_simde::cvtepi32_epi16
#define _mm512_roundscale_ps specdecode_simde::roundscale_ps
#define _mm512_cvtepi8_epi32 specdecode_simde::cvt8_epi32<int8_t>
#define _mm512_cvtepu8_epi32 specdecode_simde::cvt8_epi32<uint8_t>
#define _mm512_load_ps specdecode_simde::load_ps
#define _mm512_load_si512 specdecode_simde::load_si512
#define _mm512_store_ps specdecode_simde::store_ps
#else
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPECDECODE_HAS_AVX512 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPECDECODE_HAS_AVX512_VNNI 1
#endif
#endif
