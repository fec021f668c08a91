// Host-side entry points of the CUDA kernels (kernels/*.cu), called by the autograd
// functions in nsa_cuda.cc. Plain ATen types only, so the .cu files stay light to compile.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <tuple>

#include "nsa/kernel_limits.h"

namespace nsad::nsa::cuda::detail {

// The NSA geometry as plain ints (nsa::Geometry lives in a torch/torch.h header).
struct Geo {
  int cmp_block, cmp_stride, slc_block, top_n, window;
};

// Compressed blocks of T tokens (nsa::NumCmpBlocks for Geo): block j covers [j d, j d + l).
inline int64_t NumCmpBlocks(int64_t T, const Geo& g) {
  return T < g.cmp_block ? 0 : (T - g.cmp_block) / g.cmp_stride + 1;
}

// Query heads per group the kernels accept (a CTA holds all heads of one group).
constexpr int kMaxHeadsPerGroup = kernel_limits::kMaxHeadsPerGroup;

// True when this binary carries machine code for the current GPU.
bool KernelImageLoads();

// Selected attention. lse: [B,T,H] float32, log2 units, needed by the backward.
std::tuple<at::Tensor, at::Tensor> SelectedForward(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v,
                                                   const at::Tensor& block_idx, const Geo& g);
// Returns dq, dk, dv. With dq_sum (float32, shaped like q) dq is added into *dq_sum instead
// and comes back undefined: a caller summing several branches' dq rounds once, at the end.
// delta: rowsum(dout * out) as float32 [B,T,H] where the caller has it (the gate mixing's
// backward does); undefined, the backward computes it (RowDot).
// With ahead (from StartSelectedBackwardMap on these inputs), the block map it built is used
// instead of building one here; this stream waits for it first.
// round_dkdv false: dk and dv come back as the kernel's float32 sums, for a caller that rounds
// them later in a pass it makes anyway (RoPE's backward of the kv projection, GradientHandoff).
struct PendingBlockMap;
std::tuple<at::Tensor, at::Tensor, at::Tensor> SelectedBackward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& block_idx, const Geo& g,
    at::Tensor* dq_sum = nullptr, const at::Tensor& delta = {}, PendingBlockMap* ahead = nullptr,
    bool round_dkdv = true);
// Starts the selected backward's first step, the inverted block map (block_map.h: ten small
// kernels, latency-bound), on a side stream that waits for the current one, so that it
// overlaps what the caller runs before SelectedBackward; the result goes to SelectedBackward,
// which joins the streams again (also under CUDA-graph capture).
struct PendingBlockMapDeleter {
  void operator()(PendingBlockMap* p) const;
};
using PendingBlockMapPtr = std::unique_ptr<PendingBlockMap, PendingBlockMapDeleter>;
PendingBlockMapPtr StartSelectedBackwardMap(const at::Tensor& q, const at::Tensor& k, const at::Tensor& block_idx,
                                            const Geo& g);

// Compressed attention: out [B,T,H,D], lse [B,T,H], importance [B,T,G,NS].
std::tuple<at::Tensor, at::Tensor, at::Tensor> CompressedForward(const at::Tensor& q,
                                                                 const at::Tensor& k_cmp,
                                                                 const at::Tensor& v_cmp,
                                                                 const Geo& g);
// With dq_float (float32, shaped like q, any contents) dq is written there in float32 -- the
// start of a sum of several branches' dq, which SelectedBackward and WindowBackward then add
// to -- and comes back undefined. delta as in SelectedBackward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> CompressedBackward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k_cmp,
    const at::Tensor& v_cmp, const at::Tensor& out, const at::Tensor& lse, const Geo& g,
    at::Tensor* dq_float = nullptr, const at::Tensor& delta = {});

// Compressed attention over cuDNN (nsa_cuda.cc): the branch is dense causal attention of N
// packed query rows over the N compressed blocks (compressed_packed.cu says why).
// [B,T,H,D] -> [B,N,H*d,D] (head' = h*d + r holds position l-1 + row*d + r; slots past T zero).
at::Tensor PackCompressedRows(const at::Tensor& x, const Geo& g);
// [B,N,H*d,D] -> [B,T,H,D], zero at the positions before l-1 (they see no block).
at::Tensor UnpackCompressedRows(const at::Tensor& packed, int64_t T, const Geo& g);
// The same into out, float32 [B,T,H,D] (the start of BranchesMixed's float32 dq sum) in one pass,
// instead of an unpack and a copy; bf16/fp16 rows.
void UnpackCompressedRowsToFloat(const at::Tensor& packed, at::Tensor& out, const Geo& g);
// The packed rows' log-sum-exp ([B,H*d,N] or [B,H*d,N,1], natural log) -> [B,T,H] float32 in
// log2 units, +inf where a position sees no block (the custom forward's convention).
at::Tensor CompressedLseFromPacked(const at::Tensor& lse_packed, int64_t T, const Geo& g);
// The importance pass alone, from the forward's log-sum-exp ([B,T,H], log2 units):
// [B,T,G,NS] float32. bf16/fp16 inputs. selection_only: for SelectBlocksLaunch alone, which
// reads blocks 1 .. t/l' - 2 of position t; blocks past those its tile of positions overlaps
// may be left unwritten (up to half of the tensor at long T, where the others write zeros).
at::Tensor CompressedImportance(const at::Tensor& q, const at::Tensor& k_cmp, const at::Tensor& lse,
                                const Geo& g, bool selection_only = false);
// Whether the compressed branch runs on cuDNN for q (CompressedKernelChoice, kernel_choice.h);
// a forced kDense that cannot run (fp32, head_dim not a multiple of 8 or over 128, no cuDNN)
// fails.
bool UseDenseCompressed(const at::Tensor& q, const Geo& g);

// Sliding-window forward on the tiled kernel (window_attention.cu): out [B,T,H,D] and lse
// [B,T,H] float32 in log2 units; bf16/fp16, head_dim 64 or 128.
std::tuple<at::Tensor, at::Tensor> WindowForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 int64_t window);
// Whether the window forward runs WindowForward (WindowKernelChoice, kernel_choice.h) for q;
// a forced kTiled that cannot run (fp32, other head dims) fails.
bool UseTiledWindowForward(const at::Tensor& q);
// Sliding-window backward on the warpgroup-MMA dK/dV kernel (window_attention.cu), given the
// forward's out and its lse as WindowForward returns it: dq, dk, dv in the inputs' types.
// bf16/fp16, head_dim 64 or 128, an sm_90 device. dq_sum and delta as in SelectedBackward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> WindowBackward(const at::Tensor& dout, const at::Tensor& q,
                                                              const at::Tensor& k, const at::Tensor& v,
                                                              const at::Tensor& out, const at::Tensor& lse,
                                                              int64_t window, at::Tensor* dq_sum = nullptr,
                                                              const at::Tensor& delta = {});
// Checks that dq_sum is a contiguous, 16-byte-aligned float32 tensor shaped like q on q's device.
void CheckDqSum(const at::Tensor& dq_sum, const at::Tensor& q);
// Whether the window backward runs WindowBackward (WindowKernelChoice); a forced kWgmma that
// cannot run fails.
bool UseWgmmaWindowBackward(const at::Tensor& q);

// importance [B,T,G,NS] float32 -> block indices [B,T,G,n] int32.
at::Tensor SelectBlocksLaunch(const at::Tensor& importance, int64_t seq_len, const Geo& g);

}  // namespace nsad::nsa::cuda::detail
