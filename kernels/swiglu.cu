// Fused SwiGLU: out = silu(gate) * up from the joint projection [.., 2F] = [gate | up] (one
// GEMM, model/shared_input_linear.h), one kernel forward and one backward that writes the
// joint gradient [.., 2F] in one piece.
//
// Why: LibTorch runs silu, mul, and in the backward mul's two products, silu_backward and
// the concatenation of the two halves' gradients (split's backward): ~14 passes over [N, F]
// tensors. These kernels make 3 forward (read gate and up, write out) and 5 backward.
//
// Each thread handles kVec consecutive features of one row (16-byte accesses when F and the
// pointers allow it, else 1). float32 arithmetic, each output rounded once.
//
// Also silu alone over the rows of a strided view (SiluRowsForward/Backward): the gate MLP's
// hidden layer is a column slice of the attention's joint input projection, and LibTorch's
// silu and silu_backward on that view take their element-by-element path (19.6 and 22.4 us
// per layer at m7c batch 16 on an H100, 1.3 TB/s).
#include <numeric>

#include "fused_launchers.h"
#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

__device__ __forceinline__ float Sigmoid(float a) { return 1.f / (1.f + __expf(-a)); }

// Grid-stride walk over the kVec-feature chunks of `rows` rows of F features: body(row, f)
// for features f .. f + kVec - 1.
template <int kVec, typename Body>
__device__ __forceinline__ void ForEachRowChunk(int64_t rows, int64_t F, Body body) {
  const int64_t chunks = F / kVec, items = rows * chunks;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < items;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t row = i / chunks;
    body(row, (i - row * chunks) * kVec);
  }
}

// The same over a joint [rows, 2F] tensor: body(row, f, gate, up) with the row's gate and up
// values at features f .. f + kVec - 1.
template <typename scalar_t, int kVec, typename Body>
__device__ __forceinline__ void ForEachGateUpChunk(const scalar_t* __restrict__ joint, int64_t rows, int64_t F,
                                                   Body body) {
  using Vec = Packed<scalar_t, kVec>;
  ForEachRowChunk<kVec>(rows, F, [&](int64_t row, int64_t f) {
    body(row, f, *reinterpret_cast<const Vec*>(joint + row * 2 * F + f),
         *reinterpret_cast<const Vec*>(joint + row * 2 * F + F + f));
  });
}

template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads)
    SwiGluForwardKernel(const scalar_t* __restrict__ joint, scalar_t* __restrict__ out,
                        int64_t rows, int64_t F) {
  using Vec = Packed<scalar_t, kVec>;
  ForEachGateUpChunk<scalar_t, kVec>(joint, rows, F, [&](int64_t row, int64_t f, const Vec& a, const Vec& b) {
    Vec y;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float g = static_cast<float>(a.v[k]);
      y.v[k] = static_cast<scalar_t>(g * Sigmoid(g) * static_cast<float>(b.v[k]));
    }
    *reinterpret_cast<Vec*>(out + row * F + f) = y;
  });
}

// d gate = dout * up * s (1 + gate (1 - s)) with s = sigmoid(gate); d up = dout * silu(gate).
template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads)
    SwiGluBackwardKernel(const scalar_t* __restrict__ dout, const scalar_t* __restrict__ joint,
                         scalar_t* __restrict__ djoint, int64_t rows, int64_t F) {
  using Vec = Packed<scalar_t, kVec>;
  ForEachGateUpChunk<scalar_t, kVec>(joint, rows, F, [&](int64_t row, int64_t f, const Vec& a, const Vec& b) {
    const Vec d = *reinterpret_cast<const Vec*>(dout + row * F + f);
    Vec da, db;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float g = static_cast<float>(a.v[k]), u = static_cast<float>(b.v[k]);
      const float go = static_cast<float>(d.v[k]), s = Sigmoid(g);
      da.v[k] = static_cast<scalar_t>(go * u * s * (1.f + g * (1.f - s)));
      db.v[k] = static_cast<scalar_t>(go * g * s);
    }
    *reinterpret_cast<Vec*>(djoint + row * 2 * F + f) = da;
    *reinterpret_cast<Vec*>(djoint + row * 2 * F + F + f) = db;
  });
}

// silu(x) of rows x_stride apart into contiguous rows.
template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads)
    SiluRowsForwardKernel(const scalar_t* __restrict__ x, int64_t x_stride, scalar_t* __restrict__ out,
                          int64_t rows, int64_t F) {
  using Vec = Packed<scalar_t, kVec>;
  ForEachRowChunk<kVec>(rows, F, [&](int64_t row, int64_t f) {
    const Vec a = *reinterpret_cast<const Vec*>(x + row * x_stride + f);
    Vec y;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float v = static_cast<float>(a.v[k]);
      y.v[k] = static_cast<scalar_t>(v * Sigmoid(v));
    }
    *reinterpret_cast<Vec*>(out + row * F + f) = y;
  });
}

// dx = dout * s (1 + x (1 - s)), s = sigmoid(x), into rows dx_stride apart.
template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads)
    SiluRowsBackwardKernel(const scalar_t* __restrict__ dout, const scalar_t* __restrict__ x, int64_t x_stride,
                           scalar_t* __restrict__ dx, int64_t dx_stride, int64_t rows, int64_t F) {
  using Vec = Packed<scalar_t, kVec>;
  ForEachRowChunk<kVec>(rows, F, [&](int64_t row, int64_t f) {
    const Vec a = *reinterpret_cast<const Vec*>(x + row * x_stride + f);
    const Vec d = *reinterpret_cast<const Vec*>(dout + row * F + f);
    Vec y;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float v = static_cast<float>(a.v[k]), sg = Sigmoid(v);
      y.v[k] = static_cast<scalar_t>(static_cast<float>(d.v[k]) * sg * (1.f + v * (1.f - sg)));
    }
    *reinterpret_cast<Vec*>(dx + row * dx_stride + f) = y;
  });
}

void CheckJoint(const at::Tensor& joint) {
  TORCH_CHECK(joint.is_cuda() && joint.is_contiguous() && joint.dim() >= 1 &&
                  joint.size(-1) % 2 == 0,
              "SwiGLU takes a contiguous CUDA tensor [.., 2F], got ", joint.sizes());
}

// Launches kernel<kVec = 16 bytes> when F, the rows' stride (elements; the joint's 2F and the
// outputs' F follow from F) and the pointers allow it, else kernel<1>.
template <typename scalar_t, typename Wide, typename Narrow, typename... Args>
void LaunchRows(Wide wide, Narrow narrow, int64_t rows, int64_t F, int64_t row_stride,
                std::initializer_list<const void*> ptrs, Args... args) {
  constexpr int kWide = 16 / sizeof(scalar_t);
  bool aligned = F % kWide == 0 && row_stride % kWide == 0;
  for (const void* p : ptrs) aligned = aligned && AlignedFor(static_cast<const scalar_t*>(p), kWide);
  if (aligned) {
    Launch(wide, GridStride(rows * (F / kWide)), 0, args..., rows, F);
  } else {
    Launch(narrow, GridStride(rows * F), 0, args..., rows, F);
  }
}

}  // namespace

// The row stride of x viewed as [rows, F] (unit stride in F, leading dims collapsing to one
// stride), or -1 where they do not collapse.
int64_t CollapsedRowStride(const at::Tensor& x) {
  if (x.dim() == 0 || x.stride(-1) != 1) return -1;
  if (x.dim() == 1) return x.size(0);
  for (int64_t d = 0; d + 2 < x.dim(); ++d) {
    if (x.size(d) != 1 && x.stride(d) != x.stride(d + 1) * x.size(d + 1)) return -1;
  }
  return x.stride(-2);
}

at::Tensor SwiGluForward(const at::Tensor& joint) {
  CheckJoint(joint);
  const int64_t F = joint.size(-1) / 2, rows = F == 0 ? 0 : joint.numel() / (2 * F);
  auto sizes = joint.sizes().vec();
  sizes.back() = F;
  auto out = at::empty(sizes, joint.options());
  if (rows == 0) return out;
  NSA_DISPATCH_TYPES(joint.scalar_type(), "nsa_swiglu_forward", [&] {
    constexpr int kWide = 16 / sizeof(scalar_t);
    LaunchRows<scalar_t>(SwiGluForwardKernel<scalar_t, kWide>, SwiGluForwardKernel<scalar_t, 1>, rows,
                         F, F, {joint.data_ptr(), out.data_ptr()}, joint.data_ptr<scalar_t>(),
                         out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor SwiGluBackward(const at::Tensor& dout_in, const at::Tensor& joint) {
  CheckJoint(joint);
  const int64_t F = joint.size(-1) / 2, rows = F == 0 ? 0 : joint.numel() / (2 * F);
  TORCH_CHECK(dout_in.numel() == rows * F, "SwiGLU gradient must have the output's shape");
  const auto dout = dout_in.to(joint.scalar_type()).contiguous();
  auto djoint = at::empty_like(joint);
  if (rows == 0) return djoint;
  NSA_DISPATCH_TYPES(joint.scalar_type(), "nsa_swiglu_backward", [&] {
    constexpr int kWide = 16 / sizeof(scalar_t);
    LaunchRows<scalar_t>(SwiGluBackwardKernel<scalar_t, kWide>, SwiGluBackwardKernel<scalar_t, 1>,
                         rows, F, F, {dout.data_ptr(), joint.data_ptr(), djoint.data_ptr()},
                         dout.data_ptr<scalar_t>(), joint.data_ptr<scalar_t>(),
                         djoint.data_ptr<scalar_t>());
  });
  return djoint;
}

bool SiluRowsTake(const at::Tensor& x) { return x.is_cuda() && x.numel() > 0 && CollapsedRowStride(x) >= 0; }

at::Tensor SiluRowsForward(const at::Tensor& x) {
  TORCH_CHECK(SiluRowsTake(x), "SiluRowsForward takes a CUDA tensor whose rows [.., F] have one stride, got ",
              x.sizes(), " with strides ", x.strides());
  const int64_t F = x.size(-1), rows = x.numel() / F, x_stride = CollapsedRowStride(x);
  auto out = at::empty(x.sizes(), x.options());
  NSA_DISPATCH_TYPES(x.scalar_type(), "nsa_silu_rows_forward", [&] {
    constexpr int kWide = 16 / sizeof(scalar_t);
    LaunchRows<scalar_t>(SiluRowsForwardKernel<scalar_t, kWide>, SiluRowsForwardKernel<scalar_t, 1>, rows, F,
                         x_stride, {x.data_ptr(), out.data_ptr()}, x.data_ptr<scalar_t>(), x_stride,
                         out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor SiluRowsBackward(const at::Tensor& dout_in, const at::Tensor& x, const at::Tensor& dx_out) {
  TORCH_CHECK(SiluRowsTake(x), "SiluRowsBackward takes x as SiluRowsForward does");
  TORCH_CHECK(dout_in.sizes() == x.sizes(), "silu gradient must have x's shape");
  const int64_t F = x.size(-1), rows = x.numel() / F, x_stride = CollapsedRowStride(x);
  const auto dout = dout_in.to(x.scalar_type()).contiguous();
  auto dx = dx_out.defined() ? dx_out : at::empty(x.sizes(), x.options());
  const int64_t dx_stride = CollapsedRowStride(dx);
  TORCH_CHECK(dx.sizes() == x.sizes() && dx.scalar_type() == x.scalar_type() && dx.device() == x.device() &&
                  dx_stride >= 0,
              "silu backward: dx_out must be x's shape and dtype on its device, rows of one stride; got ",
              dx.scalar_type(), " ", dx.sizes(), " strides ", dx.strides());
  NSA_DISPATCH_TYPES(x.scalar_type(), "nsa_silu_rows_backward", [&] {
    constexpr int kWide = 16 / sizeof(scalar_t);
    // The wide kernel needs both row strides aligned: LaunchRows checks one, the other is
    // folded into it (their gcd).
    LaunchRows<scalar_t>(SiluRowsBackwardKernel<scalar_t, kWide>, SiluRowsBackwardKernel<scalar_t, 1>, rows, F,
                         std::gcd(x_stride, dx_stride), {dout.data_ptr(), x.data_ptr(), dx.data_ptr()},
                         dout.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), x_stride, dx.data_ptr<scalar_t>(),
                         dx_stride);
  });
  return dx;
}

}  // namespace nsad::nsa::cuda::detail
