// Which selected-attention (kernels/selected_attention.cu), compressed-attention
// (kernels/compressed_attention.cu), window-forward (kernels/window_attention.cu) and
// tiled-forward (kernels/smem_fwd_tile.cuh) kernels run: process-wide choices for tests and
// benchmarks only. kernels_test forces every path on every shape; nsa_bench --slc-fwd /
// --slc-dkdv / --slc-dq / --slc-qpc / --cmp-kernel / --win-fwd / --win-bwd / --win-qpc /
// --tiled-mma compares them in one binary (train_bench: --slc-fwd / --slc-dq / --slc-dkdv /
// --win-fwd / --win-bwd / --tiled-mma, and --gemm for the linear layers' GEMMs).
// Nothing else sets them, so training runs the default: everything kAuto, the dispatch
// measured in docs/PERFORMANCE.md. There is no environment switch: a forced choice is
// visible in the code that sets it.
//
// A forced choice that cannot run on a call (fp32 inputs, a D=64-only build at D=128, the
// rows kernel with top_n > 32, queries_per_item out of range) fails that call with a
// c10::Error instead of quietly running another kernel.
//
// Torch-free, so test and benchmark code can include it next to anything.
#pragma once

namespace nsad::nsa::cuda::detail {

// The most positions one dK/dV work item holds (its positions live in shared memory): the
// bounds of SelectedKernelChoice::queries_per_item and WindowKernelChoice::queries_per_item,
// and the kernels' compile-time sizes.
constexpr int kMaxSelectedQueriesPerItem = 512;
constexpr int kMaxWindowQueriesPerItem = 640;  // all of a block's positions for windows up to 577

struct SelectedKernelChoice {
  // Forward and dQ on tensor cores (bf16/fp16 inputs): per position, the group's heads as
  // the MMA rows (kHeads), or flattened (position, head) rows over the union of neighbours'
  // blocks (kRows, needs top_n <= 32). kTiled: the forward over shared-memory tiles of the
  // union of up to 32 positions' blocks (dQ then follows the auto rule). kBlocks: the forward
  // key-centric, one partial result per selected block, combined after (long sequences; dQ
  // follows the auto rule). fp32 inputs have one scalar kernel and take kAuto only.
  enum class Fwd { kAuto, kRows, kHeads, kTiled, kBlocks };
  // dK/dV on tensor cores: the staged kernel in one of its D=64 register budgets (rows per
  // step x CTAs per SM; the single D=128 build is 16x1), the same work on warpgroup MMAs
  // (kWgmma: D=64 or 128, an sm_90 device, kernels built for sm_90a;
  // selected_dkdv_wgmma.cuh), or the unstaged mma::DkDvMmaKernel (any D). kAuto takes
  // kWgmma where it runs, else 32x3 at D=64 and 16x1 at D=128. fp32 inputs take kAuto only.
  enum class DkDv { kAuto, kStaged16x3, kStaged32x1, kStaged32x3, kUnstaged, kWgmma };

  // Where dQ comes from: the query-side kernel of Fwd (kQuerySide), or the staged dK/dV
  // kernel, which has dS in registers already and adds dS K into a float32 buffer (kFused;
  // bf16/fp16, any staged DkDv build). kAuto: the measured default.
  enum class Dq { kAuto, kQuerySide, kFused };

  // Launch order of the key-centric work items (dK/dV and the kBlocks forward): by (b, g,
  // block) and slice (kBlock), or by the first position of each slice (kPosition), so that
  // the CTAs running together read and add into the same positions' Q, dO and dQ rows while
  // they are in L2. kAuto: the measured default.
  enum class Order { kAuto, kBlock, kPosition };

  // How the kBlocks forward's combine reads a row's partials: one block at a time (kOne) or
  // four blocks' loads in flight before merging them (kBatch4). kAuto: kBatch4, measured
  // faster (H200, 64k 12:2: 553 us a call against 659 for the former one-at-a-time kernel).
  enum class Combine { kAuto, kOne, kBatch4 };

  // Where the kBlocks forward computes a position's local blocks (block 0, its own and the
  // previous one: IsLocalBlock, launch_util.cuh), which every position of a block shares: in
  // the block kernel with the rest (kInBlocks: one partial each), or on a tiled pass over
  // neighbouring positions (kTiledPass: the tiled forward's kernel, one partial for the three,
  // which the combine starts from), or the same split with the pass on a kernel of its own
  // (kLocalKernel: one CTA per selection block's 64 positions, head_dim 64 or 128, 64-key
  // selection blocks, bf16/fp16 on an sm_90 device). kAuto: the measured default.
  enum class Local { kAuto, kInBlocks, kTiledPass, kLocalKernel };

  Fwd fwd = Fwd::kAuto;
  DkDv dkdv = DkDv::kAuto;
  Dq dq = Dq::kAuto;
  Order order = Order::kAuto;
  Combine combine = Combine::kAuto;
  Local local = Local::kAuto;
  // Queries per dK/dV work item (every dtype), and per work item of the kBlocks forward: 0 is
  // the measured default (256), else 1..kMaxSelectedQueriesPerItem (the kernels keep the
  // item's positions in shared memory).
  int queries_per_item = 0;
  // kBlocks forward: bytes of partial results per pass over whole batch elements; 0 is the
  // default (4 GiB). Tests set it small to run one batch element per pass.
  long long partial_bytes = 0;
};

// For tests and benchmarks only (see above). Thread-safe; read once per kernel call.
void SetSelectedKernelChoiceForTesting(const SelectedKernelChoice& choice);
SelectedKernelChoice GetSelectedKernelChoice();

// Compressed attention, bf16/fp16 inputs: kAuto runs long sequences (16k tokens and more) on
// cuDNN's causal attention over packed query rows (compressed_packed.cu), with the importance
// pass on our kernel, and shorter ones on the shared-memory (cp.async + ldmatrix) kernels
// wherever the geometry allows them, the register-only kernels elsewhere. kDense forces
// cuDNN, kOwn our kernels at every length (the "before" of A/B timings), kRegisters the
// register-only kernels (the fallback path). fp32 inputs always take the scalar kernels (a
// forced kDense fails on them). The shared-memory importance pass maps P onto selection
// blocks as a product with the overlap matrix W, or, in the paper's geometry (l = 2d,
// l' = 4d), with two shuffles per n8 tile (QuadMapRow; the kernels first add the heads of a
// position that a lane holds: all of them with up to 8 per group at head_dim 64, on warpgroup
// MMAs where they run (CmpImportanceLaneWgmmaKernel), else on mma.sync (CmpImportanceLaneKernel),
// and at 128 on warpgroup MMAs; else two or four with the lanes' rows staged in shared memory,
// so they need an even head count per group; an odd one takes the product); kProduct forces
// the product there too, kSlots the staged rows where the all-heads kernel would run,
// kLaneSync the all-heads kernel on mma.sync (head_dim 64; tests, A/B timing).
struct CompressedKernelChoice {
  enum class Path { kAuto, kOwn, kRegisters, kDense };
  enum class Map { kAuto, kProduct, kSlots, kLaneSync };
  // Our backward's dK/dV (bf16/fp16; dQ stays on the query-side kernel): kSmem the
  // shared-memory mma.sync kernel, kWgmma the selected branch's warpgroup-MMA kernel
  // (selected_dkdv_wgmma.cuh, sm_90a, head_dim 64 or 128) under the compressed mask, kAuto
  // kWgmma where it runs (measured, compressed_attention.cu).
  enum class KeySide { kAuto, kSmem, kWgmma };
  // The shared-memory forward and importance: kAuto runs them as one pass (CmpOnePassKernel)
  // where every compressed block fits two 64-key tiles at head_dim 64 in the paper's geometry,
  // kTwo always as two (the forward, then the importance from its lse).
  enum class Pass { kAuto, kTwo };
  Path path = Path::kAuto;
  Map map = Map::kAuto;
  KeySide key_side = KeySide::kAuto;
  Pass pass = Pass::kAuto;
};

void SetCompressedKernelChoiceForTesting(const CompressedKernelChoice& choice);
CompressedKernelChoice GetCompressedKernelChoice();

// Sliding-window attention, bf16/fp16. Forward: kTiled runs the tiled shared-memory kernel
// (window_attention.cu, head_dim 64 or 128), kFlash PyTorch's FlashAttention-2 forward with
// a window (the path before), kAuto the tiled kernel at head_dim 64 and FlashAttention-2
// otherwise (measured). Backward: kWgmma runs the key-centric warpgroup-MMA dK/dV kernel with
// fused dQ (selected_dkdv_wgmma.cuh, sm_90a, head_dim 64 or 128) over the window's key
// blocks, kFlash FlashAttention-2's windowed backward (the path before), kAuto kWgmma wherever
// it runs (head_dim 64 and 128, sm_90), FlashAttention-2 otherwise (measured). fp32 takes its
// own path (a forced kTiled or kWgmma fails there, as on other head dims or devices).
struct WindowKernelChoice {
  enum class Forward { kAuto, kFlash, kTiled };
  enum class Backward { kAuto, kFlash, kWgmma };
  Forward forward = Forward::kAuto;
  Backward backward = Backward::kAuto;
  // kWgmma backward: positions per work item (a 64-key block's slice of the positions that
  // attend it); 0 is the default (all of them where they fit kMaxWindowQueriesPerItem, else
  // 128), else 1..kMaxWindowQueriesPerItem.
  int queries_per_item = 0;
};

void SetWindowKernelChoiceForTesting(const WindowKernelChoice& choice);
WindowKernelChoice GetWindowKernelChoice();

// The matrix instructions of the tiled forward (smem_fwd_tile.cuh), which runs the selected
// branch's tiled forward and the sliding-window forward: kWgmma the warpgroup MMAs of
// TiledFwdWgmmaKernel (sm_90a, bf16/fp16, head_dim 64, and 128 with one warpgroup), kSync
// mma.sync (TiledFwdKernel, the path before). kAuto takes the one-warpgroup wgmma kernel
// wherever it can run: overlapped for the window forward and at head_dim 128, not for the
// selected forward at 64 (the walks' kOverlapByDefault).
struct TiledForwardChoice {
  // kWgmmaOneWarpgroup (auto's for the selected forward at D64): CTAs of one warpgroup (64
  // rows), four per SM (two at D128), each on its own barrier; kWgmma (D64 only): CTAs of two
  // (128 rows) that share each staged block but meet at every block's barrier (kept for A/B
  // timings; measured slower, docs/PERFORMANCE.md); kWgmmaOverlap (auto's elsewhere): one
  // warpgroup, each block's P V waited for after the next block's Q K^T went out (three K/V
  // stages).
  enum class Mma { kAuto, kSync, kWgmma, kWgmmaOneWarpgroup, kWgmmaOverlap };
  Mma mma = Mma::kAuto;
};

void SetTiledForwardChoiceForTesting(const TiledForwardChoice& choice);
TiledForwardChoice GetTiledForwardChoice();
// Whether the current device can run the warpgroup-MMA kernels (an sm_90 device, kernels
// built for sm_90a): where not, kWgmma fails every call it would apply to.
bool WgmmaRunsHere();

// Forces a choice for its lifetime and restores the previous one, also when a test
// assertion returns early.
template <typename Choice, Choice (*Get)(), void (*Set)(const Choice&)>
class ScopedKernelChoice {
 public:
  explicit ScopedKernelChoice(const Choice& choice) : previous_(Get()) { Set(choice); }
  ~ScopedKernelChoice() { Set(previous_); }
  ScopedKernelChoice(const ScopedKernelChoice&) = delete;
  ScopedKernelChoice& operator=(const ScopedKernelChoice&) = delete;

 private:
  Choice previous_;
};

using ScopedSelectedKernelChoice =
    ScopedKernelChoice<SelectedKernelChoice, &GetSelectedKernelChoice,
                       &SetSelectedKernelChoiceForTesting>;
using ScopedCompressedKernelChoice =
    ScopedKernelChoice<CompressedKernelChoice, &GetCompressedKernelChoice,
                       &SetCompressedKernelChoiceForTesting>;
using ScopedWindowKernelChoice =
    ScopedKernelChoice<WindowKernelChoice, &GetWindowKernelChoice, &SetWindowKernelChoiceForTesting>;
using ScopedTiledForwardChoice =
    ScopedKernelChoice<TiledForwardChoice, &GetTiledForwardChoice, &SetTiledForwardChoiceForTesting>;

// The linear layers' GEMMs (engine/src/model/shared_input_linear.cc): kCublas runs at::mm /
// addmm_ (cuBLAS's heuristic), kTuned cuBLASLt with the algorithm timed fastest for each
// shape on its first call outside a CUDA graph capture (tuned_gemm.h), kAuto kTuned
// (measured: docs/PERFORMANCE.md, thirtieth and thirty-first sessions).
struct GemmChoice {
  enum class Algo { kAuto, kCublas, kTuned };
  Algo algo = Algo::kAuto;
};

void SetGemmChoiceForTesting(const GemmChoice& choice);
GemmChoice GetGemmChoice();
using ScopedGemmChoice = ScopedKernelChoice<GemmChoice, &GetGemmChoice, &SetGemmChoiceForTesting>;

}  // namespace nsad::nsa::cuda::detail
