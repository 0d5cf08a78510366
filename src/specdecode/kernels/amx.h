// What the AMX kernels share (int4_amx.cpp, gguf_amx.cpp): the tile configuration, the groups' input sums and the
// output rows. See int4_amx.cpp for the packed weight layout both read.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define SPECDECODE_AMX 1
#endif

namespace amx {

constexpr int kChunk = 32;        // inputs per tile multiply
constexpr int kChunkBytes = 256;  // packed bytes per N-tile and chunk
constexpr int kMaxRows = 16;      // rows per tile
constexpr int kPrefetch = 2048;   // bytes ahead in the packed weights (the hardware prefetcher alone lagged)

// xs[m * G + g]: x's sum over group g, left to right in fp32
inline void group_sums(const at::BFloat16* x, int64_t k, int64_t K, int64_t group, float* xs) {
  const int64_t G = K / group;
  at::parallel_for(0, k * G, 64, [&](int64_t begin, int64_t end) {  // each sum alone: any split is exact
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / G, g = i % G;
      float s = 0.f;
      for (int64_t c = g * group; c < (g + 1) * group; ++c) s = s + static_cast<float>(x[m * K + c]);
      xs[i] = s;
    }
  });
}

#ifdef SPECDECODE_AMX
inline bool permitted() {  // Linux hands out AMX state per process on request (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

// tiles 0, 1: activations (M rows x `inputs` bf16); 2, 3: weights (inputs / 2 pair-rows x 16 outputs x 2);
// 4-7: C (M x 16 fp32). inputs: 32, or 16 for groups of 16
inline void configure(int M, int inputs = kChunk) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = (t == 2 || t == 3) ? inputs / 2 : M;
    cfg.colsb[t] = (t == 0 || t == 1) ? 2 * inputs : 64;
  }
  _tile_loadconfig(&cfg);
}

inline void store_row(void* out, int64_t row, int64_t ldo, __m512 acc, bool bf16_out) {
  if (bf16_out)  // round to nearest even, as torch's .to(torch.bfloat16) (but denormals become zero)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + row * ldo),
                        (__m256i)_mm512_cvtneps_pbh(acc));
  else
    _mm512_storeu_ps(static_cast<float*>(out) + row * ldo, acc);
}
#endif

}  // namespace amx

bool available();  // int4_amx.cpp: whether this build and this CPU can run the AMX kernels
torch::Tensor gguf_amx_mm(torch::Tensor x, torch::Tensor lo, torch::Tensor hi, torch::Tensor d, torch::Tensor sc,
                          torch::Tensor dm, torch::Tensor m, int64_t group, int64_t block, int64_t bits, int64_t bias,
                          bool bf16_out);  // gguf_amx.cpp
