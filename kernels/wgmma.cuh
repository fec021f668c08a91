// Warpgroup MMAs (wgmma, sm_90a) for the attention kernels: one m64nNk16 product per
// instruction, issued by the four warps of a warpgroup together and run asynchronously by
// the tensor cores, the B operand read straight from shared memory through a descriptor.
//
// Only what the kernels use is here: m64n64k16 with float32 accumulators, A (16-bit) in
// registers or in shared memory, B in shared memory. The register layouts are those of mma.sync
// m16n8k16, one m16 tile per warp (warp w of the warpgroup owns rows 16w .. 16w + 15):
//   A: a0 (row g, k 2c..2c+1), a1 (row g+8, same k), a2 (row g, k 2c+8..), a3 (row g+8, ..)
//   D: d[j][0..1] (row g, n 8j + 2c..+1), d[j][2..3] (row g+8, same n), j = 0..7
// so the fragments the mma.sync kernels build (Q rows, P packed from the scores with
// mma::PackA) and their online softmax serve here unchanged.
//
// B tiles are the kernels' staged tiles (mma::StageTileAsync at D = 64): rows of 64 16-bit
// elements (128 bytes), 16-byte chunk c of row r at chunk c ^ (r % 8). On a 1024-byte
// aligned tile that is exactly the hardware's 128-byte swizzle, so one tile of keys serves
// as either operand:
//   K-major B (the contraction runs along a row: K in S = Q K^T): 8-row groups 1024 bytes
//     apart (stride byte offset); the k16 step kk starts 32 kk bytes into the rows.
//   MN-major B (the contraction runs down the rows: V in O = P V, transposed by the
//     instruction): k16 step kk is rows 16 kk .. 16 kk + 15, 2048 kk bytes on; its two
//     8-row groups are again 1024 bytes apart (stride byte offset); one 64-element row is
//     the whole N = 64, so the leading byte offset (the next 64 columns) is never used.
// PTX ISA, "Matrix Descriptor Format" and "Shared Memory Matrix Layout" of wgmma.
//
// Ordering: shared memory written by generic-proxy stores (cp.async included) must be
// fenced with FenceProxyAsync() by the writing threads before the barrier that publishes
// it; registers written by ordinary instructions (accumulators zeroed or rescaled, A
// fragments) need Fence() before the first wgmma that reads them; and the compiler must not
// move accesses to the accumulators across the asynchronous region, which FenceRegisters()
// pins before the issue and after the wait.
#pragma once

#include <cstdint>

namespace nsad::nsa::cuda::detail::wgmma {

// Compiled only where the instructions exist (sm_90a); elsewhere the kernels that use them
// are never launched (the launchers check the device) and these bodies are empty.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define NSAD_WGMMA_AVAILABLE 1
#else
#define NSAD_WGMMA_AVAILABLE 0
#endif

constexpr int kWarpgroupThreads = 128;
constexpr uint32_t kSwizzleBytes = 1024;  // the 128-byte swizzle repeats every 8 rows of 128 bytes

// Shared-memory matrix descriptor, 128-byte swizzle. Addresses and offsets in bytes.
__device__ __forceinline__ uint64_t Descriptor(uint32_t smem_addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16;
  d |= static_cast<uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32;
  d |= uint64_t{1} << 62;  // 128-byte swizzle
  return d;
}

// A or B = a staged [64 rows][64] tile read K-major (K in S = Q K^T), k16 step 0; step kk
// is kKMajorStepBytes kk bytes on (Advance).
__device__ __forceinline__ uint64_t KMajorTile(uint32_t tile) { return Descriptor(tile, 16u, kSwizzleBytes); }
// A or B = a staged [64 rows][64] tile read MN-major, transposed (V in O = P V), k16 step 0;
// step kk is kMnMajorStepBytes kk bytes on (Advance).
__device__ __forceinline__ uint64_t MnMajorTile(uint32_t tile) {
  return Descriptor(tile, 8u * kSwizzleBytes, kSwizzleBytes);
}
constexpr uint32_t kKMajorStepBytes = 32;    // 16 elements further along every row
constexpr uint32_t kMnMajorStepBytes = 2048;  // 16 rows further down
// desc, `bytes` further into shared memory. The address field (bits 0-13: address / 16) takes
// the offset without carrying into the next field, shared memory being under 256 KB, so this
// is one 32-bit add, where a whole Descriptor() is four or five instructions per product.
__device__ __forceinline__ uint64_t Advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

__device__ __forceinline__ void Fence() {
#if NSAD_WGMMA_AVAILABLE
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void Commit() {
#if NSAD_WGMMA_AVAILABLE
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
// Waits until at most N committed groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void Wait() {
#if NSAD_WGMMA_AVAILABLE
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
// Shared memory written by this thread's generic-proxy stores (cp.async included) becomes
// visible to the tensor cores' reads once a barrier follows.
__device__ __forceinline__ void FenceProxyAsync() {
#if NSAD_WGMMA_AVAILABLE
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Warp-specialised kernels: a warpgroup lowers (RegDealloc) or raises (RegAlloc) its
// per-thread register limit, trading registers with the CTA's other warpgroups through the
// CTA's pool; each warpgroup runs one of them once, before anything else.
template <int N>
__device__ __forceinline__ void RegAlloc() {
#if NSAD_WGMMA_AVAILABLE
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void RegDealloc() {
#if NSAD_WGMMA_AVAILABLE
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
#endif
}
// Named barrier `id` (1-15; 0 is __syncthreads') over `threads` threads: BarSync waits for
// them all, BarArrive counts this thread and goes on. One side arriving and the other syncing
// hands shared memory from the arriving threads to the syncing ones (what was written before
// the arrival is visible after the sync).
__device__ __forceinline__ void BarSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void BarArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Keeps the compiler from moving accesses to r across the asynchronous region.
template <int N>
__device__ __forceinline__ void FenceRegisters(float (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(r[i][e])::"memory");
  }
}

// The 32 float32 accumulators of an m64n64 product as asm operands %0 .. %31, shared by both
// instruction forms below.
#define NSAD_WGMMA_ACCUMULATOR_REGS                                         \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define NSAD_WGMMA_ACCUMULATORS(d)                                                                                \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),     \
      "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
      "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
      "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
      "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])

// d += A B for one m64n64k16 step: A the warp's 16 rows (mma.sync A fragment), B through
// desc, K-major (kTransB false) or MN-major (true). kOverwrite: d = A B (see
// MmaM64N64K16Smem). Asynchronous: d is valid after Wait().
template <bool kBf16, bool kTransB, bool kOverwrite = false>
__device__ __forceinline__ void MmaM64N64K16(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc) {
#if NSAD_WGMMA_AVAILABLE
#define NSAD_WGMMA_ASM(TYPE)                                                                                   \
  asm volatile(                                                                                                \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                                         \
      NSAD_WGMMA_ACCUMULATOR_REGS                                                                              \
      "{%32, %33, %34, %35}, %36, %38, 1, 1, %37;"                                                            \
      : NSAD_WGMMA_ACCUMULATORS(d)                                                                             \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(kTransB ? 1 : 0), "n"(kOverwrite ? 0 : 1))
  if constexpr (kBf16) {
    NSAD_WGMMA_ASM("bf16");
  } else {
    NSAD_WGMMA_ASM("f16");
  }
#undef NSAD_WGMMA_ASM
#endif
}

// d += A B for one m64n64k16 step, both operands in shared memory through descriptors, each
// K-major (false) or MN-major (true, transposed by the instruction). kOverwrite: d = A B, the
// accumulators' old values ignored (the instruction's scale-d = 0), so a product needs no
// zeroing instructions, which ptxas counts as writes into the asynchronous region of
// products still running and answers by serialising them (C7515). Asynchronous: d is valid
// after Wait().
template <bool kBf16, bool kTransA, bool kTransB, bool kOverwrite = false>
__device__ __forceinline__ void MmaM64N64K16Smem(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b) {
#if NSAD_WGMMA_AVAILABLE
#define NSAD_WGMMA_SS_ASM(TYPE)                                                                                \
  asm volatile(                                                                                                \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                                         \
      NSAD_WGMMA_ACCUMULATOR_REGS                                                                              \
      "%32, %33, %36, 1, 1, %34, %35;"                                                                         \
      : NSAD_WGMMA_ACCUMULATORS(d)                                                                             \
      : "l"(desc_a), "l"(desc_b), "n"(kTransA ? 1 : 0), "n"(kTransB ? 1 : 0), "n"(kOverwrite ? 0 : 1))
  if constexpr (kBf16) {
    NSAD_WGMMA_SS_ASM("bf16");
  } else {
    NSAD_WGMMA_SS_ASM("f16");
  }
#undef NSAD_WGMMA_SS_ASM
#endif
}

}  // namespace nsad::nsa::cuda::detail::wgmma
