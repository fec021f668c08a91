// Residual add fused with the RMSNorm that follows it: s = x + y, h = rms_norm(s) * w, with
// h written directly in the dtype of the next GEMM's input (bf16 under autocast).
//
// Why: in the block `x = x + attn(..); h = norm(x)`, LibTorch runs the add, the norm (float32
// out), autocast's cast of h to bf16, and in the backward the cast back, the norm backward,
// the add's backward (a cast of the gradient for the bf16 branch) and the accumulation of
// the two gradients of x: ~10 passes over [B*T, C] float32. These kernels make 4 forward and
// 5 backward, and the backward hands out the residual gradient in both dtypes at once.
//
// One warp per row (grid-stride over rows); each lane moves kVec consecutive channels per
// access. The weight gradient is summed per warp in shared memory, then per CTA, then over
// CTAs by ATen; rows up to kAddRmsNormMaxChannels channels (the shared memory it takes).
#include <cmath>
#include <type_traits>

#include "fused_launchers.h"
#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

constexpr int kWarps = kThreads / 32;

template <int kVec, typename T>
__device__ __forceinline__ void LoadFloats(const T* p, float (&v)[kVec]) {
  const auto packed = *reinterpret_cast<const Packed<T, kVec>*>(p);
#pragma unroll
  for (int k = 0; k < kVec; ++k) v[k] = static_cast<float>(packed.v[k]);
}
template <int kVec, typename T>
__device__ __forceinline__ void StoreFloats(T* p, const float (&v)[kVec]) {
  Packed<T, kVec> packed;
#pragma unroll
  for (int k = 0; k < kVec; ++k) packed.v[k] = static_cast<T>(v[k]);
  *reinterpret_cast<Packed<T, kVec>*>(p) = packed;
}

// p[offset ..], or zeros for a gradient autograd did not materialise (kRead false; a run-time
// null check instead cost the backward kernels 2-3% where the gradient is there).
template <bool kRead, int kVec>
__device__ __forceinline__ void LoadRowOrZeros(const float* p, int64_t offset, float (&v)[kVec]) {
  if constexpr (kRead) {
    LoadFloats<kVec>(p + offset, v);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = 0.f;
  }
}

// x float32, y and h of type scalar_t; s float32; rstd float32 [rows]. kYIn false: no y (the
// norm of x alone), s is x and is not written.
template <typename scalar_t, int kVec, bool kYIn>
__global__ void __launch_bounds__(kThreads)
    AddRmsNormForwardKernel(const float* __restrict__ x, const scalar_t* __restrict__ y,
                            const float* __restrict__ w, float* __restrict__ s,
                            scalar_t* __restrict__ h, float* __restrict__ rstd, int64_t rows,
                            int C, float eps) {
  const int lane = threadIdx.x % 32;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t base = row * C;
    float sum_sq = 0.f;
    for (int c = lane * kVec; c < C; c += 32 * kVec) {
      float a[kVec], b[kVec];
      LoadFloats<kVec>(x + base + c, a);
      if constexpr (kYIn) LoadFloats<kVec>(y + base + c, b);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if constexpr (kYIn) a[k] += b[k];
        sum_sq += a[k] * a[k];
      }
      if constexpr (kYIn) StoreFloats<kVec>(s + base + c, a);
    }
    const float r = rsqrtf(WarpSum(sum_sq) / C + eps);
    // Second pass over the row this warp just wrote or read (in L1/L2).
    for (int c = lane * kVec; c < C; c += 32 * kVec) {
      float a[kVec], g[kVec];
      LoadFloats<kVec>((kYIn ? s : x) + base + c, a);
      LoadFloats<kVec>(w + c, g);
#pragma unroll
      for (int k = 0; k < kVec; ++k) a[k] = a[k] * r * g[k];
      StoreFloats<kVec>(h + base + c, a);
    }
    if (lane == 0) rstd[row] = r;
  }
}

// The backward's per-warp weight-gradient rows in shared memory (kWarps x C floats, one
// writer per (warp, channel): no atomics): zeroed, and this warp's row returned.
__device__ __forceinline__ float* ZeroedWarpRows(float* dw_smem, int C) {
  for (int c = threadIdx.x; c < kWarps * C; c += kThreads) dw_smem[c] = 0.f;
  __syncthreads();
  return dw_smem + (threadIdx.x / 32) * C;
}
// The CTA's weight-gradient partial: the sum of its warps' rows, into dw_partial[blockIdx.x].
__device__ __forceinline__ void StoreCtaPartial(const float* dw_smem, float* dw_partial, int C) {
  __syncthreads();
  for (int c = threadIdx.x; c < C; c += kThreads) {
    float sum = 0.f;
#pragma unroll
    for (int warp = 0; warp < kWarps; ++warp) sum += dw_smem[warp * C + c];
    dw_partial[static_cast<int64_t>(blockIdx.x) * C + c] = sum;
  }
}

// With s_hat = s * rstd and u = dh * w: ds = ds_in + rstd * (u - s_hat * mean(u * s_hat))
// (kDsIn false: ds_in is not read, zeros), also written to dy unless kDyOut is false (the norm
// of x alone has no y); dw = sum over rows of dh * s_hat (per CTA into
// dw_partial[blockIdx.x]).
template <typename scalar_t, int kVec, bool kDsIn, bool kDyOut>
__global__ void __launch_bounds__(kThreads)
    AddRmsNormBackwardKernel(const float* __restrict__ ds_in, const scalar_t* __restrict__ dh,
                             const float* __restrict__ s, const float* __restrict__ rstd,
                             const float* __restrict__ w, float* __restrict__ ds,
                             scalar_t* __restrict__ dy, float* __restrict__ dw_partial,
                             int64_t rows, int C) {
  extern __shared__ float dw_smem[];
  float* dw_warp = ZeroedWarpRows(dw_smem, C);
  const int lane = threadIdx.x % 32;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t base = row * C;
    const float r = rstd[row];
    float dot = 0.f;
    for (int c = lane * kVec; c < C; c += 32 * kVec) {
      float g[kVec], a[kVec], wt[kVec];
      LoadFloats<kVec>(dh + base + c, g);
      LoadFloats<kVec>(s + base + c, a);
      LoadFloats<kVec>(w + c, wt);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float s_hat = a[k] * r;
        dot += g[k] * wt[k] * s_hat;
        dw_warp[c + k] += g[k] * s_hat;
      }
    }
    const float mean_dot = WarpSum(dot) / C;
    for (int c = lane * kVec; c < C; c += 32 * kVec) {
      float g[kVec], a[kVec], wt[kVec], d[kVec];
      LoadFloats<kVec>(dh + base + c, g);
      LoadFloats<kVec>(s + base + c, a);
      LoadFloats<kVec>(w + c, wt);
      LoadRowOrZeros<kDsIn, kVec>(ds_in, base + c, d);
#pragma unroll
      for (int k = 0; k < kVec; ++k) d[k] += r * (g[k] * wt[k] - a[k] * r * mean_dot);
      StoreFloats<kVec>(ds + base + c, d);
      if constexpr (kDyOut) StoreFloats<kVec>(dy + base + c, d);
    }
  }
  StoreCtaPartial(dw_smem, dw_partial, C);
}

// The same backward with each lane's share of the row held in registers (C <= 32 * kVec *
// kIters): dh, s and ds_in are each read once per row, all of the row's loads issued before
// the first is used. The kernel above rereads dh and s for its second pass and has two loads
// in flight per lane: it moved 2.3 TB/s on an H100 (174 us per call at m7c's batch 16).
template <typename scalar_t, int kVec, int kIters, bool kDsIn, bool kDyOut>
__global__ void __launch_bounds__(kThreads)
    AddRmsNormBackwardRegistersKernel(const float* __restrict__ ds_in, const scalar_t* __restrict__ dh,
                                      const float* __restrict__ s, const float* __restrict__ rstd,
                                      const float* __restrict__ w, float* __restrict__ ds,
                                      scalar_t* __restrict__ dy, float* __restrict__ dw_partial,
                                      int64_t rows, int C) {
  extern __shared__ float dw_smem[];
  float* dw_warp = ZeroedWarpRows(dw_smem, C);
  const int lane = threadIdx.x % 32;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t base = row * C;
    float g[kIters][kVec], a[kIters][kVec], d[kIters][kVec];
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int c = (it * 32 + lane) * kVec;
      if (c < C) {
        LoadFloats<kVec>(dh + base + c, g[it]);
        LoadFloats<kVec>(s + base + c, a[it]);
        LoadRowOrZeros<kDsIn, kVec>(ds_in, base + c, d[it]);
      }
    }
    const float r = rstd[row];
    float dot = 0.f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int c = (it * 32 + lane) * kVec;
      if (c < C) {
        float wt[kVec];
        LoadFloats<kVec>(w + c, wt);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          a[it][k] *= r;  // s_hat
          dot += g[it][k] * wt[k] * a[it][k];
          dw_warp[c + k] += g[it][k] * a[it][k];
        }
      }
    }
    const float mean_dot = WarpSum(dot) / C;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int c = (it * 32 + lane) * kVec;
      if (c < C) {
        float wt[kVec];
        LoadFloats<kVec>(w + c, wt);
#pragma unroll
        for (int k = 0; k < kVec; ++k) d[it][k] += r * (g[it][k] * wt[k] - a[it][k] * mean_dot);
        StoreFloats<kVec>(ds + base + c, d[it]);
        if constexpr (kDyOut) StoreFloats<kVec>(dy + base + c, d[it]);
      }
    }
  }
  StoreCtaPartial(dw_smem, dw_partial, C);
}
// Row chunks per lane the register kernel holds: C up to 32 * 4 * 8 = 1024 channels.
constexpr int kBackwardRegisterIters = 8;

void CheckRows(const at::Tensor& t, const char* name, int64_t C) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.size(-1) == C, name,
              " must be a contiguous CUDA tensor [.., ", C, "], got ", t.sizes());
}

// 4 channels per access when C and every pointer allow it, else 1. An undefined tensor (no y,
// no ds_in, no dy) has no pointer to check.
bool RowsTakeVectors(int64_t C, std::initializer_list<const at::Tensor*> ts) {
  bool ok = C % 4 == 0;
  for (const auto* t : ts) ok = ok && (!t->defined() || AlignedFor(*t, 4));
  return ok;
}

// Backward: few enough CTAs that the per-CTA weight partials stay small -- one wave of as
// many as fit on the GPU (at most 4 per SM) -- and no more than there are rows.
template <typename Kernel>
int RowCtas(Kernel kernel, int64_t rows, size_t smem_bytes) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem_bytes));
  per_sm = std::max(1, std::min(per_sm, 4));
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((rows + kWarps - 1) / kWarps, per_sm * sms)));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> AddRmsNormForward(const at::Tensor& x,
                                                                 const at::Tensor& y,
                                                                 const at::Tensor& weight,
                                                                 double eps, at::ScalarType h_type) {
  const int64_t C = weight.numel();
  CheckRows(x, "x", C);
  if (y.defined()) CheckRows(y, "y", C);
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "add+rms_norm takes a float32 residual and weight");
  TORCH_CHECK(!y.defined() || x.sizes() == y.sizes(), "add+rms_norm: x ", x.sizes(), " and y ", y.sizes());
  const int64_t rows = C == 0 ? 0 : x.numel() / C;
  auto s = y.defined() ? at::empty_like(x) : at::Tensor();
  auto h = at::empty(x.sizes(), x.options().dtype(y.defined() ? y.scalar_type() : h_type));
  auto rstd = at::empty({rows}, x.options());
  if (rows == 0) return {s, h, rstd};
  const auto w = weight.contiguous();
  NSA_DISPATCH_TYPES(h.scalar_type(), "nsa_add_rms_norm_forward", [&] {
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>((rows + kWarps - 1) / kWarps, 1 << 16)));
    auto launch = [&](auto kernel) {
      Launch(kernel, grid, 0, x.data_ptr<float>(), y.defined() ? y.data_ptr<scalar_t>() : nullptr,
             w.data_ptr<float>(), s.defined() ? s.data_ptr<float>() : nullptr, h.data_ptr<scalar_t>(),
             rstd.data_ptr<float>(), rows, static_cast<int>(C), static_cast<float>(eps));
    };
    const auto launch_for = [&](auto y_in) {
      constexpr bool kYIn = decltype(y_in)::value;
      if (RowsTakeVectors(C, {&x, &y, &w, &s, &h})) {
        launch(AddRmsNormForwardKernel<scalar_t, 4, kYIn>);
      } else {
        launch(AddRmsNormForwardKernel<scalar_t, 1, kYIn>);
      }
    };
    if (y.defined()) {
      launch_for(std::true_type{});
    } else {
      launch_for(std::false_type{});
    }
  });
  return {s, h, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> AddRmsNormBackward(
    const at::Tensor& ds_in, const at::Tensor& dh_in, const at::Tensor& s, const at::Tensor& rstd,
    const at::Tensor& weight, bool want_dy) {
  const int64_t C = weight.numel();
  TORCH_CHECK(C <= kAddRmsNormMaxChannels, "add+rms_norm takes at most ", kAddRmsNormMaxChannels,
              " channels, got ", C);
  CheckRows(s, "s", C);
  const auto dh = dh_in.contiguous();
  CheckRows(dh, "dh", C);
  TORCH_CHECK(!ds_in.defined() || ds_in.sizes() == s.sizes(), "add+rms_norm backward: the gradient of s must be "
              "shaped like s");
  // Undefined where only h was used (the final norm): the kernels read no zeros for it. The
  // norm of x alone always reads one (its s is x, whose other uses give it a gradient).
  auto ds_prev = ds_in.defined() ? ds_in.to(at::kFloat).contiguous() : at::Tensor();
  if (!want_dy && !ds_prev.defined()) ds_prev = at::zeros_like(s);
  const int64_t rows = C == 0 ? 0 : s.numel() / C;
  auto ds = at::empty_like(s);
  auto dy = want_dy ? at::empty_like(dh) : at::Tensor();
  if (rows == 0) return {ds, dy, at::zeros_like(weight)};
  const auto w = weight.contiguous();
  const size_t smem = kWarps * C * sizeof(float);
  at::Tensor dw_partial;
  NSA_DISPATCH_TYPES(dh.scalar_type(), "nsa_add_rms_norm_backward", [&] {
    auto launch = [&](auto kernel) {
      const int ctas = RowCtas(kernel, rows, smem);
      dw_partial = at::empty({ctas, C}, s.options());
      Launch(kernel, dim3(ctas), smem, ds_prev.defined() ? ds_prev.data_ptr<float>() : nullptr,
             dh.data_ptr<scalar_t>(), s.data_ptr<float>(), rstd.data_ptr<float>(), w.data_ptr<float>(),
             ds.data_ptr<float>(), dy.defined() ? dy.data_ptr<scalar_t>() : nullptr, dw_partial.data_ptr<float>(),
             rows, static_cast<int>(C));
    };
    // kDsIn and kDyOut as (true, true), (false, true) or (true, false).
    const auto launch_for = [&](auto ds_in_read, auto dy_out) {
      constexpr bool kDsIn = decltype(ds_in_read)::value, kDyOut = decltype(dy_out)::value;
      if (RowsTakeVectors(C, {&ds_prev, &dh, &s, &w, &ds, &dy})) {
        if (C <= 32 * 4 * kBackwardRegisterIters) {
          launch(AddRmsNormBackwardRegistersKernel<scalar_t, 4, kBackwardRegisterIters, kDsIn, kDyOut>);
        } else {
          launch(AddRmsNormBackwardKernel<scalar_t, 4, kDsIn, kDyOut>);
        }
      } else {
        launch(AddRmsNormBackwardKernel<scalar_t, 1, kDsIn, kDyOut>);
      }
    };
    if (!want_dy) {
      launch_for(std::true_type{}, std::false_type{});
    } else if (ds_prev.defined()) {
      launch_for(std::true_type{}, std::true_type{});
    } else {
      launch_for(std::false_type{}, std::true_type{});
    }
  });
  // The partials' column sums: at::sum over the 528 rows of [528, 768] took 21 us on an H100
  // (6 CTAs), a product with a ones vector (its fill and a GEMV: two launches) 8.5 us.
  auto dw = at::empty({C}, s.options());
  SumParts(dw_partial, {dw});
  return {ds, dy, dw.view(weight.sizes())};
}

}  // namespace nsad::nsa::cuda::detail
