// Key-centric dK/dV (and, with kFusedDq, dQ) on warpgroup MMAs (sm_90a, bf16/fp16, head_dim
// 64 or 128). Two users: the selected branch (selected_attention.cu,
// SelectedKernelChoice::DkDv::kWgmma) and the sliding window's backward (window_attention.cu,
// WindowKernelChoice::Backward::kWgmma). KeyPolicy hands each CTA one block of <= 64 keys and
// the query positions that may attend it, and masks (Allowed): for the selected branch the
// staged mma.sync kernel's work split (SelectedDkDvStagedKernel), one work item of the
// inverted block map, i.e. a selected block and a slice of the entries that chose it; for
// the window a 64-key block and a slice of the contiguous positions whose windows cover it.
// The (position, head) query rows are gathered kRows at a time into shared memory, later
// steps' copies in flight while this one computes (one step ahead at D = 128, two at D = 64,
// where a second warpgroup stages them and does dQ: see Cfg::kSplit). Against the staged
// kernel, what changes is who multiplies. The block's 64 keys are the M of every product but
// dQ's, and per step of 64 rows:
//   S^T  = K Q^T     K (staged once) and Q, both K-major from shared memory
//   dP^T = V dO^T    V and dO, likewise
//   P^T  = exp2(S^T - lse), dS^T = P^T (dP^T - delta)   from the accumulators, under the
//                    policy's mask (none for a step whose rows all see the whole block)
//   dV  += P^T dO    P^T packed into register A fragments, dO MN-major (transposed)
//   dK  += dS^T Q    likewise
//   dQ   = dS K      (kFusedDq) dS^T through shared memory, read as a transposed A; K
//                    MN-major; each row's 64 columns added into the float32 dq_acc
// as FlashAttention-3's backward lays out its products. Every tile is a [64][64] 16-bit
// tile in the 128-byte swizzle that mma::SwizzledOffset writes (wgmma.cuh), so one staged
// copy serves both orientations; at D = 128 a row's two 64-column halves sit in two such
// tiles: S^T and dP^T contract over both, dK, dV and dQ have one accumulator tile per half.
// dK/dV stay in registers over the whole slice and are added into float32 buffers once per
// work item, as before; every float32 add is a 16-byte atomic (AtomicAddRowQuads). Where a
// work item holds every query of its key block (the window's default split), the policy
// carries dk_out/dv_out and the item writes its rows rounded (CanStoreRows, StoreRowQuads): no
// zeroed float32 buffers, no atomics, no rounding pass after.
#pragma once

#include <climits>
#include <type_traits>

#include "attention_tile.cuh"
#include "mma_tile.cuh"
#include "wgmma.cuh"

namespace nsad::nsa::cuda::detail::dkdv_wgmma {

// Shared memory from a 1 KB-aligned base (the swizzle's period): the block's K and V rows,
// kBufs buffers each of staged Q and dO rows (each kHalves [64][64] tiles), kDsBufs dS^T
// tiles, kBufs buffers of per-row metadata (lse, delta, position as float bits), then the
// item's positions and, for each, the element offset in [B,T,H,D] of its group's first head.
template <int D, int kMaxQueries>
struct Cfg {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static constexpr int kHalves = D / 64;  // 64-column tiles per row
  static constexpr int kRows = 64;  // query rows per step: the N of S^T and dP^T
  // D=64 splits the work between two warpgroups (FlashAttention-3's warp specialisation):
  // the score warpgroup runs S^T, dP^T, the probabilities and dV/dK, and the dQ warpgroup
  // stages the rows (two steps ahead: three buffers) and runs dQ and its adds, one step
  // behind (dS^T alternates between two tiles). Named barriers hand buffers and tiles back
  // and forth (kRowsReady ...). The profile it answers (ncu, one warpgroup doing everything,
  // two CTAs per SM): two warps per scheduler, the tensor pipe 30% busy, a third of the stall
  // samples in the dQ adds and 12% in the row staging. Measured on H100 against that kernel:
  // m7c batch 16 step 86.25 / 86.38 / 85.89 -> 85.31 / 85.30 / 85.36 ms; one layer forward +
  // backward at B16 T2048 D64 12:2 2.754 / 2.725 -> 2.628 / 2.643 ms. A fourth row buffer
  // (staging three steps ahead) was slower: 85.26 / 85.39 / 85.38 -> 85.49 / 85.62 / 85.51
  // ms per step. D=128 holds twice the dK/dV accumulators and has no registers to spare: one
  // warpgroup runs the steps one after another, one CTA per SM (255 registers, 64-72 bytes of
  // spill).
  static constexpr bool kSplit = D == 64;
  static constexpr int kGroupThreads = wgmma::kWarpgroupThreads;
  static constexpr int kThreads = (kSplit ? 2 : 1) * kGroupThreads;
  static constexpr int kMinCtas = D == 64 ? 2 : 1;
  // kSplit: the launch gives every thread 128 registers (2 CTAs of 256 threads); the dQ
  // warpgroup hands kScoreRegs - 128 of them to the score warpgroup (setmaxnreg).
  static constexpr int kScoreRegs = 192, kDqRegs = 64;
  static_assert(!kSplit || kScoreRegs + kDqRegs == 2 * 65536 / (kThreads * kMinCtas), "the CTA's registers");
  static constexpr int kRowsReady = 1;  // + buffer: its rows are staged (dQ -> score warpgroup)
  static constexpr int kRowsFree = 4;   // + buffer: the score warpgroup's products are done with them
  static constexpr int kDsReady = 7;    // + dS^T tile: written (score -> dQ warpgroup)
  static constexpr int kDsFree = 9;     // + dS^T tile: dQ's product is done with it
  static constexpr int kBufs = kSplit ? 3 : 2, kDsBufs = kSplit ? 2 : 1;
  static constexpr int kTileBytes = 64 * 64 * 2;       // 8 KB: one [64][64] 16-bit tile
  static constexpr int kRowsBytes = kHalves * kTileBytes;  // 64 rows of D
  static constexpr int kK = 0, kV = kRowsBytes, kQ = 2 * kRowsBytes, kDo = kQ + kBufs * kRowsBytes;
  static constexpr int kDs = kDo + kBufs * kRowsBytes;
  static constexpr int kMeta = kDs + kDsBufs * kTileBytes;
  static constexpr int kPos = kMeta + kBufs * kRows * 16;
  static constexpr int kAlignSlack = static_cast<int>(wgmma::kSwizzleBytes);
  static constexpr int kRowOffset = kPos + 4 * ((kMaxQueries + 1) / 2 * 2);  // 8-byte aligned
  static constexpr int kBytes = kAlignSlack + kRowOffset + 8 * kMaxQueries;
};

// A warp's m64n64 accumulator rows as quads of four adjacent columns: of each 16 columns, lane
// c of a quad holds 16 i + 2c, +1 (d[2i]) and 16 i + 8 + 2c, +1 (d[2i + 1]) of row g + 8 h;
// one exchange with lane c ^ 1 leaves the even lane with columns 16 i + 4 (c / 2) .. + 3 and
// the odd lane with 16 i + 8 + 4 (c / 2) .. + 3. RowQuadColumn is the lane's first quad's
// column (the others are 16 columns further each), RowQuad its quad i (every lane of the
// warp must call it: it exchanges with the neighbour). Shared by the atomic adds and the
// rounded stores below, so both write the same columns.
__device__ __forceinline__ int RowQuadColumn(int lane) { return 8 * (lane & 1) + 4 * ((lane & 3) >> 1); }
__device__ __forceinline__ float4 RowQuad(const float (&d)[8][4], int h, int i, int lane) {
  const bool odd = lane & 1;
  const float a0 = d[2 * i][2 * h], a1 = d[2 * i][2 * h + 1];
  const float b0 = d[2 * i + 1][2 * h], b1 = d[2 * i + 1][2 * h + 1];
  const float x0 = __shfl_xor_sync(0xffffffffu, odd ? a0 : b0, 1);
  const float x1 = __shfl_xor_sync(0xffffffffu, odd ? a1 : b1, 1);
  return odd ? make_float4(x0, x1, b0, b1) : make_float4(a0, a1, x0, x1);
}

// Adds half `h` of a warp's m64n64 accumulator rows, times mul, into a float32 row of 64
// columns, one 16-byte atomic per quad (RowQuad). Half the atomic operations of float2 adds
// (mma::AtomicAddRowColumns): measured on H100, selected backward alone B16 T2048 D64 12:2
// 1.26-1.29 -> 1.18 ms, 64k 3.09-3.14 -> 2.94-2.96 ms. All lanes take part in the exchange;
// `add` says whether this lane's row is added.
__device__ __forceinline__ void AtomicAddRowQuads(float* row, const float (&d)[8][4], int h, float mul, bool add,
                                                  int lane) {
  // Each add's address is an immediate offset from one pointer instead of 64-bit index
  // arithmetic per add.
  float4* const quads = reinterpret_cast<float4*>(row + RowQuadColumn(lane));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 x = RowQuad(d, h, i, lane);
    if (add) atomicAdd(quads + 4 * i, make_float4(x.x * mul, x.y * mul, x.z * mul, x.w * mul));
  }
}

// Whether a policy's work items may write their dK/dV rows rounded (StoreRowQuads) instead of
// adding them into float32 buffers: one whose work items can hold every query of their key
// block carries dk_out/dv_out, non-null where they do.
template <typename KeyPolicy, typename = void>
struct CanStoreRows : std::false_type {};
template <typename KeyPolicy>
struct CanStoreRows<KeyPolicy, std::void_t<decltype(KeyPolicy::dk_out), decltype(KeyPolicy::dv_out)>>
    : std::true_type {};

// Writes half `h` of a warp's m64n64 accumulator rows, times mul, rounded to scalar_t, into a
// row of 64 columns: the quads of AtomicAddRowQuads, each one 8-byte store. For a work item
// that holds every query of its key block (nothing else adds to these rows).
template <typename scalar_t>
__device__ __forceinline__ void StoreRowQuads(scalar_t* row, const float (&d)[8][4], int h, float mul, bool store,
                                              int lane) {
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  uint2* const quads = reinterpret_cast<uint2*>(row + RowQuadColumn(lane));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 x = RowQuad(d, h, i, lane);
    if (store) quads[4 * i] = make_uint2(mma::Pack<kBf16>(x.x * mul, x.y * mul), mma::Pack<kBf16>(x.z * mul, x.w * mul));
  }
}

// acc = A B^T for two sets of 64 rows of D = 64 kHalves elements, each staged as kHalves
// swizzled [64][64] tiles 8 KB apart, given by their K-major descriptors a and b
// (wgmma::KMajorTile): the contraction runs over D, four k16 steps per tile. The first step
// overwrites acc. Issues the MMAs only (Commit/Wait follow).
template <bool kBf16, int kHalves>
__device__ __forceinline__ void RowsTimesRowsT(float (&acc)[8][4], uint64_t a, uint64_t b) {
  constexpr uint32_t kTileBytes = 64 * 64 * 2;
  wgmma::MmaM64N64K16Smem<kBf16, false, false, true>(acc, a, b);
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
#pragma unroll
    for (int kk = h == 0 ? 1 : 0; kk < 4; ++kk) {
      const uint32_t step = h * kTileBytes + wgmma::kKMajorStepBytes * kk;
      wgmma::MmaM64N64K16Smem<kBf16, false, false>(acc, wgmma::Advance(a, step), wgmma::Advance(b, step));
    }
  }
}

template <typename scalar_t, int D, bool kFusedDq, int kMaxQueries, typename KeyPolicy>
__global__ void __launch_bounds__(Cfg<D, kMaxQueries>::kThreads, Cfg<D, kMaxQueries>::kMinCtas)
    SelectedDkDvWgmmaKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                            const scalar_t* __restrict__ v, const scalar_t* __restrict__ dout,
                            const float* __restrict__ lse, const float* __restrict__ delta,
                            float* __restrict__ dk_acc, float* __restrict__ dv_acc, float* __restrict__ dq_acc,
                            Shape s, KeyPolicy pol, float scale) {
  using C = Cfg<D, kMaxQueries>;
  constexpr int kR = C::kRows, kChunks = D / 8, kHalves = C::kHalves;
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  extern __shared__ float4 dkdv_smem[];
  const uint32_t raw = mma::SmemAddr(dkdv_smem);
  const uint32_t base = (raw + C::kAlignSlack - 1) & ~static_cast<uint32_t>(C::kAlignSlack - 1);
  unsigned char* const gbase = reinterpret_cast<unsigned char*>(dkdv_smem) + (base - raw);
  float4* const meta = reinterpret_cast<float4*>(gbase + C::kMeta);  // [kBufs][kR]
  int* const pos = reinterpret_cast<int*>(gbase + C::kPos);
  int64_t* const row_offset = reinterpret_cast<int64_t*>(gbase + C::kRowOffset);

  const KeyWork w = pol.Work(s);
  if (!w.valid || w.num_queries <= 0 || w.keys.count <= 0) return;  // whole CTA
  const int lane = threadIdx.x & 31, g = lane >> 2;
  // The warp's place in its warpgroup: its accumulator rows are 16 wg_warp + g and + 8.
  const int wg_warp = (threadIdx.x >> 5) & 3;
  const int hq = s.hq(), total = w.num_queries * hq;  // flattened (position, head) rows
  for (int i = threadIdx.x; i < w.num_queries; i += C::kThreads) {
    pos[i] = pol.Query(w, i);
    row_offset[i] = QueryOffset(s, w.b, pos[i], w.g * hq);
  }
  // Flattened row rho is position pi = rho / hq of the item, head w.g hq + rho % hq: its
  // elements start at row_offset[pi] + (rho % hq) D.
  const SmallDivisor by_hq(hq);
  __syncthreads();

  // The block's keys, rows past its end zero (their products are masked); committed with
  // the first step's rows. tid: the staging thread's number in its warpgroup.
  const int64_t kv_stride = static_cast<int64_t>(s.G) * D;
  const auto stage_keys = [&](int tid) {
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const int64_t src = KeyOffset(s, w.b, w.keys.start, w.g) + 64 * h;
      mma::StageTileAsync<64, 64, C::kGroupThreads>(base + C::kK + h * C::kTileBytes, k + src, kv_stride,
                                                    w.keys.count, tid);
      mma::StageTileAsync<64, 64, C::kGroupThreads>(base + C::kV + h * C::kTileBytes, v + src, kv_stride,
                                                    w.keys.count, tid);
    }
  };
  const auto stage = [&](int r0, int buf, int tid) {
#pragma unroll
    for (int it = 0; it < kR * kChunks / C::kGroupThreads; ++it) {
      const int e = tid + it * C::kGroupThreads;
      const int r = e / kChunks, ch = e % kChunks, rho = r0 + r;
      int pi, head;
      by_hq.DivMod(rho, pi, head);
      const bool ok = rho < total;  // rows past the end are zero-filled
      const int64_t off = ok ? row_offset[pi] + (head * D + ch * 8) : 0;
      const uint32_t dst = (ch / 8) * C::kTileBytes + mma::SwizzledOffset<64>(r, ch % 8) + buf * C::kRowsBytes;
      mma::CpAsync16(base + C::kQ + dst, q + off, ok);
      mma::CpAsync16(base + C::kDo + dst, dout + off, ok);
    }
    if (tid < kR) {
      const int rho = r0 + tid;
      int pi, head;
      by_hq.DivMod(rho, pi, head);
      const bool ok = rho < total;
      const int t = ok ? pos[pi] : -1;
      const int64_t row = ok ? row_offset[pi] / D + head : 0;
      float4& m = meta[buf * kR + tid];
      mma::CpAsync4(&m.x, lse + row, ok);
      mma::CpAsync4(&m.y, delta + row, ok);
      m.z = __int_as_float(t);  // read after the step's barrier
    }
    mma::CpAsyncCommit();
  };

  const float scale_log2 = scale * kLog2e;
  const uint32_t ktile = base + C::kK, vtile = base + C::kV;
  // The tiles' descriptors, worked out once; a product's buffer and step are an Advance.
  const uint64_t k_rows = wgmma::KMajorTile(ktile), v_rows = wgmma::KMajorTile(vtile);
  const uint64_t q_rows = wgmma::KMajorTile(base + C::kQ), do_rows = wgmma::KMajorTile(base + C::kDo);
  const uint64_t q_cols = wgmma::MnMajorTile(base + C::kQ), do_cols = wgmma::MnMajorTile(base + C::kDo);
  const uint64_t k_cols = wgmma::MnMajorTile(ktile), ds_cols = wgmma::MnMajorTile(base + C::kDs);
  // This thread's accumulator rows of S^T, dP^T, dK and dV are keys key_lo + g and + 8 of the
  // block; those of dQ are the step's rows key_lo + g and + 8.
  const int key_lo = 16 * wg_warp;

  // dQ = dS K for columns 64 h .. 64 h + 63. Issued and committed (one group).
  const auto issue_dq = [&](float (&dq)[8][4], int ds, int h) {
    wgmma::Fence();
    const uint32_t ds_off = ds * C::kTileBytes, k_off = h * C::kTileBytes;
    wgmma::MmaM64N64K16Smem<kBf16, true, true, true>(dq, wgmma::Advance(ds_cols, ds_off), wgmma::Advance(k_cols, k_off));
#pragma unroll
    for (int kk = 1; kk < 4; ++kk) {
      const uint32_t step = wgmma::kMnMajorStepBytes * kk;
      wgmma::MmaM64N64K16Smem<kBf16, true, true>(dq, wgmma::Advance(ds_cols, ds_off + step),
                                                 wgmma::Advance(k_cols, k_off + step));
    }
    wgmma::Commit();
  };
  // The finished dQ columns of issue_dq, added into dq_acc.
  const auto add_dq = [&](float (&dq)[8][4], const float4* m, int r0, int h) {
    wgmma::FenceRegisters(dq);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = key_lo + g + 8 * i;
      int pi, head;
      by_hq.DivMod(r0 + row, pi, head);
      const int t = __float_as_int(m[row].z);  // -1 past the end
      const int64_t dq_row = t >= 0 ? row_offset[pi] + head * D : 0;
      AtomicAddRowQuads(dq_acc + dq_row + 64 * h, dq, i, scale, t >= 0, lane);
    }
  };

  if constexpr (C::kSplit) {
    if (threadIdx.x >= C::kGroupThreads) {
      // The dQ warpgroup. Step i: stage step i + 2's rows into the buffer of step i - 1 once
      // the score warpgroup is done with it; publish step i + 1's rows; then dQ of step i
      // from dS^T tile i % 2, handing the tile back before the adds.
      wgmma::RegDealloc<C::kDqRegs>();
      const int tid = threadIdx.x - C::kGroupThreads;
      stage_keys(tid);
      stage(0, 0, tid);
      if (kR < total) {
        stage(kR, 1, tid);
        mma::CpAsyncWait<1>();
      } else {
        mma::CpAsyncWait<0>();
      }
      wgmma::FenceProxyAsync();  // this thread's copies, visible to the tensor cores
      wgmma::BarArrive(C::kRowsReady, C::kThreads);
      for (int r0 = 0, i = 0; r0 < total; r0 += kR, ++i) {
        if (r0 + 2 * kR < total) {
          if (i >= 1) wgmma::BarSync(C::kRowsFree + (i + 2) % 3, C::kThreads);
          stage(r0 + 2 * kR, (i + 2) % 3, tid);
        }
        if (r0 + kR < total) {
          if (r0 + 2 * kR < total) {
            mma::CpAsyncWait<1>();
          } else {
            mma::CpAsyncWait<0>();
          }
          wgmma::FenceProxyAsync();
          wgmma::BarArrive(C::kRowsReady + (i + 1) % 3, C::kThreads);
        }
        if constexpr (kFusedDq) {
          const int ds = i & 1;
          wgmma::BarSync(C::kDsReady + ds, C::kThreads);
          float dq[8][4];
          issue_dq(dq, ds, 0);
          wgmma::Wait<0>();
          if (r0 + 2 * kR < total) wgmma::BarArrive(C::kDsFree + ds, C::kThreads);  // dS^T of step i + 2
          add_dq(dq, meta + (i % 3) * kR, r0, 0);
        }
      }
      return;
    }
    wgmma::RegAlloc<C::kScoreRegs>();
  } else {
    stage_keys(threadIdx.x);
  }

  // The score warpgroup (or the whole CTA at D = 128). The policy's Allowed(t, key) is the
  // whole mask. Padding keys are INT_MAX, so key <= t (which every policy's mask includes)
  // fails for them, as for rows past the end (t = -1).
  int key_cut[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int kr = key_lo + g + 8 * half;
    key_cut[half] = kr < w.keys.count ? w.keys.start + kr : INT_MAX;
  }
  float dk[kHalves][8][4], dv[kHalves][8][4];  // columns 64 h .. 64 h + 63 of the keys' rows
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[h][i][e] = dv[h][i][e] = 0.f;
    }
  }

  // The phases of a step over the rows staged in buffer buf; the schedules below order them.
  float st[8][4], dpt[8][4];
  // S^T = K Q^T and dP^T = V dO^T, issued and committed (one group).
  const auto issue_scores = [&](int buf) {
    wgmma::Fence();
    RowsTimesRowsT<kBf16, kHalves>(st, k_rows, wgmma::Advance(q_rows, buf * C::kRowsBytes));
    RowsTimesRowsT<kBf16, kHalves>(dpt, v_rows, wgmma::Advance(do_rows, buf * C::kRowsBytes));
    wgmma::Commit();
  };
  uint32_t pf[4][4], dsf[4][4];  // k16 step kk = query rows 16 kk .. 16 kk + 15
  // P^T and dS^T from the finished S^T and dP^T, packed into A fragments. Accumulator
  // element [j][2 half + e]: key row half, query row 8 j + 2 c + e of the step. Written to
  // new registers, not over the accumulators: ptxas serialises the warpgroup MMAs where
  // ordinary instructions write a product's accumulators (C7515). kMasked: the policy's mask
  // per element; without, for a step where every row sees every key of the block.
  const auto probabilities = [&](const float4* m, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    wgmma::FenceRegisters(st);
    wgmma::FenceRegisters(dpt);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      float p[2][4], ds[2][4];
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const int j = 2 * kk + jj;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float4 mr = m[8 * j + 2 * (lane & 3) + e];
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const bool seen = !kMasked || pol.Allowed(s, __float_as_int(mr.z), key_cut[half]);
            const float pe = seen ? mma::Exp2(st[j][2 * half + e] * scale_log2 - mr.x) : 0.f;
            p[jj][2 * half + e] = pe;
            ds[jj][2 * half + e] = pe * (dpt[j][2 * half + e] - mr.y);
          }
        }
      }
      mma::PackA<kBf16>(pf[kk], p[0], p[1]);
      mma::PackA<kBf16>(dsf[kk], ds[0], ds[1]);
    }
  };
  // Rows of a step are in position order, except where an item's positions wrap around (the
  // window's in-phase order, WindowKeyPolicy::Query), so a whole step of rows (every row
  // valid) whose first position is not after its last sees the whole block (all 64 keys)
  // where those two positions do.
  const auto probabilities_of_step = [&](const float4* m, int r0) {
    const int t_first = __float_as_int(m[0].z), t_last = __float_as_int(m[kR - 1].z);
    const bool whole =
        w.keys.count == 64 && r0 + kR <= total && t_first <= t_last && pol.AllowsAll(t_first, t_last, w.keys);
    if (whole) {
      probabilities(m, std::false_type{});
    } else {
      probabilities(m, std::true_type{});
    }
  };
  // dV += P^T dO and dK += dS^T Q, issued and committed (one group).
  const auto issue_dkdv = [&](int buf) {
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      wgmma::FenceRegisters(dv[h]);
      wgmma::FenceRegisters(dk[h]);
    }
    wgmma::Fence();
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const uint32_t off = buf * C::kRowsBytes + h * C::kTileBytes;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma::MmaM64N64K16<kBf16, true>(dv[h], pf[kk], wgmma::Advance(do_cols, off + wgmma::kMnMajorStepBytes * kk));
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma::MmaM64N64K16<kBf16, true>(dk[h], dsf[kk], wgmma::Advance(q_cols, off + wgmma::kMnMajorStepBytes * kk));
      }
    }
    wgmma::Commit();
  };
  // dS^T into dS tile ds: key row kr holds the step's 64 query rows, 8 per swizzled 16-byte
  // chunk; dsf[kk][i] is key 16 warp + g + 8 (i & 1), rows 16 kk + 8 (i >> 1) + 2c and + 1.
  // Published by the caller's barrier.
  const auto write_ds = [&](int ds) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int kr = key_lo + g + 8 * (i & 1), row = 16 * kk + 8 * (i >> 1) + 2 * (lane & 3);
        *reinterpret_cast<uint32_t*>(gbase + C::kDs + ds * C::kTileBytes + mma::SwizzledOffset<64>(kr, row / 8) +
                                     2 * (row % 8)) = dsf[kk][i];
      }
    }
    wgmma::FenceProxyAsync();
  };

  if constexpr (C::kSplit) {
    // Step i: wait S^T, dP^T (i); P^T, dS^T; issue dV/dK (i); dS^T (i) -> tile i % 2 once dQ
    // of step i - 2 is done with it, handed to the dQ warpgroup; issue S^T, dP^T (i + 1) once
    // its rows are staged; wait dV/dK (i); hand buffer i % 3 back for step i + 3's rows.
    wgmma::BarSync(C::kRowsReady, C::kThreads);
    issue_scores(0);
    for (int r0 = 0, i = 0; r0 < total; r0 += kR, ++i) {
      const int buf = i % 3;
      wgmma::Wait<0>();
      probabilities_of_step(meta + buf * kR, r0);
      issue_dkdv(buf);
      if constexpr (kFusedDq) {
        const int ds = i & 1;
        if (i >= 2) wgmma::BarSync(C::kDsFree + ds, C::kThreads);
        write_ds(ds);
        wgmma::BarArrive(C::kDsReady + ds, C::kThreads);
      }
      if (r0 + kR < total) {
        wgmma::BarSync(C::kRowsReady + (i + 1) % 3, C::kThreads);
        issue_scores((i + 1) % 3);
        wgmma::Wait<1>();
      } else {
        wgmma::Wait<0>();
      }
      if (r0 + 3 * kR < total) wgmma::BarArrive(C::kRowsFree + buf, C::kThreads);
    }
    wgmma::Wait<0>();  // a no-op (the last step waited for everything), which ptxas cannot see
  } else {
    const auto stage_all = [&](int r0, int buf) { stage(r0, buf, threadIdx.x); };
    stage_all(0, 0);
    for (int r0 = 0, buf = 0; r0 < total; r0 += kR, buf ^= 1) {
      mma::StageNextAndWait(r0, kR, total, buf, stage_all);
      wgmma::FenceProxyAsync();  // this thread's copies, visible to the tensor cores after the barrier
      __syncthreads();
      const float4* m = meta + buf * kR;
      issue_scores(buf);
      wgmma::Wait<0>();
      probabilities_of_step(m, r0);
      issue_dkdv(buf);
      if constexpr (kFusedDq) {
        write_ds(0);  // while dV and dK run
        __syncthreads();  // the whole dS^T tile is written
        // One 64-column half of dQ at a time (its accumulators are then free for the next).
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
          float dq[8][4];
          issue_dq(dq, 0, h);
          wgmma::Wait<0>();
          add_dq(dq, m, r0, h);
        }
      } else {
        wgmma::Wait<0>();
      }
      __syncthreads();  // every product of this step is done with buf's tiles and the dS^T tile
    }
  }
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    wgmma::FenceRegisters(dv[h]);
    wgmma::FenceRegisters(dk[h]);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int kr = key_lo + g + 8 * half;
    const bool ok = kr < w.keys.count;  // per lane: the exchange needs every lane
    const int64_t off = ok ? KeyOffset(s, w.b, w.keys.start + kr, w.g) : 0;
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      if constexpr (CanStoreRows<KeyPolicy>::value) {
        if (pol.dk_out != nullptr) {
          StoreRowQuads(static_cast<scalar_t*>(pol.dk_out) + off + 64 * h, dk[h], half, scale, ok, lane);
          StoreRowQuads(static_cast<scalar_t*>(pol.dv_out) + off + 64 * h, dv[h], half, 1.f, ok, lane);
          continue;
        }
      }
      AtomicAddRowQuads(dk_acc + off + 64 * h, dk[h], half, scale, ok, lane);
      AtomicAddRowQuads(dv_acc + off + 64 * h, dv[h], half, 1.f, ok, lane);
    }
  }
}

}  // namespace nsad::nsa::cuda::detail::dkdv_wgmma
