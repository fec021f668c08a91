// gemm_algos: how much of the m7c training step's GEMM time a per-shape choice of cuBLASLt
// algorithm could save over the heuristic's first pick (what at::mm / at::addmm run).
//
// For each GEMM of one m7c layer (batch 16 x seq 2048 rows) and the LM head, in the three
// orientations a linear layer runs (forward y = x W^T, dX = dY W, dW = dY^T x with a float32
// result, as the engine's SharedInputLinear writes weight gradients), it asks cuBLASLt's
// heuristic for up to --algos candidates (32 MiB workspace, as PyTorch gives cuBLASLt on
// Hopper), times each with CUDA events (--reps launches after --warmup, median of --rounds
// rounds) and prints the first pick's time, the fastest candidate's and the difference times
// the launches of one training step. Plain CUDA + cuBLASLt: no LibTorch, so it builds and runs
// in seconds.
//   gemm_algos [--rows 32768] [--algos 32] [--reps 20] [--warmup 5] [--rounds 3]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void Check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s: cuBLAS status %d\n", what, static_cast<int>(s));
    std::exit(1);
  }
}

// A row-major product out[M, N] = a . b as cuBLASLt (column-major) sees it: out^T = b^T a^T.
// kind: "fwd" y[M,N] = x[M,K] W[N,K]^T; "dx" dx[M,K] = dy[M,N] W[N,K]; "dw" dW[N,K] = dy[M,N]^T x[M,K].
struct Gemm {
  std::string name, kind;
  int64_t m, n, k;           // cuBLASLt's (column-major) sizes
  cublasOperation_t ta, tb;  // on its A (the row-major product's right operand) and B
  int64_t lda, ldb, ldc;
  bool float_out;
  int per_step;  // launches of this product in one training step
};

Gemm Make(const std::string& name, const std::string& kind, int64_t rows, int64_t N, int64_t K, int per_step) {
  Gemm g{name, kind, 0, 0, 0, CUBLAS_OP_N, CUBLAS_OP_N, 0, 0, 0, false, per_step};
  if (kind == "fwd") {  // y^T [N, M] = W [K, N]^T-as-stored (op T) . x^T [K, M]
    g.m = N, g.n = rows, g.k = K, g.ta = CUBLAS_OP_T, g.tb = CUBLAS_OP_N, g.lda = K, g.ldb = K, g.ldc = N;
  } else if (kind == "dx") {  // dx^T [K, M] = W^T-as-stored [K, N] . dy^T [N, M]
    g.m = K, g.n = rows, g.k = N, g.ta = CUBLAS_OP_N, g.tb = CUBLAS_OP_N, g.lda = K, g.ldb = N, g.ldc = K;
  } else {  // dW^T [K, N] = x^T [K, M] . dy [M, N] (dy^T stored as [N, M]: op T)
    g.m = K, g.n = N, g.k = rows, g.ta = CUBLAS_OP_N, g.tb = CUBLAS_OP_T, g.lda = K, g.ldb = N, g.ldc = K;
    g.float_out = true;
  }
  return g;
}

struct Timing {
  float first_ms = 0, best_ms = 0;
  int best_index = 0, candidates = 0;
};

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Timing Sweep(cublasLtHandle_t lt, const Gemm& g, int max_algos, int reps, int warmup, int rounds, void* workspace,
             size_t workspace_bytes, cudaStream_t stream) {
  const auto a_rows = g.ta == CUBLAS_OP_N ? g.m : g.k, a_cols = g.ta == CUBLAS_OP_N ? g.k : g.m;
  const auto b_rows = g.tb == CUBLAS_OP_N ? g.k : g.n, b_cols = g.tb == CUBLAS_OP_N ? g.n : g.k;
  const cudaDataType_t out_type = g.float_out ? CUDA_R_32F : CUDA_R_16BF;
  void *a, *b, *c;
  Check(cudaMalloc(&a, a_cols * g.lda * 2), "malloc a");
  Check(cudaMalloc(&b, b_cols * g.ldb * 2), "malloc b");
  Check(cudaMalloc(&c, g.n * g.ldc * (g.float_out ? 4 : 2)), "malloc c");
  Check(cudaMemset(a, 0x3c, a_cols * g.lda * 2), "fill a");  // small finite bf16 values
  Check(cudaMemset(b, 0x3c, b_cols * g.ldb * 2), "fill b");

  cublasLtMatmulDesc_t op;
  Check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
  Check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &g.ta, sizeof(g.ta)), "transa");
  Check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &g.tb, sizeof(g.tb)), "transb");
  cublasLtMatrixLayout_t la, lb, lc;
  Check(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, a_rows, a_cols, g.lda), "layout a");
  Check(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, b_rows, b_cols, g.ldb), "layout b");
  Check(cublasLtMatrixLayoutCreate(&lc, out_type, g.m, g.n, g.ldc), "layout c");
  cublasLtMatmulPreference_t pref;
  Check(cublasLtMatmulPreferenceCreate(&pref), "pref");
  Check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                             sizeof(workspace_bytes)),
        "workspace");
  std::vector<cublasLtMatmulHeuristicResult_t> found(max_algos);
  int count = 0;
  Check(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, max_algos, found.data(), &count), "heuristic");

  const float alpha = 1.f, beta = 0.f;
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "event");
  Check(cudaEventCreate(&stop), "event");
  std::vector<std::vector<float>> ms(count);
  for (int r = 0; r < rounds; ++r) {
    for (int i = 0; i < count; ++i) {  // candidates interleaved within a round: drift hits all alike
      if (found[i].state != CUBLAS_STATUS_SUCCESS) continue;
      const auto run = [&] {
        Check(cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, c, lc, c, lc, &found[i].algo, workspace,
                             workspace_bytes, stream),
              "matmul");
      };
      for (int w = 0; w < warmup; ++w) run();
      Check(cudaEventRecord(start, stream), "record");
      for (int rep = 0; rep < reps; ++rep) run();
      Check(cudaEventRecord(stop, stream), "record");
      Check(cudaEventSynchronize(stop), "sync");
      float total = 0;
      Check(cudaEventElapsedTime(&total, start, stop), "elapsed");
      ms[i].push_back(total / reps);
    }
  }
  Timing t;
  t.candidates = count;
  if (count > 0 && !ms[0].empty()) {
    t.first_ms = t.best_ms = Median(ms[0]);
    for (int i = 1; i < count; ++i) {
      if (ms[i].empty()) continue;
      const float m = Median(ms[i]);
      if (m < t.best_ms) t.best_ms = m, t.best_index = i;
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return t;
}

int64_t Flag(int argc, char** argv, const char* name, int64_t fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoll(argv[i + 1]);
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t rows = Flag(argc, argv, "--rows", 32768);
  const int algos = static_cast<int>(Flag(argc, argv, "--algos", 32));
  const int reps = static_cast<int>(Flag(argc, argv, "--reps", 20));
  const int warmup = static_cast<int>(Flag(argc, argv, "--warmup", 5));
  const int rounds = static_cast<int>(Flag(argc, argv, "--rounds", 3));
  if (rows <= 0 || algos <= 0 || reps <= 0 || warmup < 0 || rounds <= 0) {
    std::fprintf(stderr, "gemm_algos: --rows, --algos, --reps and --rounds must be positive\n");
    return 2;
  }
  // m7c: dim 768, 12 layers, 12 heads x 64, kv 6 x 2 x 64, gate hidden 192, MLP hidden 2048,
  // vocabulary 50304 (tied head). Launches per step: one per layer for each, the head once.
  const int L = 12;
  std::vector<Gemm> gemms;
  const struct {
    const char* name;
    int64_t N, K;
    int per_step;
  } layers[] = {{"attn in (q|kv|gate) 1728x768", 1728, 768, L},
                {"attn out 768x768", 768, 768, L},
                {"mlp in (gate|up) 4096x768", 4096, 768, L},
                {"mlp out 768x2048", 768, 2048, L},
                {"lm head 50304x768", 50304, 768, 1}};
  for (const auto& l : layers) {
    for (const char* kind : {"fwd", "dx", "dw"}) gemms.push_back(Make(l.name, kind, rows, l.N, l.K, l.per_step));
  }

  cublasLtHandle_t lt;
  Check(cublasLtCreate(&lt), "cublasLtCreate");
  cudaStream_t stream;
  Check(cudaStreamCreate(&stream), "stream");
  const size_t workspace_bytes = size_t{32} << 20;
  void* workspace;
  Check(cudaMalloc(&workspace, workspace_bytes), "workspace");
  cudaDeviceProp prop;
  Check(cudaGetDeviceProperties(&prop, 0), "properties");
  std::printf("%s, cuBLASLt %zu, rows %lld, up to %d candidates, %d reps x %d rounds\n", prop.name,
              cublasLtGetVersion(), static_cast<long long>(rows), algos, reps, rounds);
  std::printf("%-30s %-4s %6s %10s %10s %6s %8s %12s\n", "gemm", "kind", "algos", "first ms", "best ms", "pick",
              "TFLOP/s", "step ms saved");
  double first_total = 0, best_total = 0;
  for (const auto& g : gemms) {
    const Timing t = Sweep(lt, g, algos, reps, warmup, rounds, workspace, workspace_bytes, stream);
    const double tflops = 2.0 * g.m * g.n * g.k / (t.best_ms * 1e-3) / 1e12;
    first_total += t.first_ms * g.per_step;
    best_total += t.best_ms * g.per_step;
    std::printf("%-30s %-4s %6d %10.4f %10.4f %6d %8.0f %12.3f\n", g.name.c_str(), g.kind.c_str(), t.candidates,
                t.first_ms, t.best_ms, t.best_index, tflops, (t.first_ms - t.best_ms) * g.per_step);
  }
  std::printf("one step's products: heuristic's first picks %.2f ms, fastest candidates %.2f ms (%.2f ms less)\n",
              first_total, best_total, first_total - best_total);
  cudaFree(workspace);
  cudaStreamDestroy(stream);
  cublasLtDestroy(lt);
  return 0;
}
