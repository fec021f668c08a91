// The compression MLP's steps around its GEMMs (contract: compress_mlp.h).
//
// Why: the node ran them as ATen ops, each compressor on its own: the weights' casts and the
// first layer's slice transpose, W1 flatten(pos) + b1 (a matrix-vector product, two cuBLAS
// kernels), the chunk sum, the bias add and silu in the forward; silu's backward, two
// column sums (at::sum over 4064 rows took 15 us each), a zero fill and two shifted copies,
// the outer product into W1's gradient and W1^T dbias in the backward. ncu put those at
// about 40 us forward and 70 us backward per layer of the batch-16, T=2048 step on an H100,
// in 30 launches, around 0.1 ms of GEMMs (ncu's times of such small kernels run cold: in the
// CUDA graph the step gained less). Here they are four kernels.
#include "compress_mlp.h"

#include <ATen/DeviceGuard.h>
#include <climits>

#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

struct ParamPtrs {
  const float* pos[kMaxCompressors];
  const float* w1[kMaxCompressors];
  const float* b1[kMaxCompressors];
  const float* w2[kMaxCompressors];
  const float* b2[kMaxCompressors];
};

ParamPtrs PointersOf(const std::vector<CompressorParams>& params) {
  ParamPtrs p{};
  for (size_t c = 0; c < params.size(); ++c) {
    p.pos[c] = params[c].pos.data_ptr<float>();
    p.w1[c] = params[c].w1.data_ptr<float>();
    p.b1[c] = params[c].b1.data_ptr<float>();
    p.w2[c] = params[c].w2.data_ptr<float>();
    p.b2[c] = params[c].b2.data_ptr<float>();
  }
  return p;
}

// A parameter the kernels read: float32, contiguous, on `device` (a CUDA device).
bool KernelParam(const at::Tensor& t, const at::Device& device) {
  return t.defined() && t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.device() == device;
}

__device__ __forceinline__ float Sigmoid(float a) { return 1.f / (1.f + __expf(-a)); }

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One warp per row of work: the P h rows of W1 (cast, and dotted with flatten(pos) for
// pos_bias), then the P D rows of W2 (cast), then the P rows of b2 (cast).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    PrepareCompressorsKernel(ParamPtrs p, int P, int h, int lD, int D, scalar_t* __restrict__ w1c,
                             scalar_t* __restrict__ w2c, scalar_t* __restrict__ b2c, float* __restrict__ pos_bias) {
  const int warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
  const int w1_rows = P * h, w2_rows = P * D;
  if (warp < w1_rows) {
    const int c = warp / h, hh = warp - c * h;
    const float* src = p.w1[c] + static_cast<int64_t>(hh) * lD;
    const float* pos = p.pos[c];
    scalar_t* dst = w1c + static_cast<int64_t>(warp) * lD;
    float dot = 0.f;
    for (int k = lane; k < lD; k += 32) {
      const float w = src[k];
      dst[k] = static_cast<scalar_t>(w);
      dot = fmaf(w, pos[k], dot);
    }
    dot = WarpSum(dot);
    if (lane == 0) pos_bias[warp] = dot + p.b1[c][hh];
  } else if (warp < w1_rows + w2_rows) {
    const int row = warp - w1_rows, c = row / D, dd = row - c * D;
    const float* src = p.w2[c] + static_cast<int64_t>(dd) * h;
    scalar_t* dst = w2c + static_cast<int64_t>(row) * h;
    for (int k = lane; k < h; k += 32) dst[k] = static_cast<scalar_t>(src[k]);
  } else if (warp < w1_rows + w2_rows + P) {
    const int c = warp - w1_rows - w2_rows;
    for (int k = lane; k < D; k += 32) b2c[c * D + k] = static_cast<scalar_t>(p.b2[c][k]);
  }
}

// Sizes of the hidden layer's tensors.
struct HiddenShape {
  int64_t P, B, chunks, N, G, h, r;
};

// A CTA per row (p, b, j) of hidden, its threads over the row's G h columns (g, hh): the only
// divisions are per row (64-bit index arithmetic per element made an earlier version 4x
// slower than its memory traffic).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    CompressHiddenForwardKernel(const scalar_t* __restrict__ y, const float* __restrict__ pos_bias,
                                scalar_t* __restrict__ hidden, scalar_t* __restrict__ act, HiddenShape s) {
  const int64_t rows = s.P * s.B * s.N;
  const int cols = static_cast<int>(s.G * s.h), h = static_cast<int>(s.h), r = static_cast<int>(s.r);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t pb = row / s.N, j = row - pb * s.N;
    const float* bias = pos_bias + (pb / s.B) * s.h;
    // Y[p, b, j + i, (g, hh), i] = src[col r + i (G h r + 1)]
    const scalar_t* src = y + (pb * s.chunks + j) * cols * r;
    const int chunk_step = cols * r + 1;
    for (int col = threadIdx.x; col < cols; col += kThreads) {
      const int g = col / h;
      float v = bias[col - g * h];
      for (int i = 0; i < r; ++i) v += static_cast<float>(src[col * r + i * chunk_step]);
      const scalar_t rounded = static_cast<scalar_t>(v);
      hidden[row * cols + col] = rounded;
      const float x = static_cast<float>(rounded);
      act[row * cols + col] = static_cast<scalar_t>(x * Sigmoid(x));
    }
  }
}

// A CTA per kRowIters consecutive chunks c of one (p, b), its threads over the columns (g, hh)
// of dY and (g, dd) of dout. Each thread sums its column over the CTA's rows and adds that
// to dbias / db2 (one float32 atomic per column and CTA).
constexpr int kRowIters = 16;

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    CompressHiddenBackwardKernel(const scalar_t* __restrict__ dact, const scalar_t* __restrict__ hidden,
                                 const scalar_t* __restrict__ dout, scalar_t* __restrict__ dy,
                                 float* __restrict__ dbias, float* __restrict__ db2, HiddenShape s, int64_t D) {
  const int64_t tiles = (s.chunks + kRowIters - 1) / kRowIters;
  const int64_t pb = blockIdx.x / tiles, c0 = (blockIdx.x - pb * tiles) * kRowIters, p = pb / s.B;
  const int64_t c_end = std::min<int64_t>(c0 + kRowIters, s.chunks);
  const int h = static_cast<int>(s.h), r = static_cast<int>(s.r), cols = static_cast<int>(s.G * s.h);
  const int dcols = static_cast<int>(s.G * D), d = static_cast<int>(D);
  for (int col = threadIdx.x; col < cols; col += kThreads) {
    const int g = col / h;
    float sum = 0.f;
    for (int64_t c = c0; c < c_end; ++c) {
      scalar_t* out = dy + ((pb * s.chunks + c) * cols + col) * r;
      for (int i = 0; i < r; ++i) {
        const int64_t j = c - i;
        float v = 0.f;
        if (j >= 0 && j < s.N) {
          const int64_t idx = (pb * s.N + j) * cols + col;
          const float x = static_cast<float>(hidden[idx]), sg = Sigmoid(x);
          v = static_cast<float>(dact[idx]) * sg * (1.f + x * (1.f - sg));
        }
        const scalar_t rounded = static_cast<scalar_t>(v);
        out[i] = rounded;
        if (i == 0) sum += static_cast<float>(rounded);  // each dh once: at its own chunk
      }
    }
    atomicAdd(dbias + p * s.h + (col - g * h), sum);
  }
  const int64_t n_end = std::min(c_end, s.N);
  for (int col = threadIdx.x; col < dcols; col += kThreads) {
    const int g = col / d;
    float sum = 0.f;
    for (int64_t c = c0; c < n_end; ++c) sum += static_cast<float>(dout[(pb * s.N + c) * dcols + col]);
    if (c0 < n_end) atomicAdd(db2 + p * D + (col - g * d), sum);
  }
}

// CTAs of kCols columns (k of flatten(pos)) x kRowGroups slices of the hidden units.
constexpr int kCols = 32, kRowGroups = 8;

__global__ void __launch_bounds__(kCols* kRowGroups)
    CompressPositionGradsKernel(ParamPtrs p, const float* __restrict__ dbias, float* __restrict__ dw1,
                                float* __restrict__ dpos, int h, int lD) {
  const int tx = threadIdx.x, ty = threadIdx.y, c = blockIdx.y;
  const int k = blockIdx.x * kCols + tx;
  float sum = 0.f;
  if (k < lD) {
    const float pos = p.pos[c][k];
    const float* w1 = p.w1[c];
    for (int hh = ty; hh < h; hh += kRowGroups) {
      const float d = dbias[c * h + hh];
      const int64_t at = static_cast<int64_t>(hh) * lD + k;
      dw1[static_cast<int64_t>(c) * h * lD + at] += d * pos;
      sum = fmaf(w1[at], d, sum);
    }
  }
  __shared__ float part[kRowGroups][kCols + 1];
  part[ty][tx] = sum;
  __syncthreads();
  if (ty != 0 || k >= lD) return;
  float total = 0.f;
#pragma unroll
  for (int s = 0; s < kRowGroups; ++s) total += part[s][tx];
  dpos[static_cast<int64_t>(c) * lD + k] = total;
}

}  // namespace

bool CompressMlpType(at::ScalarType ct) { return ct == at::kBFloat16 || ct == at::kHalf || ct == at::kFloat; }

bool CompressMlpTakes(const std::vector<CompressorParams>& params, at::ScalarType ct) {
  if (params.empty() || params.size() > static_cast<size_t>(kMaxCompressors) || !CompressMlpType(ct)) return false;
  const auto& first = params.front();
  for (const auto& c : params) {
    for (const at::Tensor* t : {&c.pos, &c.w1, &c.b1, &c.w2, &c.b2}) {
      if (!KernelParam(*t, first.w1.device())) return false;
    }
    if (c.w1.dim() != 2 || c.w2.dim() != 2 || c.pos.sizes() != first.pos.sizes() || c.w1.sizes() != first.w1.sizes() ||
        c.w2.sizes() != first.w2.sizes() || c.pos.numel() != c.w1.size(1) || c.w2.size(1) != c.w1.size(0) ||
        c.b1.numel() != c.w1.size(0) || c.b2.numel() != c.w2.size(0)) {
      return false;
    }
  }
  return first.w1.numel() < INT_MAX;
}

PreparedCompressors PrepareCompressors(const std::vector<CompressorParams>& params, at::ScalarType ct) {
  TORCH_CHECK(CompressMlpTakes(params, ct), "PrepareCompressors: parameters the kernels do not take");
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(params.front().w1));
  const int P = static_cast<int>(params.size());
  const auto& w1 = params[0].w1;
  const int h = static_cast<int>(w1.size(0)), lD = static_cast<int>(w1.size(1)), D = static_cast<int>(params[0].w2.size(0));
  const auto opts = w1.options().dtype(ct);
  PreparedCompressors out{at::empty({P, h, lD}, opts), at::empty({P, D, h}, opts), at::empty({P, D}, opts),
                          at::empty({P, h}, w1.options())};
  const int64_t warps = static_cast<int64_t>(P) * (h + D + 1);
  const dim3 grid(static_cast<unsigned>((warps * 32 + kThreads - 1) / kThreads));
  NSA_DISPATCH_TYPES(ct, "nsa_prepare_compressors", [&] {
    Launch(PrepareCompressorsKernel<scalar_t>, grid, 0, PointersOf(params), P, h, lD, D,
           out.w1.data_ptr<scalar_t>(), out.w2.data_ptr<scalar_t>(), out.b2.data_ptr<scalar_t>(),
           out.pos_bias.data_ptr<float>());
  });
  return out;
}

std::pair<at::Tensor, at::Tensor> CompressHiddenForward(const at::Tensor& y, const at::Tensor& pos_bias) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(y));
  CheckInput(y, "Y", 6);
  CheckInput(pos_bias, "pos_bias", 2);
  TORCH_CHECK(pos_bias.scalar_type() == at::kFloat, "pos_bias must be float32");
  HiddenShape s{y.size(0), y.size(1), y.size(2), y.size(2) - y.size(5) + 1, y.size(3), y.size(4), y.size(5)};
  TORCH_CHECK(s.N > 0 && pos_bias.size(0) == s.P && pos_bias.size(1) == s.h, "CompressHiddenForward: Y ", y.sizes(),
              " and pos_bias ", pos_bias.sizes(), " do not fit");
  auto hidden = at::empty({s.P, s.B, s.N, s.G, s.h}, y.options());
  auto act = at::empty_like(hidden);
  NSA_DISPATCH_TYPES(y.scalar_type(), "nsa_compress_hidden_forward", [&] {
    const int64_t rows = s.P * s.B * s.N;
    Launch(CompressHiddenForwardKernel<scalar_t>, dim3(static_cast<unsigned>(std::min<int64_t>(rows, 1 << 16))), 0,
           y.data_ptr<scalar_t>(), pos_bias.data_ptr<float>(), hidden.data_ptr<scalar_t>(), act.data_ptr<scalar_t>(), s);
  });
  return {hidden, act};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> CompressHiddenBackward(const at::Tensor& dact, const at::Tensor& hidden,
                                                                      const at::Tensor& dout, int64_t r) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(dact));
  CheckInput(dact, "dact", 5);
  CheckInput(hidden, "hidden", 5);
  CheckInput(dout, "dout", 5);
  TORCH_CHECK(dact.sizes() == hidden.sizes() && dact.scalar_type() == hidden.scalar_type() &&
                  dout.scalar_type() == hidden.scalar_type() && dout.sizes().slice(0, 4) == hidden.sizes().slice(0, 4),
              "CompressHiddenBackward: dact ", dact.sizes(), ", hidden ", hidden.sizes(), " and dout ", dout.sizes(),
              " do not fit");
  TORCH_CHECK(r >= 1, "CompressHiddenBackward: r must be positive");
  HiddenShape s{hidden.size(0), hidden.size(1), hidden.size(2) + r - 1, hidden.size(2), hidden.size(3), hidden.size(4), r};
  const int64_t D = dout.size(4);
  auto dy = at::empty({s.P, s.B, s.chunks, s.G, s.h, r}, hidden.options());
  // dbias and db2 in one buffer: one zero fill for both atomic sums.
  auto sums = at::zeros({s.P * (s.h + D)}, hidden.options().dtype(at::kFloat));
  auto dbias = sums.narrow(0, 0, s.P * s.h).view({s.P, s.h});
  auto db2 = sums.narrow(0, s.P * s.h, s.P * D).view({s.P, D});
  const int64_t ctas = s.P * s.B * ((s.chunks + kRowIters - 1) / kRowIters);
  TORCH_CHECK(ctas < INT_MAX, "CompressHiddenBackward: too many rows");
  NSA_DISPATCH_TYPES(hidden.scalar_type(), "nsa_compress_hidden_backward", [&] {
    Launch(CompressHiddenBackwardKernel<scalar_t>, dim3(static_cast<unsigned>(ctas)), 0, dact.data_ptr<scalar_t>(),
           hidden.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(), dy.data_ptr<scalar_t>(), dbias.data_ptr<float>(),
           db2.data_ptr<float>(), s, D);
  });
  return {dy, dbias, db2};
}

bool CompressPositionGradsTake(const std::vector<at::Tensor>& pos, const std::vector<at::Tensor>& w1) {
  if (pos.empty() || pos.size() != w1.size() || pos.size() > static_cast<size_t>(kMaxCompressors)) return false;
  for (size_t c = 0; c < pos.size(); ++c) {
    if (!KernelParam(pos[c], w1[0].device()) || !KernelParam(w1[c], w1[0].device())) return false;
    if (w1[c].dim() != 2 || w1[c].sizes() != w1[0].sizes() || pos[c].numel() != w1[c].size(1)) return false;
  }
  return w1[0].numel() < INT_MAX;
}

at::Tensor CompressPositionGrads(at::Tensor& dw1, const at::Tensor& dbias, const std::vector<at::Tensor>& pos,
                                 const std::vector<at::Tensor>& w1) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(dw1));
  TORCH_CHECK(CompressPositionGradsTake(pos, w1), "CompressPositionGrads: parameters the kernel does not take");
  const int P = static_cast<int>(pos.size());
  const int h = static_cast<int>(w1[0].size(0)), lD = static_cast<int>(w1[0].size(1));
  CheckInput(dw1, "dw1", 3);
  CheckInput(dbias, "dbias", 2);
  TORCH_CHECK(dw1.scalar_type() == at::kFloat && dbias.scalar_type() == at::kFloat && dw1.size(0) == P &&
                  dw1.size(1) == h && dw1.size(2) == lD && dbias.size(0) == P && dbias.size(1) == h,
              "CompressPositionGrads: dw1 ", dw1.sizes(), " and dbias ", dbias.sizes(), " do not fit");
  ParamPtrs ptrs{};
  for (int c = 0; c < P; ++c) {
    ptrs.pos[c] = pos[c].data_ptr<float>();
    ptrs.w1[c] = w1[c].data_ptr<float>();
  }
  auto dpos = at::empty({P, lD}, dw1.options());
  const dim3 grid(static_cast<unsigned>((lD + kCols - 1) / kCols), static_cast<unsigned>(P));
  CompressPositionGradsKernel<<<grid, dim3(kCols, kRowGroups), 0, at::cuda::getCurrentCUDAStream()>>>(
      ptrs, dbias.data_ptr<float>(), dw1.data_ptr<float>(), dpos.data_ptr<float>(), h, lD);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dpos;
}

}  // namespace nsad::nsa::cuda::detail
