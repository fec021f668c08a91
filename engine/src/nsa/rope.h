// Rotary position embedding (half-split, "rotate_half" form), the reference implementation:
// plain LibTorch in float32 (double for double inputs), rounded to the input type once at
// the end. It is the oracle of the fused CUDA RoPE (kernels/fused_ops.h), and what the
// reference backend and CPU runs use. Kept out of attention.cc so that the kernel tests can
// compile it in without the attention module.
#pragma once

#include <torch/torch.h>

namespace nsad::nsa {

// The cos/sin tables of ApplyRope for given positions, so that a module can compute them
// once per sequence length instead of once per call.
struct RopeTable {
  torch::Tensor cos, sin;  // [T, D/2] in the accumulation type (float32 or double)
};
RopeTable MakeRopeTable(const torch::Tensor& positions, int64_t head_dim, double theta,
                        torch::ScalarType acc);

// x [B,T,...,D] rotated by the angles of its position along dim 1. x may have any number of
// dims after [B,T] (the result is the same for every layout of the trailing dims).
torch::Tensor ApplyRope(const torch::Tensor& x, const RopeTable& table);
// The same at the given token positions [T].
torch::Tensor ApplyRope(const torch::Tensor& x, const torch::Tensor& positions, double theta);

}  // namespace nsad::nsa
