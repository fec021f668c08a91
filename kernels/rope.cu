// Fused rotary position embedding: one kernel forward, one backward, instead of LibTorch's
// cast / narrow / 4 mul / sub / add / cat / cast chain (and its fp32 temporaries).
//
// It also splits: x [B,T,P,M,D] comes in as a strided view (the module passes its whole kv
// projection, 6 parts) and each part goes out contiguous, rotated or copied as the part's
// bit in rotate_mask says. The backward writes the gradient of all parts into one
// contiguous tensor, so autograd sees no select/narrow backward (zeros + copy per part)
// and no sum over the parts.
//
// Each thread rotates 8 pairs (x[j..j+7], x[j+D/2..j+D/2+7]) of one row with 16-byte
// accesses for 16-bit types (4 pairs where the layout is only 4-aligned, 1 where it is not
// even that), in float32 with the products
// rounded separately (__fmul_rn, no FMA contraction) so that the float32 result is the one
// the reference computes, then rounds once to the input type, as the reference does.
#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "fused_launchers.h"
#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

// Where the rows of x and the parts' outputs / gradients live.
template <typename T>
struct PartPtrs {
  T* p[kMaxRopeParts];
};
// Part `part`'s pointer, picked by compares. Indexed as p[part] with a run-time index, the
// array went to local memory: every thread stored all eight pointers (64 bytes of stack, ptxas
// -v) before its first load, as many bytes as the rows it moves. On an H100 (ncu, m7c batch 16)
// the forward of q took 54 us for its 100 MB (1.85 TB/s); picked by compares, 32.5 us.
template <typename T>
__device__ __forceinline__ T* PartPointer(const PartPtrs<T>& ptrs, uint32_t part) {
  T* picked = ptrs.p[0];
#pragma unroll
  for (uint32_t q = 1; q < kMaxRopeParts; ++q) picked = part == q ? ptrs.p[q] : picked;
  return picked;
}
struct RopeGeometry {
  int64_t stride_b, stride_t, stride_p, stride_m;  // strides of x (elements)
  int T, P, M, half;
  uint32_t rotate_mask;  // bit p: part p is rotated (else copied)
  // Bit p: part p lies in the chunk layout (PartChunks): [B, chunks, M, chunk_len, D] from its
  // pointer, positions from chunks * chunk_len on left out.
  uint32_t chunk_mask = 0;
  int chunk_len = 1, chunks = 0;
};

// Work item i = kVec consecutive pairs (j0 .. j0 + kVec - 1) of row (b, t, p, m), rows in
// that order. 32-bit index maths (the launcher checks the count fits): 64-bit division
// made the first version of these kernels instruction-bound at ~4x their memory time.
struct RowChunk {
  int b, t, p, m, j0;
  uint32_t row;
};
template <int kVec>
__device__ __forceinline__ RowChunk SplitChunk(uint32_t i, const RopeGeometry& g) {
  const uint32_t chunks = static_cast<uint32_t>(g.half / kVec);
  RowChunk c;
  c.row = i / chunks;
  c.j0 = static_cast<int>(i - c.row * chunks) * kVec;
  uint32_t r = c.row;
  c.m = static_cast<int>(r % g.M);
  r /= g.M;
  c.p = static_cast<int>(r % g.P);
  r /= g.P;
  c.t = static_cast<int>(r % g.T);
  c.b = static_cast<int>(r / g.T);
  return c;
}

// Where row r of part r.p starts in the part's own tensor: [B,T,M,D], or the chunk layout
// [B, chunks, M, chunk_len, D] (-1 for a position the chunks leave out).
__device__ __forceinline__ int64_t PartRowOffset(const RowChunk& r, const RopeGeometry& g) {
  const int D = 2 * g.half;
  if (!((g.chunk_mask >> r.p) & 1u)) return ((static_cast<int64_t>(r.b) * g.T + r.t) * g.M + r.m) * D;
  const int c = r.t / g.chunk_len, j = r.t - c * g.chunk_len;
  if (c >= g.chunks) return -1;
  return (((static_cast<int64_t>(r.b) * g.chunks + c) * g.M + r.m) * g.chunk_len + j) * D;
}

// kVec cos and sin values of position t from pair j0.
template <int kVec>
__device__ __forceinline__ void LoadAngles(const float* __restrict__ cos, const float* __restrict__ sin,
                                           int t, int j0, int half, float (&c)[kVec], float (&s)[kVec]) {
  const auto cv = *reinterpret_cast<const Packed<float, kVec>*>(cos + static_cast<int64_t>(t) * half + j0);
  const auto sv = *reinterpret_cast<const Packed<float, kVec>*>(sin + static_cast<int64_t>(t) * half + j0);
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    c[k] = cv.v[k];
    s[k] = sv.v[k];
  }
}

// One chunk of part r.p: src -> dst, rotated by position r.t's angle times `direction`
// when the part's bit is set, else copied. direction +1 is the forward (y1 = x1 c - x2 s,
// y2 = x1 s + x2 c); -1 the backward, whose gradient is the inverse rotation
// (dx1 = dy1 c + dy2 s, dx2 = dy2 c - dy1 s). Negating s is exact, so both round as the
// reference's products and sums do.
// src_t: the input's type; scalar_t: the output's (float32 gradients go out rounded).
template <typename src_t, typename scalar_t, int kVec>
__device__ __forceinline__ void RotateOrCopyChunk(const src_t* src, scalar_t* dst,
                                                  const float* __restrict__ cos,
                                                  const float* __restrict__ sin,
                                                  const RowChunk& r, const RopeGeometry& g,
                                                  float direction) {
  using SrcVec = Packed<src_t, kVec>;
  using Vec = Packed<scalar_t, kVec>;
  const SrcVec a = *reinterpret_cast<const SrcVec*>(src + r.j0);
  const SrcVec b = *reinterpret_cast<const SrcVec*>(src + r.j0 + g.half);
  if (!((g.rotate_mask >> r.p) & 1u)) {
    Vec ca, cb;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      ca.v[k] = static_cast<scalar_t>(a.v[k]);
      cb.v[k] = static_cast<scalar_t>(b.v[k]);
    }
    *reinterpret_cast<Vec*>(dst + r.j0) = ca;
    *reinterpret_cast<Vec*>(dst + r.j0 + g.half) = cb;
    return;
  }
  float c[kVec], s[kVec];
  LoadAngles<kVec>(cos, sin, r.t, r.j0, g.half, c, s);
  Vec y1, y2;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const float x1 = static_cast<float>(a.v[k]), x2 = static_cast<float>(b.v[k]);
    const float sk = direction * s[k];
    y1.v[k] = static_cast<scalar_t>(__fsub_rn(__fmul_rn(x1, c[k]), __fmul_rn(x2, sk)));
    y2.v[k] = static_cast<scalar_t>(__fadd_rn(__fmul_rn(x1, sk), __fmul_rn(x2, c[k])));
  }
  *reinterpret_cast<Vec*>(dst + r.j0) = y1;
  *reinterpret_cast<Vec*>(dst + r.j0 + g.half) = y2;
}

// x (strided) -> the parts' contiguous outputs.
template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads)
    RopeForwardKernel(const scalar_t* __restrict__ x, PartPtrs<scalar_t> out,
                      const float* __restrict__ cos, const float* __restrict__ sin,
                      RopeGeometry g, uint32_t items) {
  const uint32_t step = gridDim.x * kThreads;
  for (uint32_t i = blockIdx.x * kThreads + threadIdx.x; i < items; i += step) {
    const RowChunk r = SplitChunk<kVec>(i, g);
    const int64_t row = PartRowOffset(r, g);
    if (row < 0) continue;  // a position the chunks leave out
    const scalar_t* in = x + r.b * g.stride_b + r.t * g.stride_t + r.p * g.stride_p + r.m * g.stride_m;
    RotateOrCopyChunk<scalar_t, scalar_t, kVec>(in, PartPointer(out, r.p) + row, cos, sin, r, g, 1.f);
  }
}

// The parts' gradients -> dx [B,T,P,M,D] at g's strides. Each part's gradient is of type grad_t
// (dx's type, or float32 for all), or float32 where its bit in float_mask is set (a float32
// sum handed past autograd, rounded here once; the mask is 0 where grad_t is float).
template <typename grad_t, typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads)
    RopeBackwardKernel(PartPtrs<const void> grads, uint32_t float_mask, scalar_t* __restrict__ dx,
                       const float* __restrict__ cos, const float* __restrict__ sin,
                       RopeGeometry g, uint32_t items) {
  const uint32_t step = gridDim.x * kThreads;
  for (uint32_t i = blockIdx.x * kThreads + threadIdx.x; i < items; i += step) {
    const RowChunk r = SplitChunk<kVec>(i, g);
    const int64_t row = PartRowOffset(r, g);
    scalar_t* out = dx + r.b * g.stride_b + r.t * g.stride_t + r.p * g.stride_p + r.m * g.stride_m;
    if (row < 0) {  // a position the chunks leave out: nothing depended on it
      using Vec = Packed<scalar_t, kVec>;
      Vec zero;
#pragma unroll
      for (int k = 0; k < kVec; ++k) zero.v[k] = static_cast<scalar_t>(0.f);
      *reinterpret_cast<Vec*>(out + r.j0) = zero;
      *reinterpret_cast<Vec*>(out + r.j0 + g.half) = zero;
      continue;
    }
    const void* part = PartPointer(grads, r.p);
    if (!std::is_same_v<grad_t, float> && ((float_mask >> r.p) & 1u)) {
      RotateOrCopyChunk<float, scalar_t, kVec>(static_cast<const float*>(part) + row, out, cos, sin, r, g, -1.f);
    } else {
      RotateOrCopyChunk<grad_t, scalar_t, kVec>(static_cast<const grad_t*>(part) + row, out, cos, sin, r, g, -1.f);
    }
  }
}

// Pairs per work item: the widest of 8, 4 and 1 at which every row's halves start aligned
// (strides, D/2 and the pointers). 8 pairs of bf16 are 16-byte accesses: at 4 (8 bytes) the
// kernels moved 1.3 TB/s on an H100 (0.076 ms for q at batch 16, T=2048, D=64, 12 heads).
template <typename scalar_t>
bool RowsTakeVectors(const RopeGeometry& g, const std::vector<const scalar_t*>& ptrs, int vec) {
  bool ok = g.half % vec == 0 && g.stride_b % vec == 0 && g.stride_t % vec == 0 && g.stride_p % vec == 0 &&
            g.stride_m % vec == 0;
  for (const auto* p : ptrs) ok = ok && AlignedFor(p, vec);
  return ok;
}
// Calls launch(std::integral_constant<int, vec>) for the widest vector the rows take.
template <typename scalar_t, typename F>
void DispatchRopeVec(const RopeGeometry& g, const std::vector<const scalar_t*>& ptrs, F&& launch) {
  if (RowsTakeVectors(g, ptrs, 8)) {
    launch(std::integral_constant<int, 8>{});
  } else if (RowsTakeVectors(g, ptrs, 4)) {
    launch(std::integral_constant<int, 4>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

void CheckTable(const at::Tensor& cos, const at::Tensor& sin, int64_t T, int64_t half,
                const at::Device& device) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope tables must be float32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "rope tables must be contiguous");
  TORCH_CHECK(cos.device() == device && sin.device() == device,
              "rope tables must be on the device of x");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == half &&
                  sin.sizes() == cos.sizes(),
              "rope table ", cos.sizes(), " does not fit ", T, " positions and D/2 = ", half);
}

// The chunk layout's parts, checked against x's P parts and T positions, as kernel bits.
uint32_t ChunkMask(const PartChunks& chunks, int64_t P, int64_t T) {
  if (!chunks.Any()) return 0;
  TORCH_CHECK(chunks.Fits(P, T) && chunks.len <= INT32_MAX, "RoPE chunk layout: parts [", chunks.first, ", ",
              chunks.first + chunks.count, ") in ", chunks.chunks, " chunks of ", chunks.len,
              " positions do not fit ", P, " parts of ", T, " positions");
  return ((1u << chunks.count) - 1u) << chunks.first;
}

void SetChunks(RopeGeometry& g, const PartChunks& chunks) {
  g.chunk_mask = ChunkMask(chunks, g.P, g.T);
  if (g.chunk_mask) {
    g.chunk_len = static_cast<int>(chunks.len);
    g.chunks = static_cast<int>(chunks.chunks);
  }
}

}  // namespace

std::vector<at::Tensor> RopeForward(const at::Tensor& x, const at::Tensor& cos,
                                    const at::Tensor& sin, uint32_t rotate_mask, const PartChunks& chunks) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
  TORCH_CHECK(x.dim() == 5, "x must be [B,T,P,M,D], got ", x.sizes());
  TORCH_CHECK(x.stride(4) == 1, "x must have unit stride in its last dim");
  const int64_t B = x.size(0), T = x.size(1), P = x.size(2), M = x.size(3), D = x.size(4);
  TORCH_CHECK(D % 2 == 0, "RoPE needs an even head dim, got ", D);
  TORCH_CHECK(P >= 1 && P <= kMaxRopeParts, "RoPE takes 1..", kMaxRopeParts, " parts, got ", P);
  CheckTable(cos, sin, T, D / 2, x.device());
  ChunkMask(chunks, P, T);
  at::Tensor stack;
  if (chunks.Any()) stack = at::empty({chunks.count, B, chunks.chunks, M, chunks.len, D}, x.options());
  std::vector<at::Tensor> outs;
  for (int64_t p = 0; p < P; ++p) {
    outs.push_back(chunks.Holds(p) ? stack[p - chunks.first] : at::empty({B, T, M, D}, x.options()));
  }
  if (chunks.Any()) outs.push_back(stack);
  const int64_t pairs = B * T * P * M * (D / 2);
  if (pairs == 0) return outs;
  TORCH_CHECK(pairs <= INT32_MAX, "RoPE: too many elements in one call (", 2 * pairs, ")");
  RopeGeometry g{x.stride(0),         x.stride(1),         x.stride(2),
                 x.stride(3),         static_cast<int>(T), static_cast<int>(P),
                 static_cast<int>(M), static_cast<int>(D / 2), rotate_mask};
  SetChunks(g, chunks);
  NSA_DISPATCH_TYPES(x.scalar_type(), "nsa_rope_forward", [&] {
    PartPtrs<scalar_t> ptrs{};
    std::vector<const scalar_t*> all = {x.data_ptr<scalar_t>()};
    for (int64_t p = 0; p < P; ++p) all.push_back(ptrs.p[p] = outs[p].data_ptr<scalar_t>());
    DispatchRopeVec(g, all, [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      const auto items = static_cast<uint32_t>(pairs / kVec);
      Launch(RopeForwardKernel<scalar_t, kVec>, GridStride(items), 0, x.data_ptr<scalar_t>(), ptrs,
             cos.data_ptr<float>(), sin.data_ptr<float>(), g, items);
    });
  });
  return outs;
}

at::Tensor RopeBackward(const std::vector<at::Tensor>& grads_in, const at::Tensor& cos,
                        const at::Tensor& sin, uint32_t rotate_mask, std::optional<at::ScalarType> dx_type,
                        const at::Tensor& dx_out, const PartChunks& chunks) {
  const int64_t P = static_cast<int64_t>(grads_in.size());
  TORCH_CHECK(P >= 1 && P <= kMaxRopeParts, "RoPE takes 1..", kMaxRopeParts, " parts, got ", P);
  TORCH_CHECK(!chunks.Any() || chunks.count < P, "RoPE backward: at least one part must be [B,T,M,D]");
  // The shape [B,T,M,D] from a part outside the chunk layout; chunked parts are checked
  // against it below.
  const int64_t plain = chunks.Holds(0) ? chunks.first + chunks.count : 0;
  const auto& ref = grads_in[plain];
  TORCH_CHECK(ref.is_cuda() && ref.dim() == 4, "rope gradients must be CUDA [B,T,M,D], got ", ref.sizes());
  const int64_t B = ref.size(0), T = ref.size(1), M = ref.size(2), D = ref.size(3);
  const auto out_type = dx_type.value_or(ref.scalar_type());
  std::vector<at::Tensor> grads;
  uint32_t float_mask = 0;  // parts whose float32 gradient gives a dx of another dtype
  for (int64_t p = 0; p < P; ++p) {
    const auto& g = grads_in[p];
    const bool chunked = chunks.Holds(p);
    const auto want = chunked ? std::vector<int64_t>{B, chunks.chunks, M, chunks.len, D} : ref.sizes().vec();
    TORCH_CHECK(g.is_cuda() && g.device() == ref.device() && g.sizes() == at::IntArrayRef(want),
                "rope gradients must be CUDA tensors on one device, [B,T,M,D] (or [B,chunks,M,len,D] in the chunk "
                "layout); part ", p, " is ", g.sizes(), ", want ", at::IntArrayRef(want));
    TORCH_CHECK(g.scalar_type() == out_type || g.scalar_type() == at::kFloat, "rope backward: part ", p,
                "'s gradient is ", g.scalar_type(), "; a dx of ", out_type, " takes gradients of ", out_type,
                " or float32");
    if (g.scalar_type() != out_type) float_mask |= 1u << p;
    grads.push_back(g.contiguous());
  }
  TORCH_CHECK(D % 2 == 0, "RoPE needs an even head dim, got ", D);
  CheckTable(cos, sin, T, D / 2, ref.device());
  // All parts float32 (a float32 sum rounded on the way): the kernel's grad_t is float.
  const bool all_float = float_mask == (1u << P) - 1u;
  auto dx = dx_out.defined() ? dx_out : at::empty({B, T, P, M, D}, ref.options().dtype(out_type));
  TORCH_CHECK(dx.is_cuda() && dx.device() == ref.device() && dx.scalar_type() == out_type &&
                  dx.sizes() == at::IntArrayRef({B, T, P, M, D}) && dx.stride(4) == 1,
              "rope backward: dx_out must be a ", out_type, " CUDA tensor [", B, ",", T, ",", P, ",", M, ",", D,
              "] with unit stride in D, got ", dx.scalar_type(), " ", dx.sizes(), " strides ", dx.strides());
  const int64_t pairs = B * T * P * M * (D / 2);
  if (pairs == 0) return dx;
  TORCH_CHECK(pairs <= INT32_MAX, "RoPE: too many elements in one call (", 2 * pairs, ")");
  RopeGeometry g{dx.stride(0),        dx.stride(1),        dx.stride(2),
                 dx.stride(3),        static_cast<int>(T), static_cast<int>(P),
                 static_cast<int>(M), static_cast<int>(D / 2), rotate_mask};
  SetChunks(g, chunks);
  NSA_DISPATCH_TYPES(dx.scalar_type(), "nsa_rope_backward", [&] {
    PartPtrs<const void> ptrs{};
    // Every part's alignment in its own type's units; dx's.
    bool grads_aligned_8 = true, grads_aligned_4 = true;
    for (int64_t p = 0; p < P; ++p) {
      ptrs.p[p] = grads[p].data_ptr();
      grads_aligned_8 = grads_aligned_8 && AlignedFor(grads[p], 8);
      grads_aligned_4 = grads_aligned_4 && AlignedFor(grads[p], 4);
    }
    const std::vector<const scalar_t*> all = {dx.data_ptr<scalar_t>()};
    const auto launch = [&](auto grad_type) {
      using grad_t = decltype(grad_type);
      const uint32_t mask = std::is_same_v<grad_t, float> ? 0u : float_mask;
      const auto run = [&](auto vec) {
        constexpr int kVec = decltype(vec)::value;
        const auto items = static_cast<uint32_t>(pairs / kVec);
        Launch(RopeBackwardKernel<grad_t, scalar_t, kVec>, GridStride(items), 0, ptrs, mask, dx.data_ptr<scalar_t>(),
               cos.data_ptr<float>(), sin.data_ptr<float>(), g, items);
      };
      if (RowsTakeVectors(g, all, 8) && grads_aligned_8) {
        run(std::integral_constant<int, 8>{});
      } else if (RowsTakeVectors(g, all, 4) && grads_aligned_4) {
        run(std::integral_constant<int, 4>{});
      } else {
        run(std::integral_constant<int, 1>{});
      }
    };
    if (all_float) {
      launch(float{});
    } else {
      launch(scalar_t{});
    }
  });
  return dx;
}

namespace {
// The largest local-memory (stack) size of the kernels that move rows of type scalar_t.
template <typename scalar_t>
int64_t RopeLocalBytesOf() {
  int64_t most = 0;
  const auto note = [&](const void* kernel) {
    cudaFuncAttributes attributes{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    most = std::max<int64_t>(most, static_cast<int64_t>(attributes.localSizeBytes));
  };
  const auto note_vec = [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    note(reinterpret_cast<const void*>(&RopeForwardKernel<scalar_t, kVec>));
    note(reinterpret_cast<const void*>(&RopeBackwardKernel<scalar_t, scalar_t, kVec>));
    if constexpr (!std::is_same_v<scalar_t, float>) {
      note(reinterpret_cast<const void*>(&RopeBackwardKernel<float, scalar_t, kVec>));
    }
  };
  note_vec(std::integral_constant<int, 1>{});
  note_vec(std::integral_constant<int, 4>{});
  note_vec(std::integral_constant<int, 8>{});
  return most;
}
}  // namespace

int64_t RopeKernelsLocalBytes() {
  return std::max({RopeLocalBytesOf<float>(), RopeLocalBytesOf<at::Half>(), RopeLocalBytesOf<at::BFloat16>()});
}

}  // namespace nsad::nsa::cuda::detail
