// AdamW over tensor lists (contract: adamw.h).
//
// Why: the optimizer's CUDA step was _foreach_mul_ (the clip: read and write every
// gradient) and then ATen's fused AdamW (read parameter, gradient and both moments, write
// parameter and moments), 36 bytes per parameter; with the clip factor applied as the
// gradient is read it is 28. The update is bandwidth-bound: at m7c's 125M parameters the
// two passes took about 0.35 + 1.3 ms per step on an H100 (ncu).
#include "adamw.h"

#include <ATen/DeviceGuard.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

constexpr int kAdamThreads = 512;
constexpr int64_t kAdamChunk = 65536;  // elements per CTA (a multiple of 4 kAdamThreads)
// Tensors per launch: the list travels as the kernel's parameters, which stay under 4 KB.
constexpr int kAdamTensors = 40;

struct AdamWList {
  float* param[kAdamTensors];
  const float* grad[kAdamTensors];
  float* exp_avg[kAdamTensors];
  float* exp_avg_sq[kAdamTensors];
  const float* step[kAdamTensors];
  void* copy[kAdamTensors];  // the parameter's 16-bit copy, or null
  int64_t numel[kAdamTensors];
  int first_cta[kAdamTensors + 1];  // tensor t owns CTAs [first_cta[t], first_cta[t + 1])
  bool vec4[kAdamTensors];          // all four pointers 16-byte aligned, the copy's 8-byte
  int count;
};

struct AdamWConsts {
  float beta1, beta2, weight_decay, eps;
};

__device__ __forceinline__ void AdamWElement(float& p, float g, float& m, float& v, float lr, float step_size,
                                             float bc2_sqrt, const AdamWConsts& c) {
  p -= lr * c.weight_decay * p;
  m = c.beta1 * m + (1.f - c.beta1) * g;
  v = c.beta2 * v + (1.f - c.beta2) * g * g;
  p -= step_size * m / (sqrtf(v) / bc2_sqrt + c.eps);
}

// The copies' element type: c10::BFloat16 or c10::Half (their conversions from float round
// to nearest even, as Tensor::to does).
template <typename copy_t>
__global__ void __launch_bounds__(kAdamThreads)
    FusedAdamWKernel(AdamWList list, AdamWConsts c, const float* __restrict__ lr_ptr,
                     const float* __restrict__ scale_ptr, const float* __restrict__ found_inf_ptr) {
  if (found_inf_ptr != nullptr && *found_inf_ptr != 0.f) return;
  int t = 0, hi = list.count;  // the last tensor whose first CTA is <= this one
  while (hi - t > 1) {
    const int mid = (t + hi) / 2;
    if (list.first_cta[mid] <= static_cast<int>(blockIdx.x)) t = mid; else hi = mid;
  }
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - list.first_cta[t]) * kAdamChunk;
  const int64_t end = std::min(begin + kAdamChunk, list.numel[t]);
  const float lr = *lr_ptr, scale = scale_ptr != nullptr ? *scale_ptr : 1.f, s = *list.step[t];
  const float step_size = lr / (1.f - powf(c.beta1, s)), bc2_sqrt = sqrtf(1.f - powf(c.beta2, s));
  float* const p = list.param[t];
  const float* const g = list.grad[t];
  float* const m = list.exp_avg[t];
  float* const v = list.exp_avg_sq[t];
  copy_t* const copy = static_cast<copy_t*>(list.copy[t]);
  int64_t i = begin + threadIdx.x;
  if (list.vec4[t]) {
    const int64_t vec_end = begin + (end - begin) / 4 * 4;
    for (int64_t j = begin + 4 * threadIdx.x; j < vec_end; j += 4 * kAdamThreads) {
      float4 pp = *reinterpret_cast<const float4*>(p + j), mm = *reinterpret_cast<const float4*>(m + j),
             vv = *reinterpret_cast<const float4*>(v + j);
      const float4 gg = *reinterpret_cast<const float4*>(g + j);
      AdamWElement(pp.x, gg.x * scale, mm.x, vv.x, lr, step_size, bc2_sqrt, c);
      AdamWElement(pp.y, gg.y * scale, mm.y, vv.y, lr, step_size, bc2_sqrt, c);
      AdamWElement(pp.z, gg.z * scale, mm.z, vv.z, lr, step_size, bc2_sqrt, c);
      AdamWElement(pp.w, gg.w * scale, mm.w, vv.w, lr, step_size, bc2_sqrt, c);
      *reinterpret_cast<float4*>(p + j) = pp;
      *reinterpret_cast<float4*>(m + j) = mm;
      *reinterpret_cast<float4*>(v + j) = vv;
      if (copy != nullptr) {
        Packed<copy_t, 4> out;
        out.v[0] = copy_t(pp.x);
        out.v[1] = copy_t(pp.y);
        out.v[2] = copy_t(pp.z);
        out.v[3] = copy_t(pp.w);
        *reinterpret_cast<Packed<copy_t, 4>*>(copy + j) = out;
      }
    }
    i = vec_end + threadIdx.x;  // the tail
  }
  for (; i < end; i += kAdamThreads) {
    AdamWElement(p[i], g[i] * scale, m[i], v[i], lr, step_size, bc2_sqrt, c);
    if (copy != nullptr) copy[i] = copy_t(p[i]);
  }
}

// The dtype of the copies (all one), or nullopt where there are none; refuses what the kernel
// cannot write.
std::optional<at::ScalarType> CopiesType(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& copies) {
  TORCH_CHECK(copies.empty() || copies.size() == params.size(), "FusedAdamW: ", copies.size(), " copies for ",
              params.size(), " parameters");
  std::optional<at::ScalarType> type;
  for (size_t i = 0; i < copies.size(); ++i) {
    const auto& c = copies[i];
    if (!c.defined()) continue;
    TORCH_CHECK(c.scalar_type() == at::kBFloat16 || c.scalar_type() == at::kHalf,
                "FusedAdamW: copy ", i, " must be bf16 or fp16, got ", c.scalar_type());
    TORCH_CHECK(!type || *type == c.scalar_type(), "FusedAdamW: the copies must share one dtype, got ", *type,
                " and ", c.scalar_type());
    TORCH_CHECK(c.device() == params[i].device() && c.is_contiguous() && c.numel() == params[i].numel(),
                "FusedAdamW: copy ", i, " must be contiguous, on its parameter's device, with its ",
                params[i].numel(), " elements; got ", c.sizes(), " on ", c.device());
    type = c.scalar_type();
  }
  return type;
}

}  // namespace

bool FusedAdamWTakes(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avg, const std::vector<at::Tensor>& exp_avg_sq,
                     const std::vector<at::Tensor>& steps) {
  const size_t n = params.size();
  if (n == 0 || grads.size() != n || exp_avg.size() != n || exp_avg_sq.size() != n || steps.size() != n) return false;
  const auto device = params[0].device();
  for (size_t i = 0; i < n; ++i) {
    for (const at::Tensor* t : {&params[i], &grads[i], &exp_avg[i], &exp_avg_sq[i], &steps[i]}) {
      if (!t->defined() || !t->is_cuda() || t->device() != device || t->scalar_type() != at::kFloat ||
          !t->is_contiguous()) {
        return false;
      }
    }
    if (grads[i].sizes() != params[i].sizes() || exp_avg[i].sizes() != params[i].sizes() ||
        exp_avg_sq[i].sizes() != params[i].sizes() || steps[i].numel() != 1) {
      return false;
    }
  }
  return true;
}

void FusedAdamW(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avg, const std::vector<at::Tensor>& exp_avg_sq,
                const std::vector<at::Tensor>& steps, const at::Tensor& lr, double beta1, double beta2,
                double weight_decay, double eps, const at::Tensor& grad_scale, const at::Tensor& found_inf,
                const std::vector<at::Tensor>& copies) {
  TORCH_CHECK(FusedAdamWTakes(params, grads, exp_avg, exp_avg_sq, steps),
              "FusedAdamW takes float32 contiguous CUDA tensors of matching shapes");
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(params.front()));
  const auto copies_type = CopiesType(params, copies);
  for (const at::Tensor* s : {&lr, &grad_scale, &found_inf}) {
    TORCH_CHECK(!s->defined() || (s->is_cuda() && s->scalar_type() == at::kFloat && s->numel() == 1),
                "FusedAdamW: lr, grad_scale and found_inf are float32 CUDA scalars");
  }
  TORCH_CHECK(lr.defined(), "FusedAdamW needs a learning rate tensor");
  const AdamWConsts consts{static_cast<float>(beta1), static_cast<float>(beta2), static_cast<float>(weight_decay),
                           static_cast<float>(eps)};
  const float* scale_ptr = grad_scale.defined() ? grad_scale.data_ptr<float>() : nullptr;
  const float* found_ptr = found_inf.defined() ? found_inf.data_ptr<float>() : nullptr;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AdamWList list{};
  const auto launch = [&] {
    if (list.count > 0 && list.first_cta[list.count] > 0) {
      const auto kernel = copies_type == at::kHalf ? FusedAdamWKernel<c10::Half> : FusedAdamWKernel<c10::BFloat16>;
      kernel<<<list.first_cta[list.count], kAdamThreads, 0, stream>>>(list, consts, lr.data_ptr<float>(), scale_ptr,
                                                                      found_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    list = AdamWList{};
  };
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t numel = params[i].numel();
    const int64_t ctas = (numel + kAdamChunk - 1) / kAdamChunk;
    if (list.count == kAdamTensors || list.first_cta[list.count] + ctas > (int64_t{1} << 30)) launch();
    const int k = list.count;
    list.param[k] = params[i].data_ptr<float>();
    list.grad[k] = grads[i].data_ptr<float>();
    list.exp_avg[k] = exp_avg[i].data_ptr<float>();
    list.exp_avg_sq[k] = exp_avg_sq[i].data_ptr<float>();
    list.step[k] = steps[i].data_ptr<float>();
    const bool copied = !copies.empty() && copies[i].defined();
    list.copy[k] = copied ? copies[i].data_ptr() : nullptr;
    list.numel[k] = numel;
    // Four elements per access: 16 bytes of float32, 8 of the 16-bit copy.
    list.vec4[k] = AlignedFor(params[i], 4) && AlignedFor(grads[i], 4) && AlignedFor(exp_avg[i], 4) &&
                   AlignedFor(exp_avg_sq[i], 4) && (!copied || AlignedFor(copies[i], 4));
    list.first_cta[k + 1] = list.first_cta[k] + static_cast<int>(ctas);
    list.count = k + 1;
  }
  launch();
  // Written in place through raw pointers: what an in-place op would record.
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].unsafeGetTensorImpl()->bump_version();
    if (!copies.empty() && copies[i].defined()) copies[i].unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace nsad::nsa::cuda::detail
