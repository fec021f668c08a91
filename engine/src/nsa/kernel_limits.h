// The model shapes the NSA CUDA kernels take, in one place. The kernels check their inputs
// against these constants (DispatchHeadDim and CheckShape in launch_util.cuh, SelectBlocks'
// top-n check in select_blocks.cu, the selected branch's block check in
// selected_attention.cu), and the engine's PlanRuntime (engine/src/config.cc) checks the
// model config against the same ones. So attention_backend auto never hands the kernels a
// shape they refuse, and an explicit CUDA backend is refused up front with the same limit.
// Plain C++ with no includes: the engine's torch-free config code uses it too.
#pragma once

namespace nsad::nsa::kernel_limits {

constexpr int kHeadDimSmall = 64;   // the two head dims the kernels are instantiated for
constexpr int kHeadDimLarge = 128;
constexpr int kMaxHeadsPerGroup = 16;  // a CTA holds all query heads of one KV group
constexpr int kMaxTopN = 32;           // one warp lane per chosen block in the selection
constexpr int kMaxSelectionBlock = 64;  // a selection block is one 64-key tile

constexpr bool HeadDimSupported(int head_dim) { return head_dim == kHeadDimSmall || head_dim == kHeadDimLarge; }

}  // namespace nsad::nsa::kernel_limits
