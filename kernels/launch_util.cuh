// Small host-side helpers shared by the .cu launchers: input checks, head-dim dispatch and
// kernel launch with a dynamic shared-memory opt-in.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "attention_tile.cuh"
#include "launchers.h"

// The input types the kernels are instantiated for (arithmetic is float32 for all of them).
#define NSA_DISPATCH_TYPES(TYPE, NAME, ...)                        \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)          \
                             AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace nsad::nsa::cuda::detail {

// N consecutive elements moved as one load/store (N * sizeof(T) bytes, aligned to that):
// memory-bound kernels use it for 8- or 16-byte accesses.
template <typename T, int N>
struct alignas(sizeof(T) * N) Packed {
  T v[N];
};

// CTAs for a grid-stride loop over `items` work items of one thread each: a few waves are
// enough for a memory-bound kernel.
inline dim3 GridStride(int64_t items) {
  const int64_t ctas = std::min<int64_t>((items + kThreads - 1) / kThreads, int64_t{1} << 16);
  return dim3(static_cast<unsigned>(std::max<int64_t>(ctas, 1)));
}

// Whether p (or t's data) is aligned for Packed<T, N> accesses.
template <typename T>
bool AlignedFor(const T* p, int n) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * n) == 0;
}
inline bool AlignedFor(const at::Tensor& t, int n) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % (t.element_size() * n) == 0;
}

inline void CheckInput(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == dims, name, " must have ", dims, " dims, got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Calls f(std::integral_constant<int, D>) for the head dims the kernels are built for.
template <typename F>
void DispatchHeadDim(int64_t D, F&& f) {
  constexpr int kSmall = kernel_limits::kHeadDimSmall, kLarge = kernel_limits::kHeadDimLarge;
  if (D == kSmall) {
    f(std::integral_constant<int, kSmall>{});
  } else if (D == kLarge) {
    f(std::integral_constant<int, kLarge>{});
  } else {
    TORCH_CHECK(false, "NSA CUDA kernels support head_dim ", kSmall, " and ", kLarge, ", got ", D);
  }
}

// Launches kernel<<<grid, threads, smem_bytes>>> on the current stream (nothing for an
// empty grid), raising the dynamic shared-memory limit first when the kernel needs more than
// the default 48 KB.
template <typename Kernel, typename... Args>
void LaunchKernel(Kernel kernel, dim3 grid, int threads, size_t smem_bytes, Args... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  if (smem_bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem_bytes)));
  }
  kernel<<<grid, threads, smem_bytes, at::cuda::getCurrentCUDAStream()>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// LaunchKernel with the scalar kernels' kThreads.
template <typename Kernel, typename... Args>
void Launch(Kernel kernel, dim3 grid, size_t smem_bytes, Args... args) {
  LaunchKernel(kernel, grid, kThreads, smem_bytes, args...);
}

inline Shape MakeShape(const at::Tensor& q, const at::Tensor& k) {
  Shape s{};
  s.B = static_cast<int>(q.size(0));
  s.T = static_cast<int>(q.size(1));
  s.H = static_cast<int>(q.size(2));
  s.D = static_cast<int>(q.size(3));
  s.Tk = static_cast<int>(k.size(1));
  s.G = static_cast<int>(k.size(2));
  TORCH_CHECK(s.G > 0 && s.H % s.G == 0, "query heads (", s.H, ") must be a multiple of kv groups (",
              s.G, ")");
  TORCH_CHECK(s.H / s.G <= kMaxHeadsPerGroup, "NSA CUDA kernels support at most ",
              kMaxHeadsPerGroup, " query heads per group, got ", s.H / s.G);
  TORCH_CHECK(k.size(0) == s.B && k.size(3) == s.D, "k must be [B,*,G,D] matching q, got ",
              k.sizes(), " for q ", q.sizes());
  return s;
}

inline void CheckKv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have one shape, got ", k.sizes(), " and ",
              v.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "q, k and v must have one dtype");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf ||
                  q.scalar_type() == at::kFloat,
              "NSA CUDA kernels take bf16, fp16 or fp32, got ", q.scalar_type());
}

// Column sums of per-CTA partials [parts, width] (float32) in a fixed order, so that they come
// out the same every run (float atomics would not): a CTA takes 32 columns, its warps every
// kSumPartsWarps-th part, then one sum across the warps. Column x goes to the output whose
// range [end of the one before, end) holds it: up to kMaxPartOutputs tensors (a weight's and a
// bias's gradient, say) filled by one launch.
constexpr int kSumPartsWarps = 8;
constexpr int kMaxPartOutputs = 3;
struct PartOutputs {
  float* out[kMaxPartOutputs];
  int64_t end[kMaxPartOutputs];
  int count;
};
template <int kWarps = kSumPartsWarps>
__global__ void __launch_bounds__(kWarps * 32)
    SumPartsKernel(const float* __restrict__ partial, int parts, int64_t width, PartOutputs outs) {
  __shared__ float sums[kWarps][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t x = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  float v = 0.f;
  if (x < width) {
    for (int p = warp; p < parts; p += kWarps) v += partial[p * width + x];
  }
  sums[warp][lane] = v;
  __syncthreads();
  if (warp == 0 && x < width) {
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) total += sums[k][lane];
    int64_t begin = 0;
    for (int o = 0; o < outs.count; ++o) {
      if (x < outs.end[o]) {
        outs.out[o][x - begin] = total;
        break;
      }
      begin = outs.end[o];
    }
  }
}

// outs, in order, take the column sums of partial [parts, width] (float32, contiguous): their
// sizes add up to width; each is float32 and contiguous.
inline void SumParts(const at::Tensor& partial, std::initializer_list<at::Tensor> outs) {
  TORCH_CHECK(partial.dim() == 2 && partial.scalar_type() == at::kFloat && partial.is_contiguous(),
              "SumParts takes float32 partials [parts, width]");
  TORCH_CHECK(outs.size() >= 1 && outs.size() <= kMaxPartOutputs, "SumParts fills 1 to ", kMaxPartOutputs,
              " outputs");
  PartOutputs po{};
  int64_t end = 0;
  for (const auto& out : outs) {
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.device() == partial.device(),
                "SumParts writes float32 contiguous outputs on the partials' device");
    end += out.numel();
    po.out[po.count] = out.data_ptr<float>();
    po.end[po.count++] = end;
  }
  const int64_t width = partial.size(1);
  TORCH_CHECK(end == width, "SumParts: the outputs hold ", end, " columns, the partials ", width);
  TORCH_CHECK(partial.size(0) < (int64_t{1} << 31), "SumParts: too many parts");
  LaunchKernel(SumPartsKernel<>, dim3(static_cast<unsigned>((width + 31) / 32)), kSumPartsWarps * 32, 0,
               static_cast<const float*>(partial.data_ptr<float>()), static_cast<int>(partial.size(0)), width, po);
}

// delta = rowsum(a * b) over the last dim with 16-byte loads: kLanes lanes per row (one
// 16-byte piece each), 32 / kLanes rows per warp. RowDotKernel's one-element loads reached
// about half of DRAM bandwidth (0.131 ms at 64k, D=64, 12 heads: 200 MB read).
template <typename scalar_t, int kLanes>
__global__ void __launch_bounds__(kThreads)
    RowDotPiecesKernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b, float* __restrict__ out,
                       int64_t rows) {
  constexpr int kVec = 16 / sizeof(scalar_t), D = kLanes * kVec;
  const int64_t lane_id = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t row = lane_id / kLanes;
  const int piece = static_cast<int>(lane_id % kLanes);
  float acc = 0.f;
  if (row < rows) {
    const auto x = *reinterpret_cast<const Packed<scalar_t, kVec>*>(a + row * D + piece * kVec);
    const auto y = *reinterpret_cast<const Packed<scalar_t, kVec>*>(b + row * D + piece * kVec);
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc += static_cast<float>(x.v[i]) * static_cast<float>(y.v[i]);
  }
  // Every lane takes part in the shuffles, rows past the end with zero.
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if (row < rows && piece == 0) out[row] = acc;
}

// Calls f(std::integral_constant<int, lanes>) when a row of D elements is 4, 8, 16 or 32
// 16-byte pieces; false (f not called) otherwise.
template <typename scalar_t, typename F>
bool DispatchRowPieces(int64_t D, F&& f) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  if (D % kVec != 0) return false;
  switch (D / kVec) {
    case 4: f(std::integral_constant<int, 4>{}); return true;
    case 8: f(std::integral_constant<int, 8>{}); return true;
    case 16: f(std::integral_constant<int, 16>{}); return true;
    case 32: f(std::integral_constant<int, 32>{}); return true;
    default: return false;
  }
}

// The backward's delta = rowsum(dO * O) over head_dim, [B,T,H] float32.
inline at::Tensor RowDot(const at::Tensor& dout, const at::Tensor& out) {
  auto delta = at::empty({out.size(0), out.size(1), out.size(2)},
                         out.options().dtype(at::kFloat));
  const int64_t rows = delta.numel();
  if (rows == 0) return delta;
  const int64_t D = out.size(3);
  NSA_DISPATCH_TYPES(out.scalar_type(), "nsa_row_dot", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    const bool pieces = AlignedFor(dout, kVec) && AlignedFor(out, kVec) &&
                        DispatchRowPieces<scalar_t>(D, [&](auto lanes) {
                          constexpr int kLanes = decltype(lanes)::value;
                          const dim3 grid(static_cast<unsigned>((rows * kLanes + kThreads - 1) / kThreads));
                          Launch(RowDotPiecesKernel<scalar_t, kLanes>, grid, 0, dout.data_ptr<scalar_t>(),
                                 out.data_ptr<scalar_t>(), delta.data_ptr<float>(), rows);
                        });
    if (!pieces) {
      const dim3 grid(static_cast<unsigned>((rows * 32 + kThreads - 1) / kThreads));
      Launch(RowDotKernel<scalar_t>, grid, 0, dout.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
             delta.data_ptr<float>(), rows, static_cast<int>(D));
    }
  });
  return delta;
}

// The backward's delta for dout and out: `given` where the caller already has it (a
// contiguous float32 [B,T,H]: the gate mixing's backward computes it for each branch, see
// GateMixBackward), else RowDot.
inline at::Tensor DeltaOrRowDot(const at::Tensor& given, const at::Tensor& dout, const at::Tensor& out) {
  if (!given.defined()) return RowDot(dout, out);
  TORCH_CHECK(given.scalar_type() == at::kFloat && given.is_contiguous() && given.dim() == 3 &&
                  given.size(0) == out.size(0) && given.size(1) == out.size(1) && given.size(2) == out.size(2) &&
                  given.device() == out.device(),
              "delta must be a contiguous float32 [B,T,H] tensor on the output's device, got ", given.sizes());
  return given;
}

// Whether slot `slot` of a position's block list ([n] int32) repeats a block an earlier slot
// listed. The selection is a set, as in the reference: every kernel counts a block once, the
// query-side ones by skipping a repeat (the selection kernel never repeats a block; tests
// do), the key-centric ones through the inverted map, whose segment keys drop them
// (block_map.cu).
__device__ __forceinline__ bool RepeatsEarlierSlot(const int* list, int slot) {
  const int blk = list[slot];
  bool repeat = false;
  for (int j = 0; j < slot; ++j) repeat |= list[j] == blk;
  return repeat;
}

// The compressed branch's packed query row (compressed_packed.cu, the cuDNN path's layout
// [B, N, H*stride, D]; CmpPackedRows) of position t, head h in batch b: row a = (t - first) /
// stride holds positions first + a*stride .. + stride-1 side by side as extra heads. -1 for a
// position before first, which sees no compressed block and has no row.
__device__ __forceinline__ int64_t PackedCmpRow(int b, int t, int h, int N, int H, int first, int stride) {
  if (t < first) return -1;
  const int a = (t - first) / stride, r = t - first - a * stride;
  return ((static_cast<int64_t>(b) * N + a) * H + h) * stride + r;
}

// Whether block `blk` is one of position t's local blocks: block 0, the block holding t and
// the one before it. The selection always takes them (select_blocks.cu), and every position
// of a block shares them, so the key-centric forward can hand them to a tiled pass over
// neighbouring positions (SelectedKernelChoice::Local). An unused slot (-1) is not local.
__device__ __forceinline__ bool IsLocalBlock(int blk, int t, int slc_block) {
  const int own = t / slc_block;
  return blk >= 0 && (blk == 0 || blk == own || blk == own - 1);
}

// A float32 tensor of zeros written by cudaMemsetAsync: at::zeros runs a fill kernel, which
// wrote the backward's 200 MB dQ accumulator (64k, D=64, 12 heads) at about 1.2 TB/s.
inline at::Tensor ZeroFloats(at::IntArrayRef sizes, const at::TensorOptions& options) {
  auto t = at::empty(sizes, options.dtype(at::kFloat));
  if (t.numel() > 0) {
    C10_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.numel() * sizeof(float), at::cuda::getCurrentCUDAStream()));
  }
  return t;
}

}  // namespace nsad::nsa::cuda::detail
