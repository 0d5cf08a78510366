// A whole decoder layer in one call, for decode and verify steps of a model whose linears are all W4A8, or all a
// GGUF file's blocks on gguf_int8.cpp's kernel.
//
// Why: from Python a layer is nine kernel calls, their dtype conversions and two adds: the interpreter and dispatch
// between them cost a small model's decode step a sizeable share of its time on our 2-core CPUs (docs/kernels.md).
// This is the same sequence of the same ops as decoder.Block's fused path (the residual adds and conversions are
// torch's), so it gives the same bits and stays row-invariant.
//
// Also the extension's module: the bindings of w4a8.cpp, gguf_int8.cpp and decode_ops.cpp, built with this file
// into one library.

#include "cpu_ops.h"

namespace specdecode {
namespace {

// one linear's packed int4 weights, in w4a8.Int4Weights' order: packed, wscale, d, sub, corr
using Int4 = std::vector<torch::Tensor>;

torch::Tensor linear(const torch::Tensor& x, const Int4& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(w.size() == 5, "a W4A8 linear's weights are (packed, wscale, d, sub, corr)");
  return w4a8_mm(x, w[0], w[1], w[2], w[3], w[4], bias, x.scalar_type());
}

// one GGUF linear: per run of equal block types (a part), its buffers w, d, dm, sc, m as gguf_int8_mm takes them,
// then its bits, block, group, code bias and width (real outputs)
using Part = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t,
                        int64_t, int64_t, int64_t>;
using Blocks = std::vector<Part>;

// as block_linear.BlockLinear's forward: [..., K] -> the parts' outputs in x's dtype side by side, + bias
torch::Tensor linear(const torch::Tensor& x, const Blocks& parts, const c10::optional<torch::Tensor>& bias) {
  const torch::Tensor rows = x.reshape({-1, x.size(-1)});
  std::vector<torch::Tensor> outs;
  for (const Part& p : parts) {
    const auto& [w, d, dm, sc, m, bits, block, group, code_bias, width] = p;
    outs.push_back(gguf_int8_mm(rows, w, d, dm, sc, m, bits, block, group, code_bias).to(rows.scalar_type())
                       .narrow(1, 0, width));
  }
  torch::Tensor y = (outs.size() == 1 ? outs[0] : torch::cat(outs, 1)).contiguous();
  if (bias) y = y + *bias;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = y.size(1);
  return y.reshape(shape);
}

// x [B, T, D] -> the layer's output [B, T, D], its linears of one kind W (Int4 or Blocks); the cache arguments as
// rope_attention takes them
template <typename W>
torch::Tensor layer(const torch::Tensor& x, const torch::Tensor& attn_norm, const torch::Tensor& mlp_norm, double eps,
                    const W& qkv, const c10::optional<torch::Tensor>& qkv_bias, const W& o, const W& gate_up,
                    const W& down, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor k_cache,
                    torch::Tensor v_cache, const torch::Tensor& rows, const torch::Tensor& slots,
                    const torch::Tensor& mask, int64_t H, int64_t KVH) {
  const torch::Tensor attn = rope_attention(linear(rms_norm(x, attn_norm, eps), qkv, qkv_bias), cos, sin, k_cache,
                                            v_cache, rows, slots, mask, H, KVH);
  const torch::Tensor h = x + linear(attn, o, c10::nullopt);
  return h + linear(silu_mul(linear(rms_norm(h, mlp_norm, eps), gate_up, c10::nullopt)), down, c10::nullopt);
}

}  // namespace
}  // namespace specdecode

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  specdecode::bind_w4a8(m);
  specdecode::bind_decode_ops(m);
  specdecode::bind_gguf_int8(m);
  m.def("w4a8_layer", &specdecode::layer<specdecode::Int4>,
        "a decoder layer whose linears are W4A8: RMSNorm, qkv, rotary attention with the cache write, o, residual, "
        "RMSNorm, gate_up, SiLU * up, down, residual");
  m.def("gguf_layer", &specdecode::layer<specdecode::Blocks>,
        "the same layer, its linears a GGUF file's blocks (gguf_int8_mm)");
}
