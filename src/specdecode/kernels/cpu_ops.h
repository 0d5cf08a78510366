// What the sources of our CPU extension (w4a8.cpp, gguf_int8.cpp, decode_ops.cpp, layer.cpp; built together by
// kernels/build.py)
// call across files.
#pragma once

#include <torch/extension.h>

namespace specdecode {

// w4a8.cpp: int4 weights x int8 activations, [..., K] -> [..., N] in dtype (the layout and arithmetic are there)
torch::Tensor w4a8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor wscale, torch::Tensor d, torch::Tensor sub,
                      torch::Tensor corr, c10::optional<torch::Tensor> bias, c10::optional<at::ScalarType> dtype);
void bind_w4a8(pybind11::module_& m);

// gguf_int8.cpp: a GGUF tensor's blocks x int8 activations, [k, K] -> [k, N (whole tiles)] float32 (layout there)
torch::Tensor gguf_int8_mm(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor dm, torch::Tensor sc,
                           torch::Tensor m, int64_t bits, int64_t block, int64_t group, int64_t bias);
void bind_gguf_int8(pybind11::module_& m);

// decode_ops.cpp: the row-invariant rest of a layer
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
torch::Tensor rope_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                             torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& rows,
                             const torch::Tensor& slots, const torch::Tensor& mask, int64_t H, int64_t KVH);
void bind_decode_ops(pybind11::module_& m);

}  // namespace specdecode
