// The compressed branch's keys or values: one vector per compression block, phi(block + position
// encoding) with phi = Linear -> SiLU -> Linear over the block's l tokens flattened (NSA paper,
// eq. 7). Block j holds tokens [j d, j d + l).
#pragma once

#include <torch/torch.h>

#include "nsa/ops.h"

namespace nsad::nsa {

// tokens [B,T,G,D], position_encoding [l,D], first: l*D -> hidden, second: hidden -> D.
// Returns [B,N,G,D], N = NumCmpBlocks(T).
//
// When the stride divides the block length (l = r d, the default l=32, d=16), nothing is
// unfolded: the tokens are cut into chunks of d, each chunk goes through the r column slices of
// the first layer's weight in one GEMM, and block j's hidden layer is the sum of chunk j+i's
// i-th slice. The position encoding's contribution, W1 flatten(pos), is the same for every
// block and joins the bias. The unfolded blocks (r copies of every token, plus the encoding
// added to each) and the unfold's backward were about 0.25 ms per layer of the batch-16,
// T=2048 training step on an H100; the chunked form reads each token once. Other geometries
// unfold.
torch::Tensor CompressBlocks(const torch::Tensor& tokens, const torch::Tensor& position_encoding,
                             const torch::nn::Linear& first, const torch::nn::Linear& second,
                             const Geometry& g);

// tokens [B,T,M,D] -> a view [B, chunks, M, len, D] of their first chunks * len positions:
// chunk c holds positions c len .. c len + len - 1, its M rows side by side. The layout the
// chunked compression's first GEMM reads (len = d) and the kv split can write (PartChunks).
torch::Tensor TokensAsChunks(const torch::Tensor& tokens, int64_t chunks, int64_t len);

// One compression MLP with its position encoding [l,D]; both layers have a bias.
struct Compressor {
  torch::Tensor position_encoding;
  torch::nn::Linear first{nullptr}, second{nullptr};
};

// CompressBlocks of several token tensors (a layer's keys and values), each through its own
// compressor, as one autograd node with a hand-written backward: the same maths in the
// chunked form, the P compressions batched into each GEMM. Needs l = r d, all tokens shaped
// alike and every compressor's first layer of the same width. Under autocast the GEMMs run
// in the autocast dtype, as CompressBlocks' at::linear calls do; W1 flatten(pos) + b1 stays
// in the parameters' dtype.
//
// Why: CompressBlocks as composed ops is ~30 launches forward and ~60 backward per layer
// (slice backwards that zero-fill and copy, weight casts and their gradients' casts, bias
// reductions): 0.55 ms of a batch-16 T=2048 layer on an H100 (ncu), 0.12 ms of it GEMMs.
std::vector<torch::Tensor> CompressBlocksTogether(const std::vector<torch::Tensor>& tokens,
                                                  const std::vector<Compressor>& compressors,
                                                  const Geometry& g);

// CompressBlocksTogether of P token tensors given as their chunks [P, B, chunks, G, d, D]
// (chunk c = tokens c d .. c d + d - 1 of every group; chunks = N + l/d - 1 for N blocks): the
// layout its GEMMs read, which RotateParts writes directly (PartChunks), so that neither the
// tokens nor their gradient are permuted on the way. Returns the P compressed tensors
// [B,N,G,D]; the chunks' gradient comes back in the same layout.
std::vector<torch::Tensor> CompressChunksTogether(const torch::Tensor& chunks,
                                                  const std::vector<Compressor>& compressors,
                                                  const Geometry& g);

}  // namespace nsad::nsa
