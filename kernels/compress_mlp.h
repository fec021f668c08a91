// The compression MLP's steps around its GEMMs, on the GPU (kernels/compress_mlp.cu), for the
// CUDA path of CompressBlocksTogether's node (engine/src/nsa/compress.cc, whose ATen code for
// each step is the oracle). Plain ATen types, like launchers.h.
//
// Shapes, for P compressors of hidden width h over tokens [B,T,G,D] with block l = r d:
//   Y      [P,B,chunks,G,h,r]  the first GEMM's output: chunk c times W1's r column slices,
//                              column (hh, i) = slice i of hidden unit hh
//   hidden [P,B,N,G,h]         hidden[j] = sum_i Y[j + i, (hh, i)] + W1 flatten(pos) + b1
// The tensors in the GEMMs' type ct (bf16, fp16 or float32) are rounded once from float32
// arithmetic; the parameters and their gradients are float32.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <utility>
#include <vector>

namespace nsad::nsa::cuda::detail {

// Compressors one launch takes (the module has two: keys and values).
constexpr int kMaxCompressors = 4;

// One compressor's float32 parameters: pos [l,D], w1 [h,l*D], b1 [h], w2 [D,h], b2 [D].
struct CompressorParams {
  at::Tensor pos, w1, b1, w2, b2;
};

// The GEMMs' types the kernels are built for: bf16, fp16, float32.
bool CompressMlpType(at::ScalarType ct);

// Whether the kernels below take these compressors with GEMMs in ct: CUDA, a CompressMlpType,
// float32 contiguous parameters of one shape on one device, at most kMaxCompressors.
bool CompressMlpTakes(const std::vector<CompressorParams>& params, at::ScalarType ct);

// The parameters in the form the GEMMs read, in one launch: W1 [P,h,l*D] and W2 [P,D,h] and
// b2 [P,D] in ct, and pos_bias [P,h] float32 = W1 flatten(pos) + b1.
struct PreparedCompressors {
  at::Tensor w1, w2, b2, pos_bias;
};
PreparedCompressors PrepareCompressors(const std::vector<CompressorParams>& params, at::ScalarType ct);

// hidden [P,B,N,G,h] (sum of each block's r chunk slices plus pos_bias) and act = silu(hidden)
// from the rounded hidden, both in Y's type; N = chunks - r + 1.
std::pair<at::Tensor, at::Tensor> CompressHiddenForward(const at::Tensor& y, const at::Tensor& pos_bias);

// The backward of CompressHiddenForward and of the second layer's bias: from dact [P,B,N,G,h]
// (the gradient of act) and hidden, dh = dact silu'(hidden), rounded to ct, placed at each
// slice's shift: dY [P,B,chunks,G,h,r] (zeros where a chunk has no block). Also the column
// sums (float32) dbias [P,h] of dh and db2 [P,D] of dout [P,B,N,G,D].
std::tuple<at::Tensor, at::Tensor, at::Tensor> CompressHiddenBackward(const at::Tensor& dact, const at::Tensor& hidden,
                                                                      const at::Tensor& dout, int64_t r);

// The position encodings' share of the first layer's gradients, for compressor p's pos[p]
// [l,D] and w1[p] [h,l*D] (float32, contiguous, CUDA): dw1 [P,h,l*D] float32 += dbias ⊗
// flatten(pos) in place, and returns dpos [P,l*D] float32 = W1^T dbias.
bool CompressPositionGradsTake(const std::vector<at::Tensor>& pos, const std::vector<at::Tensor>& w1);
at::Tensor CompressPositionGrads(at::Tensor& dw1, const at::Tensor& dbias, const std::vector<at::Tensor>& pos,
                                 const std::vector<at::Tensor>& w1);

}  // namespace nsad::nsa::cuda::detail
