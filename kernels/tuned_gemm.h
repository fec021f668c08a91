// Row-major products of 16-bit matrices on cuBLASLt with the algorithm timed fastest for each
// shape: the linear layers' GEMMs under GemmChoice::kTuned (kernel_choice.h).
//
// cuBLAS's heuristic picks one algorithm per shape from a model of the GPU; for the m7c step's
// products a later candidate of the same heuristic list runs up to 14% faster
// (bench/gemm_algos, docs/PERFORMANCE.md). Like PyTorch's TunableOp (whose CUDA build offers
// no cuBLASLt candidates in 2.11), the first call of a shape asks the heuristic for its
// candidates, times each on the call's own operands and keeps the fastest for the rest of the
// process. A first call inside a CUDA graph capture cannot time (no synchronisation there): it
// runs the heuristic's first pick and leaves the shape to be timed later.
//
// Different algorithms round differently (split-K, reduction order): the results match at::mm
// within the rounding of the output type, and a process that tuned differently (the timings
// are close) may differ in the last bits. A chosen algorithm is deterministic.
#pragma once

#include <ATen/ATen.h>

namespace nsad::nsa::cuda {

// Whether TunedMm takes a [M, K] @ b [K, N] with an out_dtype result: CUDA, both bf16 or both
// fp16, 2-D, each with a unit stride in one dimension and a leading dimension that is a
// multiple of 8 elements, at least 16-byte aligned; out_dtype a's dtype or float32.
bool TunedMmTakes(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype);

// a @ b as a contiguous [M, N] tensor of out_dtype (float32 accumulation).
at::Tensor TunedMm(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype);

// out += a @ b for out a contiguous [M, N] tensor of a's dtype (TunedMmTakes(a, b,
// a.scalar_type())).
void TunedMmAdd(at::Tensor& out, const at::Tensor& a, const at::Tensor& b);

namespace detail {
// Shapes timed so far in this process (tests: a capture leaves a shape untimed).
int64_t TunedGemmShapes();
}  // namespace detail

}  // namespace nsad::nsa::cuda
