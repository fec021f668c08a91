// Exponentials per second on the SFU (MUFU), f32 against the packed f16x2 and bf16x2 forms.
// The compressed branch's forward takes two exponentials per score (PERFORMANCE.md: "How far
// 9x is from the branches' floors"); a packed form that ran at two results per MUFU slot
// would halve that floor. `cuobjdump -sass mufu_exp2 | grep MUFU` shows what each compiles to.
// Usage: mufu_exp2 (no arguments); prints three rounds of each.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace {

constexpr int kIters = 4096;  // dependent exponentials per chain
constexpr int kChains = 8;    // independent chains per thread, to keep the unit busy

// Each chain feeds 2^x - 1.5 back in (stays in [-1.5, 0.5]: no overflow, no denormals).
__global__ void ExpF32(float* out) {
  float v[kChains];
  for (int c = 0; c < kChains; ++c) v[c] = 1e-6f * static_cast<float>(threadIdx.x + c) - 1.f;
  for (int i = 0; i < kIters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      float y;
      asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(v[c]));
      v[c] = y - 1.5f;
    }
  }
  float sum = 0.f;
  for (int c = 0; c < kChains; ++c) sum += v[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

// The packed forms: two results per instruction. `kind` 0 = f16x2, 1 = bf16x2.
template <int kind>
__global__ void ExpPacked(unsigned* out) {
  // -1.0 in both halves, varied in the low mantissa bits; 1.5 in both halves.
  const unsigned minus_one = kind == 0 ? 0xBC00BC00u : 0xBF80BF80u;
  const unsigned one_and_half = kind == 0 ? 0x3E003E00u : 0x3FC03FC0u;
  unsigned v[kChains];
  for (int c = 0; c < kChains; ++c) v[c] = minus_one ^ ((threadIdx.x + c) & 0x000f000fu);
  for (int i = 0; i < kIters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      unsigned y;
      if constexpr (kind == 0) {
        asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(v[c]));
        asm volatile("sub.f16x2 %0, %1, %2;" : "=r"(v[c]) : "r"(y), "r"(one_and_half));
      } else {
        asm volatile("ex2.approx.ftz.bf16x2 %0, %1;" : "=r"(y) : "r"(v[c]));
        asm volatile("sub.rn.bf16x2 %0, %1, %2;" : "=r"(v[c]) : "r"(y), "r"(one_and_half));
      }
    }
  }
  unsigned bits = 0;
  for (int c = 0; c < kChains; ++c) bits ^= v[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = bits;
}

void Check(cudaError_t e) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA: %s\n", cudaGetErrorString(e));
    std::exit(1);
  }
}

}  // namespace

int main() {
  int sms = 0, clock_khz = 0;
  Check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Check(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const int blocks = 8 * sms, threads = 256;
  void* out = nullptr;
  Check(cudaMalloc(&out, static_cast<size_t>(blocks) * threads * sizeof(float)));
  cudaEvent_t begin, end;
  Check(cudaEventCreate(&begin));
  Check(cudaEventCreate(&end));
  const double instructions = static_cast<double>(blocks) * threads * kIters * kChains;
  const auto time_ms = [&](auto launch) {
    Check(cudaEventRecord(begin));
    launch();
    Check(cudaEventRecord(end));
    Check(cudaEventSynchronize(end));
    float ms = 0.f;
    Check(cudaEventElapsedTime(&ms, begin, end));
    return static_cast<double>(ms);
  };
  std::printf("%d SMs, max clock %.0f MHz; exponentials per SM per clock at that clock\n", sms, clock_khz / 1e3);
  for (int round = 0; round < 3; ++round) {
    const double f32 = time_ms([&] { ExpF32<<<blocks, threads>>>(static_cast<float*>(out)); });
    const double f16 = time_ms([&] { ExpPacked<0><<<blocks, threads>>>(static_cast<unsigned*>(out)); });
    const double bf16 = time_ms([&] { ExpPacked<1><<<blocks, threads>>>(static_cast<unsigned*>(out)); });
    const auto per_sm_clock = [&](double results, double ms) {
      return results / (ms * 1e-3) / sms / (clock_khz * 1e3);
    };
    std::printf("f32 %.3f ms (%.1f) | f16x2 %.3f ms (%.1f) | bf16x2 %.3f ms (%.1f)\n", f32,
                per_sm_clock(instructions, f32), f16, per_sm_clock(2 * instructions, f16), bf16,
                per_sm_clock(2 * instructions, bf16));
  }
  Check(cudaGetLastError());
  return 0;
}
