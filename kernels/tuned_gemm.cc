#include "tuned_gemm.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kernel_choice.h"

namespace nsad::nsa::cuda {
namespace detail {
namespace {
std::atomic<GemmChoice::Algo> gemm_algo{GemmChoice::Algo::kAuto};
}  // namespace

void SetGemmChoiceForTesting(const GemmChoice& choice) { gemm_algo = choice.algo; }
GemmChoice GetGemmChoice() { return {gemm_algo.load()}; }
}  // namespace detail

namespace {

// Candidates the heuristic is asked for (it returned 8 for every m7c product), and the timed
// launches of each: one to warm up, then kRounds rounds of kReps, the candidates interleaved
// within a round so that clock drift hits them alike; a candidate's time is its best round.
constexpr int kCandidates = 8, kRounds = 2, kReps = 3;

void Check(cublasStatus_t status, const char* what) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "TunedMm: cuBLASLt ", what, " failed: ",
              cublasLtGetStatusString(status));
}

cudaDataType_t CudaType(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    default: TORCH_CHECK(false, "TunedMm: no cuBLASLt type for ", t);
  }
}

// The largest power of two (up to 256, cuBLASLt's default assumption) dividing the address:
// the heuristic only offers algorithms whose vector loads that alignment allows.
uint32_t Alignment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && address % align != 0) align /= 2;
  return align;
}

// A row-major [rows, cols] operand X as the column-major X^T that cuBLASLt multiplies:
// row-major storage (unit column stride) is X^T as stored (op N, [cols, rows], ld = row
// stride); column-major storage (unit row stride) is X stored, transposed (op T).
struct Operand {
  cublasOperation_t op = CUBLAS_OP_N;
  uint64_t stored_rows = 0, stored_cols = 0;
  int64_t ld = 0;
  bool ok = false;
};

Operand Describe(const at::Tensor& x) {
  Operand d;
  const int64_t rows = x.size(0), cols = x.size(1);
  if (x.stride(1) == 1 && x.stride(0) >= std::max<int64_t>(cols, 1)) {
    d = {CUBLAS_OP_N, static_cast<uint64_t>(cols), static_cast<uint64_t>(rows), x.stride(0), true};
  } else if (x.stride(0) == 1 && x.stride(1) >= std::max<int64_t>(rows, 1)) {
    d = {CUBLAS_OP_T, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), x.stride(1), true};
  }
  return d;
}

// Everything an algorithm's validity and speed depend on (D's leading dimension is m: out is
// contiguous).
struct Key {
  int device;
  int64_t m, n, k;
  int op_a, op_b;
  int64_t lda, ldb;
  int in_type, out_type;
  bool accumulate;
  uint32_t align_a, align_b, align_d;
  auto Tie() const {
    return std::tie(device, m, n, k, op_a, op_b, lda, ldb, in_type, out_type, accumulate, align_a, align_b, align_d);
  }
  bool operator==(const Key& o) const { return Tie() == o.Tie(); }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = 0;
    const auto mix = [&h](uint64_t v) { h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(k.device), mix(k.m), mix(k.n), mix(k.k), mix(k.op_a), mix(k.op_b), mix(k.lda), mix(k.ldb);
    mix(k.in_type), mix(k.out_type), mix(k.accumulate), mix(k.align_a), mix(k.align_b), mix(k.align_d);
    return h;
  }
};

std::mutex tuned_mutex;
std::unordered_map<Key, cublasLtMatmulAlgo_t, KeyHash> tuned;

// The algorithm timed fastest for key, if any (copied out: launched without the lock).
std::optional<cublasLtMatmulAlgo_t> Chosen(const Key& key) {
  std::lock_guard<std::mutex> lock(tuned_mutex);
  const auto it = tuned.find(key);
  if (it == tuned.end()) return std::nullopt;
  return it->second;
}

// The descriptors of one product; destroyed with it.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  Descriptors() = default;
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
  ~Descriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

struct CudaEvent {
  cudaEvent_t e = nullptr;
  CudaEvent() { C10_CUDA_CHECK(cudaEventCreate(&e)); }
  ~CudaEvent() { cudaEventDestroy(e); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
};

// out (= or +=) a @ b; out is contiguous [M, N].
void Run(const at::Tensor& a, const at::Tensor& b, at::Tensor& out, bool accumulate) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  // out^T [N, M] = b^T [N, K] . a^T [K, M]: cuBLASLt's A is b, its B is a.
  const Operand lt_a = Describe(b), lt_b = Describe(a);
  const cudaDataType_t in_type = CudaType(a.scalar_type()), out_type = CudaType(out.scalar_type());
  const Key key{a.get_device(), N, M, K, lt_a.op, lt_b.op, lt_a.ld, lt_b.ld, in_type, out_type, accumulate,
                Alignment(b.data_ptr()), Alignment(a.data_ptr()), Alignment(out.data_ptr())};

  Descriptors desc;
  Check(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "descriptor");
  Check(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &lt_a.op, sizeof(lt_a.op)), "transa");
  Check(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &lt_b.op, sizeof(lt_b.op)), "transb");
  Check(cublasLtMatrixLayoutCreate(&desc.a, in_type, lt_a.stored_rows, lt_a.stored_cols, lt_a.ld), "layout A");
  Check(cublasLtMatrixLayoutCreate(&desc.b, in_type, lt_b.stored_rows, lt_b.stored_cols, lt_b.ld), "layout B");
  Check(cublasLtMatrixLayoutCreate(&desc.d, out_type, N, M, N), "layout D");

  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto handle = at::cuda::getCurrentCUDABlasLtHandle();
  void* const workspace = at::cuda::getCUDABlasLtWorkspace();
  size_t workspace_bytes = at::cuda::getCUDABlasLtWorkspaceSize();
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  const auto matmul = [&](const cublasLtMatmulAlgo_t& algo, void* d) {
    return cublasLtMatmul(handle, desc.op, &alpha, b.data_ptr(), desc.a, a.data_ptr(), desc.b, &beta, d, desc.d, d,
                          desc.d, &algo, workspace, workspace_bytes, stream);
  };

  if (const auto chosen = Chosen(key)) {
    Check(matmul(*chosen, out.data_ptr()), "matmul");
    return;
  }

  Check(cublasLtMatmulPreferenceCreate(&desc.pref), "preference");
  Check(cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                             sizeof(workspace_bytes)),
        "workspace");
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_d},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_d}};
  for (const auto& [attribute, bytes] : aligns) {
    Check(cublasLtMatmulPreferenceSetAttribute(desc.pref, attribute, &bytes, sizeof(bytes)), "alignment");
  }
  cublasLtMatmulHeuristicResult_t found[kCandidates];
  int count = 0;
  Check(cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d, desc.d, desc.pref, kCandidates, found,
                                       &count),
        "heuristic");
  TORCH_CHECK(count > 0, "TunedMm: cuBLASLt offers no algorithm for [", M, ", ", K, "] @ [", K, ", ", N, "]");

  // Inside a capture nothing can be timed: the first pick, the shape left for a later call.
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    Check(matmul(found[0].algo, out.data_ptr()), "matmul");
    return;
  }

  // Timed on the call's operands; an accumulating product adds into a copy of out.
  at::Tensor scratch = accumulate ? out.clone() : out;
  CudaEvent start, stop;
  std::vector<float> best(count, std::numeric_limits<float>::infinity());
  for (int i = 0; i < count; ++i) {
    if (found[i].state != CUBLAS_STATUS_SUCCESS || matmul(found[i].algo, scratch.data_ptr()) != CUBLAS_STATUS_SUCCESS) {
      best[i] = -1.f;  // not runnable here
    }
  }
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < count; ++i) {
      if (best[i] < 0.f) continue;
      C10_CUDA_CHECK(cudaEventRecord(start.e, stream));
      for (int rep = 0; rep < kReps; ++rep) Check(matmul(found[i].algo, scratch.data_ptr()), "matmul");
      C10_CUDA_CHECK(cudaEventRecord(stop.e, stream));
      C10_CUDA_CHECK(cudaEventSynchronize(stop.e));
      float ms = 0.f;
      C10_CUDA_CHECK(cudaEventElapsedTime(&ms, start.e, stop.e));
      best[i] = std::min(best[i], ms);
    }
  }
  int pick = -1;
  for (int i = 0; i < count; ++i) {
    if (best[i] >= 0.f && (pick < 0 || best[i] < best[pick])) pick = i;
  }
  TORCH_CHECK(pick >= 0, "TunedMm: no cuBLASLt candidate ran for [", M, ", ", K, "] @ [", K, ", ", N, "]");
  Check(matmul(found[pick].algo, out.data_ptr()), "matmul");
  std::lock_guard<std::mutex> lock(tuned_mutex);
  tuned.emplace(key, found[pick].algo);
}

bool Aligned16(const at::Tensor& t) { return Alignment(t.data_ptr()) >= 16; }

}  // namespace

bool TunedMmTakes(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype) {
  const auto t = a.scalar_type();
  if (!a.is_cuda() || !b.is_cuda() || a.get_device() != b.get_device() || a.dim() != 2 || b.dim() != 2 ||
      (t != at::kBFloat16 && t != at::kHalf) || b.scalar_type() != t || (out_dtype != t && out_dtype != at::kFloat) ||
      a.size(1) != b.size(0) || a.numel() == 0 || b.numel() == 0 || b.size(1) % 8 != 0) {
    return false;
  }
  for (const auto* x : {&a, &b}) {
    const Operand d = Describe(*x);
    if (!d.ok || d.ld % 8 != 0 || !Aligned16(*x)) return false;
  }
  return true;
}

at::Tensor TunedMm(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype) {
  TORCH_CHECK(TunedMmTakes(a, b, out_dtype), "TunedMm does not take ", a.scalar_type(), " ", a.sizes(), " strides ",
              a.strides(), " @ ", b.scalar_type(), " ", b.sizes(), " strides ", b.strides(), " -> ", out_dtype);
  const c10::cuda::CUDAGuard guard(a.device());
  auto out = at::empty({a.size(0), b.size(1)}, a.options().dtype(out_dtype));
  Run(a, b, out, /*accumulate=*/false);
  return out;
}

void TunedMmAdd(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(TunedMmTakes(a, b, a.scalar_type()), "TunedMmAdd does not take ", a.scalar_type(), " ", a.sizes(),
              " strides ", a.strides(), " @ ", b.scalar_type(), " ", b.sizes(), " strides ", b.strides());
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == a.scalar_type() && out.dim() == 2 &&
                  out.size(0) == a.size(0) && out.size(1) == b.size(1) && out.device() == a.device() &&
                  Aligned16(out),
              "TunedMmAdd: out must be a contiguous, 16-byte aligned ", a.scalar_type(), " [", a.size(0), ", ",
              b.size(1), "], got ", out.scalar_type(), " ", out.sizes());
  const c10::cuda::CUDAGuard guard(a.device());
  Run(a, b, out, /*accumulate=*/true);
}

namespace detail {
int64_t TunedGemmShapes() {
  std::lock_guard<std::mutex> lock(tuned_mutex);
  return static_cast<int64_t>(tuned.size());
}
}  // namespace detail

}  // namespace nsad::nsa::cuda
