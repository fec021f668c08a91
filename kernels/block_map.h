// The block -> queries map of the key-centric selected-attention kernels (dK/dV, and the block
// forward of selected_block_forward.cuh), inverted on the GPU by block_map.cu.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace nsad::nsa::cuda::detail {

// Every entry of block_idx ([B,T,G,n] int32 flattened, e = ((b T + t) G + g) n + slot) grouped
// by its segment (b, g, block), in position order inside a segment, unused (-1) slots and
// repeats (a block its row listed in an earlier slot) last: a segment holds each position at
// most once. Each segment is cut into work items of at most queries_per_item entries.
struct BlockMap {
  at::Tensor sorted_entry;  // int32 [B T G n]
  at::Tensor seg_off;       // int64 [S+1]: first entry of each segment in sorted_entry
  at::Tensor chunk_off;     // int64 [S+1]: first work item of each segment
  at::Tensor item_seg;      // int32 [max_items]: the segment of each work item
  at::Tensor item_order;    // int32 [max_items]: items by the position of their first entry
                            // (position order), or undefined (block order)
  int64_t segments = 0;     // S = B G NS
  int64_t max_items = 0;    // an upper bound of chunk_off[S], known without a device sync
  int NS = 0, queries_per_item = 0;
};

// Where the entries that get no work item (an unused slot, a repeat, a local block left out,
// a block index past NS) are marked: rows_per_entry floats from lse + e rows_per_entry become
// -inf. The block forward's partial log-sum-exp rows: its combine then tells which entries
// count from them alone, without the block indices.
struct NoPartialMarks {
  float* lse = nullptr;  // null: nothing marked
  int rows_per_entry = 0;
};

// NS: selection blocks per sequence. skip_local_of > 0 leaves out the entries whose block is
// local to their position (IsLocalBlock with selection blocks of that many keys: the forward's
// tiled pass takes those, SelectedKernelChoice::Local); 0 keeps every entry. Runs on the
// current stream, no host sync (CUDA-graph capturable).
BlockMap InvertBlockMap(const at::Tensor& block_idx, int NS, int queries_per_item, bool position_order,
                        int skip_local_of = 0, NoPartialMarks marks = {});

}  // namespace nsad::nsa::cuda::detail
