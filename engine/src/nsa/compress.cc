#include "nsa/compress.h"

#include "model/shared_input_linear.h"

namespace nsad::nsa {
namespace {

// Block j = tokens [j d, j d + l) with the position encoding added, flattened, through first.
torch::Tensor HiddenByUnfolding(const torch::Tensor& tokens, const torch::Tensor& position_encoding,
                                const torch::nn::Linear& first, const Geometry& g, int64_t N) {
  const int64_t B = tokens.size(0), G = tokens.size(2), D = tokens.size(3), l = g.cmp_block;
  // unfold gives [B,N,G,D,l]; put the l tokens before D.
  const auto blocks = tokens.unfold(1, l, g.cmp_stride).transpose(-1, -2);
  const auto with_position = blocks + position_encoding.to(blocks.scalar_type());
  return ApplyLinear(first, with_position.reshape({B, N, G, l * D}));
}

// The same for l = r d: chunk c = tokens [c d, c d + d), Y[c] = chunk c times each of W1's r
// column slices (one GEMM), hidden[j] = sum_i Y[j + i] (slice i) + b1 + W1 flatten(pos).
torch::Tensor HiddenByChunks(const torch::Tensor& tokens, const torch::Tensor& position_encoding,
                             const torch::nn::Linear& first, const Geometry& g, int64_t N) {
  const int64_t B = tokens.size(0), G = tokens.size(2), D = tokens.size(3);
  const int64_t d = g.cmp_stride, r = g.cmp_block / g.cmp_stride, chunks = N + r - 1;
  const auto& w = first->weight;  // [hidden, l*D], columns (token of the block, feature)
  const int64_t hidden = w.size(0);
  const auto chunked = tokens.narrow(1, 0, chunks * d)
                           .view({B, chunks, d, G, D})
                           .permute({0, 1, 3, 2, 4})
                           .reshape({B, chunks, G, d * D});
  const auto slices = w.view({hidden, r, d * D}).transpose(0, 1).reshape({r * hidden, d * D});
  const auto y = at::linear(chunked, slices);  // [B, chunks, G, r*hidden]
  auto sum = y.narrow(1, 0, N).narrow(3, 0, hidden);
  for (int64_t i = 1; i < r; ++i) sum = sum + y.narrow(1, i, N).narrow(3, i * hidden, hidden);
  auto bias = at::mv(w, position_encoding.reshape({-1}).to(w.scalar_type()));
  if (first->bias.defined()) bias = bias + first->bias;
  // In the GEMM's dtype: a float32 bias would promote a bf16 (autocast) hidden layer.
  return sum + bias.to(sum.scalar_type());
}

}  // namespace

torch::Tensor CompressBlocks(const torch::Tensor& tokens, const torch::Tensor& position_encoding,
                             const torch::nn::Linear& first, const torch::nn::Linear& second,
                             const Geometry& g) {
  TORCH_CHECK(tokens.dim() == 4, "CompressBlocks takes tokens [B,T,G,D], got ", tokens.sizes());
  const int64_t B = tokens.size(0), T = tokens.size(1), G = tokens.size(2), D = tokens.size(3);
  const int64_t N = NumCmpBlocks(T, g);
  if (N == 0) return torch::zeros({B, 0, G, D}, tokens.options());
  const bool chunks = g.cmp_block % g.cmp_stride == 0;
  const auto hidden = chunks ? HiddenByChunks(tokens, position_encoding, first, g, N)
                             : HiddenByUnfolding(tokens, position_encoding, first, g, N);
  return ApplyLinear(second, torch::silu(hidden));  // [B,N,G,D]
}

}  // namespace nsad::nsa
