// Which parts of a RoPE split (RotateParts, cuda::ApplyRopeParts) come out in the compression's
// chunk layout, the layout CompressChunksTogether reads. Plain C++ with no includes: the kernels
// and the engine's dispatch both take it.
#pragma once

#include <cstdint>

namespace nsad::nsa {

// Parts [first, first + count) of x [B,T,P,M,D] come out as one tensor [count, B, chunks, M,
// len, D]: chunk c holds positions c len .. c len + len - 1, its M rows side by side, as the
// compression MLP's first GEMM reads its chunks of d = len tokens. Positions from chunks * len
// on are left out (the compression reads none of them; their gradient is zero). Why: the
// compression otherwise permuted each part into that layout and its gradient back (four
// copies of 7.5 us per layer of the m7c batch 16 step on an H100), where RoPE, which writes
// every part anyway, can write it there.
struct PartChunks {
  int first = 0, count = 0;
  int64_t len = 0, chunks = 0;
  bool Any() const { return count > 0; }
  bool Holds(int64_t part) const { return part >= first && part < first + count; }
  // Whether the named parts are among x's `parts` and the chunks within its `positions`.
  bool Fits(int64_t parts, int64_t positions) const {
    return first >= 0 && count > 0 && first + count <= parts && len > 0 && chunks >= 0 && chunks * len <= positions;
  }
};

}  // namespace nsad::nsa
