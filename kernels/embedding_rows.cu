// The token embedding's backward on CUDA (contract: fused_launchers.h, AddRowsAt).
//
// Why: ATen's index_add_ adds one float per atomic and computes each element's destination
// with an integer division; for the m7c step's 32768 x 768 float32 gradient rows that was
// 0.19 ms on an H100 (ncu), for 100 MB read and 100 MB of read-modify-writes. Here a warp
// takes one row and adds it 16 bytes per atomic (sm_90's vector atomicAdd, compiled to one
// RED.ADD.F32x4 with its result unused), a quarter of the atomics and no index arithmetic.
#include <ATen/cuda/CUDAContext.h>

#include "fused_launchers.h"
#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

constexpr int kRowWarps = 8;  // rows (one per warp) per CTA

// dst[index[r]] += rows[r] for each row r; float4 columns (width4 per row), rows and dst
// rows 16-byte aligned. An index outside [0, dst_rows) adds nothing (embedding's forward
// has already refused such a token; nothing here may write outside dst).
__global__ void __launch_bounds__(32 * kRowWarps)
    AddRowsAtKernel(float* __restrict__ dst, const int64_t* __restrict__ index, const float* __restrict__ rows,
                    int64_t n_rows, int64_t dst_rows, int width4, int64_t dst_stride, int64_t row_stride) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32;
  if (r >= n_rows) return;
  const int64_t at = index[r];
  if (at < 0 || at >= dst_rows) return;
  const auto* src = reinterpret_cast<const float4*>(rows + r * row_stride);
  auto* out = reinterpret_cast<float4*>(dst + at * dst_stride);
  for (int c = threadIdx.x % 32; c < width4; c += 32) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(out + c, src[c]);
#else
    const float4 v = src[c];
    atomicAdd(&out[c].x, v.x);
    atomicAdd(&out[c].y, v.y);
    atomicAdd(&out[c].z, v.z);
    atomicAdd(&out[c].w, v.w);
#endif
  }
}

// Whether a float32 matrix's rows can be read as float4: unit column stride, a width and a
// row stride of whole float4s, 16-byte aligned.
bool RowsOfFloat4(const at::Tensor& t) {
  return t.dim() == 2 && t.stride(1) == 1 && t.size(1) % 4 == 0 && t.stride(0) % 4 == 0 && AlignedFor(t, 4);
}

}  // namespace

bool AddRowsAtTakes(const at::Tensor& dst, const at::Tensor& index, const at::Tensor& rows) {
  return dst.is_cuda() && dst.scalar_type() == at::kFloat && rows.scalar_type() == at::kFloat &&
         index.scalar_type() == at::kLong && rows.device() == dst.device() && index.device() == dst.device() &&
         index.dim() == 1 && index.is_contiguous() && rows.dim() == 2 && rows.size(0) == index.size(0) &&
         dst.dim() == 2 && rows.size(1) == dst.size(1) && RowsOfFloat4(dst) && RowsOfFloat4(rows) &&
         dst.size(1) / 4 <= INT32_MAX;
}

void AddRowsAt(at::Tensor& dst, const at::Tensor& index, const at::Tensor& rows) {
  TORCH_CHECK(AddRowsAtTakes(dst, index, rows),
              "AddRowsAt takes float32 CUDA matrices dst [V, D] and rows [N, D] with float4 rows (D a multiple of "
              "4, 16-byte aligned, unit column stride) and int64 index [N] on one device; got dst ",
              dst.scalar_type(), " ", dst.sizes(), ", rows ", rows.scalar_type(), " ", rows.sizes(), ", index ",
              index.scalar_type(), " ", index.sizes());
  const int64_t n = rows.size(0);
  if (n == 0 || dst.size(1) == 0) return;
  const dim3 grid(static_cast<unsigned>((n + kRowWarps - 1) / kRowWarps));
  LaunchKernel(AddRowsAtKernel, grid, 32 * kRowWarps, 0, dst.data_ptr<float>(), index.data_ptr<int64_t>(),
               rows.data_ptr<float>(), n, dst.size(0), static_cast<int>(dst.size(1) / 4), dst.stride(0),
               rows.stride(0));
}

}  // namespace nsad::nsa::cuda::detail
