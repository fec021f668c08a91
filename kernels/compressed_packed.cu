// Compressed attention as dense causal attention over packed query rows: the layout moves
// behind the cuDNN path of the compressed branch (nsa_cuda.cc, CompressedDenseFn).
//
// Query t sees compressed block j iff j*d + l - 1 <= t. Take the positions in rows of d,
// row a = positions l-1 + a*d .. l-1 + a*d + d-1: every position of row a sees exactly the
// blocks 0..a. So with the d positions of a row laid side by side as extra heads, the branch
// is plain causal attention of N rows over N keys (N = the number of compressed blocks, which
// is also the number of rows needed to cover positions l-1..T-1). The head order is
// (head, offset in row), head' = h*d + r, so a GQA group's heads stay contiguous and the
// attention library maps head' to its key head as usual, without repeating K/V.
//
// Positions before l-1 see no block (output 0, log-sum-exp +inf, as the custom kernels
// write); the last row's slots past T are zero queries whose outputs are dropped and whose
// incoming gradient is zero, so they change no key gradient.
#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

using Vec = Packed<uint4, 1>;  // 16 bytes

// One 16-byte piece per thread. to_packed: dst is [B,N,H*d,row] and src [B,T,H,row], else
// the other way round; rows are `vecs` pieces long. A destination row with no source row
// (a slot past T, or a position before l-1) becomes zero.
__global__ void MoveRowsKernel(const Vec* __restrict__ src, Vec* __restrict__ dst, int B, int T, int H,
                               int N, int first, int stride, int vecs, bool to_packed) {
  const int64_t rows_per_batch = to_packed ? static_cast<int64_t>(N) * H * stride : static_cast<int64_t>(T) * H;
  const int64_t total = B * rows_per_batch * vecs;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / vecs;
    const int piece = static_cast<int>(i % vecs);
    const int b = static_cast<int>(row / rows_per_batch);
    const int64_t in_batch = row % rows_per_batch;
    int64_t src_row = -1;
    if (to_packed) {
      const int a = static_cast<int>(in_batch / (static_cast<int64_t>(H) * stride));
      const int head = static_cast<int>(in_batch % (static_cast<int64_t>(H) * stride));
      const int h = head / stride, r = head % stride;
      const int t = first + a * stride + r;
      if (t < T) src_row = (static_cast<int64_t>(b) * T + t) * H + h;
    } else {
      const int t = static_cast<int>(in_batch / H), h = static_cast<int>(in_batch % H);
      src_row = PackedCmpRow(b, t, h, N, H, first, stride);
    }
    Vec value;
    value.v[0] = make_uint4(0, 0, 0, 0);
    if (src_row >= 0) value = src[src_row * vecs + piece];
    dst[i] = value;
  }
}

// UnpackCompressedRows into float32 [B,T,H,D] (every element written; zero before first): one
// 16-byte piece (8 elements) of a packed row in, two float4s out, per thread.
template <typename scalar_t>
__global__ void UnpackToFloatKernel(const Vec* __restrict__ src, float4* __restrict__ dst, int B, int T, int H,
                                    int N, int first, int stride, int vecs) {
  constexpr int kPer = sizeof(Vec) / sizeof(scalar_t);
  static_assert(kPer == 8, "8 16-bit elements a piece");
  const int64_t total = static_cast<int64_t>(B) * T * H * vecs;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / vecs;
    const int piece = static_cast<int>(i % vecs);
    const int h = static_cast<int>(row % H);
    const int t = static_cast<int>((row / H) % T);
    const int b = static_cast<int>(row / (static_cast<int64_t>(H) * T));
    float f[kPer] = {};
    if (const int64_t src_row = PackedCmpRow(b, t, h, N, H, first, stride); src_row >= 0) {
      const Packed<scalar_t, kPer> x = *reinterpret_cast<const Packed<scalar_t, kPer>*>(src + src_row * vecs + piece);
#pragma unroll
      for (int k = 0; k < kPer; ++k) f[k] = static_cast<float>(x.v[k]);
    }
    dst[2 * i] = make_float4(f[0], f[1], f[2], f[3]);
    dst[2 * i + 1] = make_float4(f[4], f[5], f[6], f[7]);
  }
}

// lse [B, H*d, N] (natural log) -> [B,T,H] in log2 units, +inf where a position sees no block.
__global__ void LseFromPackedKernel(const float* __restrict__ packed, float* __restrict__ lse, int B, int T,
                                    int H, int N, int first, int stride) {
  const int64_t total = static_cast<int64_t>(B) * T * H;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int h = static_cast<int>(i % H);
    const int t = static_cast<int>((i / H) % T);
    const int b = static_cast<int>(i / (static_cast<int64_t>(H) * T));
    float value = __int_as_float(0x7f800000);  // +inf
    if (t >= first) {
      const int a = (t - first) / stride, r = (t - first) % stride;
      value = packed[(static_cast<int64_t>(b) * H * stride + h * stride + r) * N + a] * kLog2e;
    }
    lse[i] = value;
  }
}

void CheckRows(const at::Tensor& x, const char* name) {
  CheckInput(x, name, 4);
  TORCH_CHECK((x.size(3) * x.element_size()) % sizeof(Vec) == 0 && AlignedFor(x, sizeof(Vec) / x.element_size()),
              name, ": rows must be whole, aligned 16-byte pieces (head_dim ", x.size(3), ")");
}

void MoveRows(const at::Tensor& src, at::Tensor& dst, int64_t T, int64_t H, int64_t N, const Geo& g,
              bool to_packed) {
  const int vecs = static_cast<int>(src.size(3) * src.element_size() / sizeof(Vec));
  if (dst.numel() == 0) return;
  MoveRowsKernel<<<GridStride(dst.numel() / src.size(3) * vecs), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const Vec*>(src.data_ptr()), reinterpret_cast<Vec*>(dst.data_ptr()),
      static_cast<int>(src.size(0)), static_cast<int>(T), static_cast<int>(H), static_cast<int>(N),
      g.cmp_block - 1, g.cmp_stride, vecs, to_packed);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor PackCompressedRows(const at::Tensor& x, const Geo& g) {
  CheckRows(x, "x");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), N = NumCmpBlocks(T, g);
  auto packed = at::empty({B, N, H * g.cmp_stride, x.size(3)}, x.options());
  MoveRows(x, packed, T, H, N, g, /*to_packed=*/true);
  return packed;
}

at::Tensor UnpackCompressedRows(const at::Tensor& packed, int64_t T, const Geo& g) {
  CheckRows(packed, "packed");
  const int64_t B = packed.size(0), N = packed.size(1), H = packed.size(2) / g.cmp_stride;
  TORCH_CHECK(N == NumCmpBlocks(T, g) && H * g.cmp_stride == packed.size(2), "packed rows ", packed.sizes(),
              " do not match ", T, " tokens");
  auto x = at::empty({B, T, H, packed.size(3)}, packed.options());
  MoveRows(packed, x, T, H, N, g, /*to_packed=*/false);
  return x;
}

void UnpackCompressedRowsToFloat(const at::Tensor& packed, at::Tensor& out, const Geo& g) {
  CheckRows(packed, "packed");
  TORCH_CHECK(packed.element_size() == 2, "packed rows to float32: bf16 or fp16 rows, got ", packed.scalar_type());
  TORCH_CHECK(out.is_cuda() && out.is_contiguous() && out.scalar_type() == at::kFloat && out.dim() == 4,
              "out must be a contiguous float32 [B,T,H,D] CUDA tensor");
  const int64_t B = packed.size(0), N = packed.size(1), T = out.size(1), H = out.size(2);
  TORCH_CHECK(out.size(0) == B && out.size(3) == packed.size(3) && H * g.cmp_stride == packed.size(2) &&
                  N == NumCmpBlocks(T, g),
              "packed rows ", packed.sizes(), " do not match out ", out.sizes());
  TORCH_CHECK(AlignedFor(out, 4), "out must be 16-byte aligned");
  if (out.numel() == 0) return;
  const int vecs = static_cast<int>(packed.size(3) * packed.element_size() / sizeof(Vec));
  AT_DISPATCH_REDUCED_FLOATING_TYPES(packed.scalar_type(), "nsa_unpack_rows_float", [&] {
    UnpackToFloatKernel<scalar_t><<<GridStride(out.numel() / packed.size(3) * vecs), kThreads, 0,
                                    at::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const Vec*>(packed.data_ptr()), reinterpret_cast<float4*>(out.data_ptr()),
        static_cast<int>(B), static_cast<int>(T), static_cast<int>(H), static_cast<int>(N), g.cmp_block - 1,
        g.cmp_stride, vecs);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor CompressedLseFromPacked(const at::Tensor& lse_packed, int64_t T, const Geo& g) {
  TORCH_CHECK(lse_packed.is_cuda() && lse_packed.scalar_type() == at::kFloat && lse_packed.dim() >= 3,
              "lse_packed must be a float32 CUDA tensor [B, H*d, N(, 1)]");
  const auto packed = lse_packed.reshape({lse_packed.size(0), lse_packed.size(1), lse_packed.size(2)}).contiguous();
  const int64_t B = packed.size(0), H = packed.size(1) / g.cmp_stride, N = packed.size(2);
  TORCH_CHECK(N == NumCmpBlocks(T, g) && H * g.cmp_stride == packed.size(1), "lse_packed ", lse_packed.sizes(),
              " does not match ", T, " tokens");
  auto lse = at::empty({B, T, H}, packed.options());
  if (lse.numel() == 0) return lse;
  LseFromPackedKernel<<<GridStride(lse.numel()), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      packed.data_ptr<float>(), lse.data_ptr<float>(), static_cast<int>(B), static_cast<int>(T),
      static_cast<int>(H), static_cast<int>(N), g.cmp_block - 1, g.cmp_stride);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return lse;
}

}  // namespace nsad::nsa::cuda::detail
