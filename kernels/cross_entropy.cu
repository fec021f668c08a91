// Cross-entropy of the language-model head's logits, fused: a forward that reads each row of
// logits once (online max and sum of exponentials, as in FlashAttention's softmax) and keeps
// only its max and log(sum), and a backward that rereads the row and writes
// (softmax - onehot) * grad / count in the logits' dtype.
//
// Why: LibTorch's path for bf16 logits [N, V] is a float32 copy, log_softmax, nll_loss and
// the same three backwards: about 15 passes over N x V floats. At m7c's batch 16 (N = 32768,
// V = 50304) these two kernels (3 passes over the bf16 logits: 1.1 ms forward, 2.3 ms
// backward on an H100) took the dense GPT's step from 103 to 80 ms (docs/PERFORMANCE.md).
//
// One CTA per row; each thread reads 16-byte vectors when the rows allow it. float32
// arithmetic throughout. A target outside [0, V) that is not ignore_index gives a NaN loss
// (LibTorch would stop the process with a device assert), so the trainer's non-finite check
// halts the run instead.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "fused_launchers.h"
#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// Combines two (max, sum of exp(x - max)) pairs.
__device__ __forceinline__ void MergeSoftmaxState(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;  // both empty
  s = s * exp2f((m - mx) * kLog2e) + s2 * exp2f((m2 - mx) * kLog2e);
  m = mx;
}

// The CTA's (max, sum) from each thread's, through warp shuffles and shared memory; every
// thread gets the result. kCtaThreads: a multiple of 32, at most 1024.
template <int kCtaThreads = kThreads>
__device__ __forceinline__ void BlockSoftmaxState(float& m, float& s) {
  __shared__ float warp_m[kCtaThreads / 32], warp_s[kCtaThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    MergeSoftmaxState(m, s, __shfl_xor_sync(0xffffffffu, m, offset),
                      __shfl_xor_sync(0xffffffffu, s, offset));
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_m[warp] = m;
    warp_s[warp] = s;
  }
  __syncthreads();
  m = lane < kCtaThreads / 32 ? warp_m[lane] : -INFINITY;
  s = lane < kCtaThreads / 32 ? warp_s[lane] : 0.f;
  for (int offset = 16; offset > 0; offset /= 2) {
    MergeSoftmaxState(m, s, __shfl_xor_sync(0xffffffffu, m, offset),
                      __shfl_xor_sync(0xffffffffu, s, offset));
  }
}

// Folds kVec logits into a thread's online (max, sum of exp(x - max)).
template <typename scalar_t, int kVec>
__device__ __forceinline__ void AddToSoftmaxState(const Packed<scalar_t, kVec>& chunk, float& m, float& s) {
  float vals[kVec];
  float chunk_max = -INFINITY;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    vals[j] = static_cast<float>(chunk.v[j]);
    chunk_max = fmaxf(chunk_max, vals[j]);
  }
  const float mx = fmaxf(m, chunk_max);
  if (mx == -INFINITY) return;  // all -inf so far: nothing to add
  float chunk_sum = 0.f;
#pragma unroll
  for (int j = 0; j < kVec; ++j) chunk_sum += exp2f((vals[j] - mx) * kLog2e);
  s = (m == -INFINITY ? 0.f : s * exp2f((m - mx) * kLog2e)) + chunk_sum;
  m = mx;
}

// One row's loss from its max and log(sum): (max - logit) + log(sum), not log-sum-exp -
// logit: at large logits (|x| ~ 1e3) the log-sum-exp's rounding would cost the loss its low
// digits, as LibTorch's x - max - log(sum) does not. 0 for an ignored target, NaN for one
// outside [0, V).
template <typename scalar_t>
__device__ __forceinline__ float RowLoss(const scalar_t* row_logits, int64_t t, int64_t V, int64_t ignore_index,
                                         float m, float log_sum) {
  if (t == ignore_index) return 0.f;
  if (t < 0 || t >= V) return NAN;
  return (m - static_cast<float>(row_logits[t])) + log_sum;
}

template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads)
    CrossEntropyForwardKernel(const scalar_t* __restrict__ logits, const int64_t* __restrict__ targets,
                              float* __restrict__ row_loss, float* __restrict__ row_stats,
                              int64_t V, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const auto* x = reinterpret_cast<const Packed<scalar_t, kVec>*>(logits + row * V);
  float m = -INFINITY, s = 0.f;
  for (int64_t i = threadIdx.x; i < V / kVec; i += kThreads) AddToSoftmaxState<scalar_t, kVec>(x[i], m, s);
  BlockSoftmaxState(m, s);
  if (threadIdx.x == 0) {
    const float log_sum = logf(s);
    row_loss[row] = RowLoss(logits + row * V, targets[row], V, ignore_index, m, log_sum);
    row_stats[2 * row] = m;
    row_stats[2 * row + 1] = log_sum;
  }
}

// grad_scale points at grad_output / count (a device scalar, so a CUDA graph can replay it).
template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads)
    CrossEntropyBackwardKernel(const scalar_t* __restrict__ logits, const int64_t* __restrict__ targets,
                               const float* __restrict__ row_stats, const float* __restrict__ grad_scale,
                               scalar_t* __restrict__ grad, int64_t V, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const int64_t t = targets[row];
  const bool ignored = t == ignore_index;
  const float scale = ignored ? 0.f : *grad_scale;
  const float row_max = row_stats[2 * row], log_sum = row_stats[2 * row + 1];
  const auto* x = reinterpret_cast<const Packed<scalar_t, kVec>*>(logits + row * V);
  auto* g = reinterpret_cast<Packed<scalar_t, kVec>*>(grad + row * V);
  for (int64_t i = threadIdx.x; i < V / kVec; i += kThreads) {
    const auto chunk = x[i];
    Packed<scalar_t, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int64_t col = i * kVec + j;
      const float p = exp2f(((static_cast<float>(chunk.v[j]) - row_max) - log_sum) * kLog2e);
      out.v[j] = static_cast<scalar_t>((p - (col == t ? 1.f : 0.f)) * scale);
    }
    g[i] = out;
  }
}

// The forward and the gradient in one kernel, for when the logits need a gradient: the row is
// read once from global memory into shared memory (its bytes: dynamic shared memory) while the
// online max and sum run; the loss is written as in the forward, then the gradient
// (softmax - onehot) * expected_grad / count from the shared copy. Two passes over the logits
// in DRAM (a read and the gradient's write) instead of the two kernels' three. The gradient is
// for an incoming gradient of expected_grad; the backward rescales it if another comes
// (CrossEntropyRescaleKernel). count: the number of rows not ignored, a device float.
// 512 threads: two CTAs per SM (a row's copy takes up to 112 KiB) keep 32 warps of loads in
// flight; at 256 threads the kernel moved 2.15 TB/s on an H100 (3.05 ms at m7c's batch 16).
constexpr int kOnePassThreads = 512;
template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kOnePassThreads, 2)
    CrossEntropyWithGradKernel(const scalar_t* __restrict__ logits, const int64_t* __restrict__ targets,
                               const float* __restrict__ count, float expected_grad,
                               float* __restrict__ row_loss, scalar_t* __restrict__ grad, int64_t V,
                               int64_t ignore_index) {
  using Vec = Packed<scalar_t, kVec>;
  extern __shared__ float4 row_smem[];
  Vec* row_copy = reinterpret_cast<Vec*>(row_smem);
  const int64_t row = blockIdx.x;
  const auto* x = reinterpret_cast<const Vec*>(logits + row * V);
  const int64_t chunks = V / kVec;
  float m = -INFINITY, s = 0.f;
#pragma unroll 4  // several loads in flight per thread: two CTAs per SM are few threads
  for (int64_t i = threadIdx.x; i < chunks; i += kOnePassThreads) {
    const Vec chunk = x[i];
    row_copy[i] = chunk;
    AddToSoftmaxState<scalar_t, kVec>(chunk, m, s);
  }
  BlockSoftmaxState<kOnePassThreads>(m, s);  // its __syncthreads also publishes row_copy
  const float log_sum = logf(s);
  const int64_t t = targets[row];
  if (threadIdx.x == 0) row_loss[row] = RowLoss(logits + row * V, t, V, ignore_index, m, log_sum);
  const float scale = t == ignore_index ? 0.f : expected_grad / *count;
  auto* g = reinterpret_cast<Vec*>(grad + row * V);
  for (int64_t i = threadIdx.x; i < chunks; i += kOnePassThreads) {
    const Vec chunk = row_copy[i];
    Vec out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int64_t col = i * kVec + j;
      const float p = exp2f(((static_cast<float>(chunk.v[j]) - m) - log_sum) * kLog2e);
      out.v[j] = static_cast<scalar_t>((p - (col == t ? 1.f : 0.f)) * scale);
    }
    g[i] = out;
  }
}

// grad *= grad_output / expected_grad, unless they are equal (the trainer's case: every CTA
// then returns at once).
template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads)
    CrossEntropyRescaleKernel(scalar_t* __restrict__ grad, const float* __restrict__ grad_output,
                              float expected_grad, int64_t chunks) {
  const float incoming = *grad_output;
  if (incoming == expected_grad) return;
  const float factor = incoming / expected_grad;
  auto* g = reinterpret_cast<Packed<scalar_t, kVec>*>(grad);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    auto chunk = g[i];
#pragma unroll
    for (int j = 0; j < kVec; ++j) chunk.v[j] = static_cast<scalar_t>(static_cast<float>(chunk.v[j]) * factor);
    g[i] = chunk;
  }
}

// kVec elements of a row per load (16 bytes) when every row starts aligned to it, else 1.
template <typename scalar_t>
bool RowsTakeVectors(const at::Tensor& logits, int vec) {
  return logits.size(1) % vec == 0 && AlignedFor(logits.data_ptr<scalar_t>(), vec);
}

void CheckLossInputs(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.is_contiguous(),
              "cross-entropy takes contiguous CUDA logits [N, V], got ", logits.sizes());
  TORCH_CHECK(targets.is_cuda() && targets.dim() == 1 && targets.is_contiguous() &&
                  targets.scalar_type() == at::kLong,
              "cross-entropy takes contiguous int64 CUDA targets [N]");
  TORCH_CHECK(targets.size(0) == logits.size(0), "cross-entropy: ", targets.size(0),
              " targets for ", logits.size(0), " rows of logits");
  TORCH_CHECK(logits.size(0) <= INT32_MAX, "cross-entropy: too many rows (", logits.size(0), ")");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> CrossEntropyForward(const at::Tensor& logits,
                                                       const at::Tensor& targets,
                                                       int64_t ignore_index) {
  CheckLossInputs(logits, targets);
  const int64_t N = logits.size(0), V = logits.size(1);
  auto row_loss = at::empty({N}, logits.options().dtype(at::kFloat));
  auto row_stats = at::empty({N, 2}, logits.options().dtype(at::kFloat));
  NSA_DISPATCH_TYPES(logits.scalar_type(), "nsa_cross_entropy_forward", [&] {
    constexpr int kWide = 16 / sizeof(scalar_t);
    const dim3 grid(static_cast<unsigned>(N));
    if (RowsTakeVectors<scalar_t>(logits, kWide)) {
      Launch(CrossEntropyForwardKernel<scalar_t, kWide>, grid, 0, logits.data_ptr<scalar_t>(),
             targets.data_ptr<int64_t>(), row_loss.data_ptr<float>(), row_stats.data_ptr<float>(), V,
             ignore_index);
    } else {
      Launch(CrossEntropyForwardKernel<scalar_t, 1>, grid, 0, logits.data_ptr<scalar_t>(),
             targets.data_ptr<int64_t>(), row_loss.data_ptr<float>(), row_stats.data_ptr<float>(), V,
             ignore_index);
    }
  });
  return {row_loss, row_stats};
}

at::Tensor CrossEntropyBackward(const at::Tensor& logits, const at::Tensor& targets,
                                const at::Tensor& row_stats, const at::Tensor& grad_scale,
                                int64_t ignore_index) {
  CheckLossInputs(logits, targets);
  TORCH_CHECK(grad_scale.is_cuda() && grad_scale.numel() == 1 &&
                  grad_scale.scalar_type() == at::kFloat,
              "cross-entropy backward takes a float32 CUDA scalar gradient scale");
  const int64_t N = logits.size(0), V = logits.size(1);
  auto grad = at::empty_like(logits);
  NSA_DISPATCH_TYPES(logits.scalar_type(), "nsa_cross_entropy_backward", [&] {
    constexpr int kWide = 16 / sizeof(scalar_t);
    const dim3 grid(static_cast<unsigned>(N));
    if (RowsTakeVectors<scalar_t>(logits, kWide)) {
      Launch(CrossEntropyBackwardKernel<scalar_t, kWide>, grid, 0, logits.data_ptr<scalar_t>(),
             targets.data_ptr<int64_t>(), row_stats.data_ptr<float>(), grad_scale.data_ptr<float>(),
             grad.data_ptr<scalar_t>(), V, ignore_index);
    } else {
      Launch(CrossEntropyBackwardKernel<scalar_t, 1>, grid, 0, logits.data_ptr<scalar_t>(),
             targets.data_ptr<int64_t>(), row_stats.data_ptr<float>(), grad_scale.data_ptr<float>(),
             grad.data_ptr<scalar_t>(), V, ignore_index);
    }
  });
  return grad;
}

// Two CTAs per SM still fit the row: 50304 bf16 logits (m7c) take 98 KiB.
constexpr int64_t kOnePassRowBytes = 112 * 1024;

bool CrossEntropyOnePassTakes(const at::Tensor& logits) {
  if (logits.dim() != 2 || !logits.is_cuda() || !logits.is_contiguous()) return false;
  const int64_t row_bytes = logits.size(1) * static_cast<int64_t>(logits.element_size());
  return row_bytes > 0 && row_bytes <= kOnePassRowBytes && row_bytes % 16 == 0 &&
         logits.storage_offset() * logits.element_size() % 16 == 0 &&
         reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0;
}

std::tuple<at::Tensor, at::Tensor> CrossEntropyForwardWithGrad(const at::Tensor& logits, const at::Tensor& targets,
                                                               int64_t ignore_index, const at::Tensor& count,
                                                               double expected_grad) {
  CheckLossInputs(logits, targets);
  TORCH_CHECK(CrossEntropyOnePassTakes(logits), "the one-pass cross-entropy takes 16-byte aligned rows of at most ",
              kOnePassRowBytes, " bytes");
  TORCH_CHECK(count.is_cuda() && count.numel() == 1 && count.scalar_type() == at::kFloat,
              "cross-entropy: count must be a float32 CUDA scalar");
  const int64_t N = logits.size(0), V = logits.size(1);
  auto row_loss = at::empty({N}, logits.options().dtype(at::kFloat));
  auto grad = at::empty_like(logits);
  if (N == 0) return {row_loss, grad};
  const size_t smem = static_cast<size_t>(V) * logits.element_size();
  NSA_DISPATCH_TYPES(logits.scalar_type(), "nsa_cross_entropy_with_grad", [&] {
    constexpr int kWide = 16 / sizeof(scalar_t);
    LaunchKernel(CrossEntropyWithGradKernel<scalar_t, kWide>, dim3(static_cast<unsigned>(N)), kOnePassThreads, smem,
           logits.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(), count.data_ptr<float>(),
           static_cast<float>(expected_grad), row_loss.data_ptr<float>(), grad.data_ptr<scalar_t>(), V,
           ignore_index);
  });
  return {row_loss, grad};
}

void CrossEntropyRescaleGrad(at::Tensor& grad, const at::Tensor& grad_output, double expected_grad) {
  TORCH_CHECK(CrossEntropyOnePassTakes(grad), "cross-entropy rescale: the one-pass kernel's gradient expected");
  TORCH_CHECK(grad_output.is_cuda() && grad_output.numel() == 1 && grad_output.scalar_type() == at::kFloat,
              "cross-entropy rescale: the incoming gradient must be a float32 CUDA scalar");
  if (grad.numel() == 0) return;
  NSA_DISPATCH_TYPES(grad.scalar_type(), "nsa_cross_entropy_rescale", [&] {
    constexpr int kWide = 16 / sizeof(scalar_t);
    const int64_t chunks = grad.numel() / kWide;
    const int64_t blocks = std::min<int64_t>((chunks + kThreads - 1) / kThreads, 132 * 16);
    Launch(CrossEntropyRescaleKernel<scalar_t, kWide>, dim3(static_cast<unsigned>(blocks)), 0,
           grad.data_ptr<scalar_t>(), grad_output.data_ptr<float>(), static_cast<float>(expected_grad), chunks);
  });
}

}  // namespace nsad::nsa::cuda::detail
