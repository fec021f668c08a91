// Small tensor operations that PyTorch runs slowly at the shapes of the training step, written
// so that they launch fast kernels on CUDA and plain ops elsewhere.
#pragma once

#include <torch/torch.h>

namespace nsad {

// Sum over the rows of g: [rows, n] -> [n], in g's dtype. On CUDA a product with a vector of
// ones: PyTorch's reduction over the outer dimension took 65 us for a [32768, 192] bf16
// gradient on an H100, the product 15 us with its ones and split-K reduction. (For the
// compression's [4064, 64] both took about 14 us, so that node keeps at::sum.)
torch::Tensor SumRows(const torch::Tensor& g);

// dst.copy_(src) for tensors of one dtype whose last dimension is contiguous, moving 8-byte
// words instead of elements where the last dimension's bytes allow it. A permuting copy
// of bf16 rows of 64 (the compression's chunks) ran at 0.55 TB/s element by element.
void CopyInWords(torch::Tensor dst, const torch::Tensor& src);

// The gradient of a weight that both the token embedding and the tied LM head read. The head's
// backward runs first and, given one of these (ApplyWeight, model/shared_input_linear.h), leaves
// its dW here instead of returning it; the embedding's backward (EmbeddingRows) adds its rows
// into that dW and returns the sum. The weight then gets one gradient: no [V, D] zero fill for
// the embedding's and no sum of the two [V, D] gradients by autograd (47 + 147 us per m7c batch
// 16 step on an H100). Only for an embedding that runs EmbeddingRows' own node
// (EmbeddingRowsTakesTied), which always runs after the head: nothing else would take the dW.
class TiedGradient : public torch::CustomClassHolder {
 public:
  torch::Tensor pending;  // the head's dW, until the embedding's backward takes it

  // Kept in an autograd node's saved data (nothing for a null one), and found there again
  // (null where none was saved).
  static void Save(torch::autograd::AutogradContext* ctx, const c10::intrusive_ptr<TiedGradient>& tied);
  static c10::intrusive_ptr<TiedGradient> Saved(torch::autograd::AutogradContext* ctx);
};

// at::embedding(weight, tokens): the rows of weight [V, D] the tokens name. On CUDA its
// backward adds each gradient row into its token's row with float atomics (the sums' order,
// and so their last bits, vary from run to run): 16 bytes per atomic in our kernel
// (cuda::detail::AddRowsAt) where the rows allow it, else index_add_, which took 0.19 ms for
// the m7c step's 32768 tokens on an H100 (PyTorch's embedding backward, which sorts the
// tokens, about 0.49 ms); it adds them into tied->pending where the head left its gradient
// there. Elsewhere PyTorch's own.
torch::Tensor EmbeddingRows(const torch::Tensor& weight, const torch::Tensor& tokens,
                            const c10::intrusive_ptr<TiedGradient>& tied = {});
// Whether EmbeddingRows(weight, ...) runs the node that takes a TiedGradient (CUDA, a weight
// that needs a gradient, grad mode on).
bool EmbeddingRowsTakesTied(const torch::Tensor& weight);

}  // namespace nsad
