// InvertBlockMap (block_map.h): two CUB radix sorts over only the key bits that can be set,
// one pass over the sorted keys for the segments' offsets, and one scan. It replaced a chain
// of ATen ops (where, sort over all 32 key bits with int64 indices, searchsorted, cumsum, cat,
// index_select: about 55 kernels per backward) that cost 0.40 ms of kernel time per backward
// at 64k D64 12:2 and 0.16 ms per layer at batch 16, T=2048 on an H100.
#include "block_map.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <climits>
#include <cmath>

#include "launch_util.cuh"
// After ATen's headers: it uses c10's macros without including them.
#include <ATen/cuda/detail/IntegerDivider.cuh>

namespace nsad::nsa::cuda::detail {
namespace {

// Sort keys: segment ids and positions, all >= 0, so unsigned keys sort the same.
using Key = unsigned int;

// Bits a radix sort must look at for keys in [0, max_key].
int KeyBits(uint64_t max_key) {
  int bits = 1;
  while (bits < 64 && (max_key >> bits) != 0) ++bits;
  return bits;
}

// Each entry's segment key (S for an unused slot or a block index past NS, for a block its row
// listed in an earlier slot: the selection is a set, as in the reference, so a segment holds
// each position at most once, and with skip_local_of > 0 for a block local to the position) and
// its own index as the sort value; marks' rows of every entry keyed S. 32-bit index maths
// through multiply-shift division (entries < 2^31): with 64-bit divisions the kernel took 10 us
// per call at batch 16, T=2048 on an H100, twice its memory time.
struct EntryDividers {
  at::cuda::detail::IntDivider<uint32_t> slots, groups, positions;  // n, G, T
};
__global__ void SegmentKeysKernel(const int* __restrict__ block_idx, Key* __restrict__ keys,
                                  int* __restrict__ values, uint32_t entries, EntryDividers div, int NS, Key S,
                                  int skip_local_of, NoPartialMarks marks) {
  for (uint32_t e = blockIdx.x * blockDim.x + threadIdx.x; e < entries; e += gridDim.x * blockDim.x) {
    const int blk = block_idx[e];
    const auto row_slot = div.slots.divmod(e);
    // The row's earlier slots: the same cache line, read by the row's neighbours too.
    const bool repeat = RepeatsEarlierSlot(block_idx + (e - row_slot.mod), static_cast<int>(row_slot.mod));
    const auto row_g = div.groups.divmod(row_slot.div);  // row = (b T + t) G + g
    const auto b_t = div.positions.divmod(row_g.div);
    const uint32_t b = b_t.div;
    const bool local = skip_local_of > 0 && IsLocalBlock(blk, static_cast<int>(b_t.mod), skip_local_of);
    const bool counts = blk >= 0 && blk < NS && !repeat && !local;
    keys[e] = counts ? static_cast<Key>((b * div.groups.divisor + row_g.mod) * NS + blk) : S;
    values[e] = static_cast<int>(e);
    if (marks.lse != nullptr && !counts) {
      float* const rows = marks.lse + static_cast<int64_t>(e) * marks.rows_per_entry;
      for (int r = 0; r < marks.rows_per_entry; ++r) rows[r] = -INFINITY;
    }
  }
}

// seg_off[s] = the first sorted entry whose key is >= s, for s in [0, S]: seg_off[S] is then
// the number of used entries. Sorted index i starts the segments s in (key[i-1], key[i]]
// (key[-1] = -1, key[entries] = S), so one pass over the sorted keys writes every seg_off[s]
// once. Counting the entries of each segment with atomics took 35 us per call at batch 16,
// T=2048 (every position before n l' selects block 0, so a few counters took most of the
// adds); a binary search per segment, 20 dependent loads deep, 10.8 us.
__global__ void SegmentOffsetsKernel(const Key* __restrict__ sorted_keys, int64_t entries,
                                     int64_t* __restrict__ seg_off, int64_t segments) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i <= entries;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t before = i > 0 ? static_cast<int64_t>(sorted_keys[i - 1]) : -1;
    const int64_t here = i < entries ? static_cast<int64_t>(sorted_keys[i]) : segments;
    for (int64_t s = before + 1; s <= here; ++s) seg_off[s] = i;
  }
}

// Work items per segment; the last element (index S) is 0 so that the exclusive scan's last
// output is the total.
__global__ void ItemCountsKernel(const int64_t* __restrict__ seg_off, int64_t* __restrict__ items,
                                 int64_t segments, int queries_per_item) {
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s <= segments;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    items[s] = s < segments ? (seg_off[s + 1] - seg_off[s] + queries_per_item - 1) / queries_per_item : 0;
  }
}

// Each work item's segment (the last s with chunk_off[s] <= item, a binary search), and for
// position order the sort key (b T + t of the item's first entry; items past the last one
// sort last) and value (the item).
__global__ void ItemSegmentsKernel(const int64_t* __restrict__ chunk_off, const int64_t* __restrict__ seg_off,
                                   const int* __restrict__ sorted_entry, int* __restrict__ item_seg,
                                   Key* __restrict__ order_keys, int* __restrict__ order_values,
                                   int64_t max_items, int64_t segments, int queries_per_item,
                                   int per_position, Key past_end) {
  const int64_t total = chunk_off[segments];
  for (int64_t item = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; item < max_items;
       item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t seg = 0;
    Key key = past_end;
    if (item < total) {
      int64_t lo = 0, hi = segments;  // chunk_off[lo] <= item < chunk_off[hi]
      while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (chunk_off[mid] <= item) lo = mid; else hi = mid;
      }
      seg = lo;
      const int64_t first = seg_off[seg] + (item - chunk_off[seg]) * queries_per_item;
      key = static_cast<Key>(sorted_entry[first] / per_position);
    }
    item_seg[item] = static_cast<int>(seg);
    if (order_keys != nullptr) {
      order_keys[item] = key;
      order_values[item] = static_cast<int>(item);
    }
  }
}

at::Tensor TempBytes(size_t bytes, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, like.options().dtype(at::kByte));
}

// Stable sort of (keys, values) pairs on key bits [0, bits): values_out gets the values in key
// order.
void SortPairs(const Key* keys_in, Key* keys_out, const int* values_in, int* values_out, int64_t count,
               int bits, const at::Tensor& like, cudaStream_t stream) {
  size_t bytes = 0;
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, keys_in, keys_out, values_in, values_out,
                                                 count, 0, bits, stream));
  auto temp = TempBytes(bytes, like);
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data_ptr(), bytes, keys_in, keys_out, values_in,
                                                 values_out, count, 0, bits, stream));
}

void ExclusiveSum(const int64_t* in, int64_t* out, int64_t count, const at::Tensor& like, cudaStream_t stream) {
  size_t bytes = 0;
  C10_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, bytes, in, out, count, stream));
  auto temp = TempBytes(bytes, like);
  C10_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp.data_ptr(), bytes, in, out, count, stream));
}

}  // namespace

BlockMap InvertBlockMap(const at::Tensor& block_idx, int NS, int queries_per_item, bool position_order,
                        int skip_local_of, NoPartialMarks marks) {
  TORCH_CHECK(block_idx.is_cuda() && block_idx.dim() == 4 && block_idx.scalar_type() == at::kInt &&
                  block_idx.is_contiguous(),
              "InvertBlockMap takes block_idx [B,T,G,n] int32, contiguous, on the GPU");
  TORCH_CHECK(block_idx.numel() < INT_MAX, "selected attention: B*T*G*top_n must stay below 2^31, got ",
              block_idx.numel());
  TORCH_CHECK(queries_per_item > 0, "InvertBlockMap: queries_per_item must be positive");
  const int64_t B = block_idx.size(0), T = block_idx.size(1), G = block_idx.size(2), n = block_idx.size(3);
  const int64_t entries = block_idx.numel();
  const int64_t S = B * G * NS;
  TORCH_CHECK(S < UINT_MAX && B * T < UINT_MAX, "InvertBlockMap: B*G*NS and B*T must fit in 32 bits");
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto iopts = block_idx.options();
  const auto lopts = iopts.dtype(at::kLong);

  BlockMap map;
  map.NS = NS;
  map.queries_per_item = queries_per_item;
  map.segments = S;
  map.max_items = S + entries / queries_per_item + 1;  // >= chunk_off[S]
  TORCH_CHECK(map.max_items < INT_MAX, "InvertBlockMap: more than 2^31 work items");

  auto keys = at::empty({entries}, iopts), sorted_keys = at::empty({entries}, iopts);
  auto values = at::empty({entries}, iopts);
  map.sorted_entry = at::empty({entries}, iopts);
  auto* key_ptr = reinterpret_cast<Key*>(keys.data_ptr<int>());
  auto* sorted_key_ptr = reinterpret_cast<Key*>(sorted_keys.data_ptr<int>());
  if (entries > 0) {
    const EntryDividers div{at::cuda::detail::IntDivider<uint32_t>(static_cast<uint32_t>(n)),
                            at::cuda::detail::IntDivider<uint32_t>(static_cast<uint32_t>(G)),
                            at::cuda::detail::IntDivider<uint32_t>(static_cast<uint32_t>(T))};
    SegmentKeysKernel<<<GridStride(entries), kThreads, 0, stream>>>(block_idx.data_ptr<int>(), key_ptr,
                                                                     values.data_ptr<int>(),
                                                                     static_cast<uint32_t>(entries), div, NS,
                                                                     static_cast<Key>(S), skip_local_of, marks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    SortPairs(key_ptr, sorted_key_ptr, values.data_ptr<int>(), map.sorted_entry.data_ptr<int>(), entries,
              KeyBits(static_cast<uint64_t>(S)), block_idx, stream);
  }
  map.seg_off = at::empty({S + 1}, lopts);
  SegmentOffsetsKernel<<<GridStride(entries + 1), kThreads, 0, stream>>>(sorted_key_ptr, entries,
                                                                          map.seg_off.data_ptr<int64_t>(), S);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto items = at::empty({S + 1}, lopts);
  ItemCountsKernel<<<GridStride(S + 1), kThreads, 0, stream>>>(map.seg_off.data_ptr<int64_t>(),
                                                                items.data_ptr<int64_t>(), S, queries_per_item);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  map.chunk_off = at::empty({S + 1}, lopts);
  ExclusiveSum(items.data_ptr<int64_t>(), map.chunk_off.data_ptr<int64_t>(), S + 1, block_idx, stream);

  map.item_seg = at::empty({map.max_items}, iopts);
  const bool order = position_order && entries > 0;
  at::Tensor order_keys, order_values;
  if (order) {
    order_keys = at::empty({map.max_items}, iopts);
    order_values = at::empty({map.max_items}, iopts);
  }
  const Key past_end = static_cast<Key>(B * T);
  ItemSegmentsKernel<<<GridStride(map.max_items), kThreads, 0, stream>>>(
      map.chunk_off.data_ptr<int64_t>(), map.seg_off.data_ptr<int64_t>(), map.sorted_entry.data_ptr<int>(),
      map.item_seg.data_ptr<int>(), order ? reinterpret_cast<Key*>(order_keys.data_ptr<int>()) : nullptr,
      order ? order_values.data_ptr<int>() : nullptr, map.max_items, S, queries_per_item,
      static_cast<int>(G * n), past_end);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (order) {
    map.item_order = at::empty({map.max_items}, iopts);
    // The sorted keys are not needed: the entry keys' buffer takes them when it is large enough.
    const auto sorted_order_keys = map.max_items <= entries ? keys : at::empty({map.max_items}, iopts);
    SortPairs(reinterpret_cast<Key*>(order_keys.data_ptr<int>()),
              reinterpret_cast<Key*>(sorted_order_keys.data_ptr<int>()), order_values.data_ptr<int>(),
              map.item_order.data_ptr<int>(), map.max_items, KeyBits(static_cast<uint64_t>(past_end)), block_idx,
              stream);
  }
  return map;
}

}  // namespace nsad::nsa::cuda::detail
