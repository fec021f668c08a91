// One gradient buffer for the column slices of one GEMM output.
//
// The attention's joint input projection (model/shared_input_linear.h) is one GEMM whose
// output [rows, 1728] (m7c) is read as three column slices by three ops: q by the attention,
// kv by RoPE, the gate MLP's hidden layer by silu. Each op's backward used to return its
// slice's gradient as a tensor of its own, and the GEMM's backward then ran one dx GEMM and one
// dW GEMM per slice (six, two of them accumulating, four with split-K reductions). Where the
// three ops write their gradients into adjacent column slices of one buffer instead, the GEMM's
// backward finds them as one [rows, 1728] matrix and runs one dx GEMM and one dW GEMM.
//
// Header-only: the kernels' autograd nodes (kernels/) and the model (engine/src) both use it.
#pragma once

#include <torch/torch.h>

#include <utility>
#include <vector>

namespace nsad::nsa {

// The buffer [rows, sum of widths] and the parts' column offsets. Allocated when the first
// part is handed out (in the backward, on the stream it runs on: it lives only as long as the
// gradients do, not from the forward on); once every part is handed out this holder lets go of
// it, so the slices alone keep it alive (a part never asked for leaves it with the holder, until
// the graph's nodes that hold the holder are freed: give parts only to ops that will take them).
// A second backward (retain_graph) gets a new buffer.
class SharedGradient : public torch::CustomClassHolder {
 public:
  SharedGradient(int64_t rows, std::vector<int64_t> widths, torch::TensorOptions options)
      : rows_(rows), widths_(std::move(widths)), options_(options) {
    int64_t offset = 0;
    for (const int64_t w : widths_) {
      offsets_.push_back(offset);
      offset += w;
    }
    width_ = offset;
  }

  // Part p's slice [rows, widths[p]] (row stride: the sum of the widths).
  torch::Tensor Part(size_t p) {
    TORCH_CHECK(p < widths_.size(), "SharedGradient has ", widths_.size(), " parts, asked for part ", p);
    if (!buffer_.defined()) {
      buffer_ = torch::empty({rows_, width_}, options_);
      handed_out_ = 0;
    }
    auto part = buffer_.narrow(1, offsets_[p], widths_[p]);
    if (++handed_out_ == widths_.size()) buffer_ = torch::Tensor();
    return part;
  }

 private:
  int64_t rows_, width_ = 0;
  std::vector<int64_t> widths_, offsets_;
  torch::TensorOptions options_;
  torch::Tensor buffer_;
  size_t handed_out_ = 0;
};

// Where an op's backward writes the gradient of one input: part `index` of `shared`, or, with
// no shared gradient, a tensor of the op's own. An autograd node keeps it in its saved data
// (ToSaved / FromSaved).
struct GradientPart {
  c10::intrusive_ptr<SharedGradient> shared;
  size_t index = 0;

  bool defined() const { return shared.defined(); }
  // The part viewed as the input's shape `sizes` ([.., widths[index]] with the rows in front),
  // or an undefined tensor when there is no shared gradient.
  torch::Tensor Take(at::IntArrayRef sizes) const {
    if (!defined()) return {};
    return shared->Part(index).view(sizes);
  }

  c10::IValue ToSaved() const {
    if (!defined()) return c10::IValue();
    return c10::ivalue::Tuple::create({c10::IValue::make_capsule(shared), static_cast<int64_t>(index)});
  }
  static GradientPart FromSaved(const c10::IValue& saved) {
    GradientPart part;
    if (!saved.isTuple()) return part;
    const auto& items = saved.toTupleRef().elements();
    part.shared = c10::static_intrusive_pointer_cast<SharedGradient>(items[0].toCapsule());
    part.index = static_cast<size_t>(items[1].toInt());
    return part;
  }
};

// Gradients that one op's backward hands to the backward of the op that produced its inputs,
// past autograd, in a dtype autograd would not let through: autograd rounds a gradient to its
// input's dtype in a pass of its own. The selected branch's dK and dV are float32 sums (its
// kernel adds them with atomics) of bf16 inputs that RoPE's split of the kv projection produced;
// handed over here, RoPE's backward reads the float32 sums and rounds them once as it writes
// the projection's gradient (two passes fewer: 2 x ~10.5 us per layer at m7c batch 16 on an
// H100). The consumer puts the gradient of the producer's output `slot` and returns an
// undefined gradient for that input; autograd runs the producer's backward after it (it waits
// for every consumer of its outputs), which takes it where autograd's gradient is undefined.
// Slots never put stay empty: the producer then uses what autograd gave (or zeros).
// A consumer hands over only an input the producer recorded as its slot's output (Produced):
// a gradient put where no producer will take it would be lost. For tensors internal to a
// module only: autograd itself never sees a handed-over gradient, so torch::autograd::grad
// asked for that intermediate tensor would get none.
class GradientHandoff : public torch::CustomClassHolder {
 public:
  explicit GradientHandoff(size_t slots) : slots_(slots), outputs_(slots) {}
  size_t size() const { return slots_.size(); }

  // The producer, after its forward: `output` is what it returned for `slot`.
  void RecordOutput(size_t slot, const torch::Tensor& output) {
    TORCH_CHECK(slot < outputs_.size(), "GradientHandoff has ", outputs_.size(), " slots, recorded slot ", slot);
    outputs_[slot] = {output.grad_fn().get(), output.output_nr()};
  }
  // Whether `input` is the output the producer recorded for `slot` (the same autograd node and
  // output index), so that the producer's backward will take its gradient.
  bool Produced(size_t slot, const torch::Tensor& input) const {
    if (slot >= outputs_.size() || outputs_[slot].node == nullptr || !input.defined()) return false;
    return input.grad_fn().get() == outputs_[slot].node && input.output_nr() == outputs_[slot].output_nr;
  }
  void Put(size_t slot, torch::Tensor gradient) {
    TORCH_CHECK(slot < slots_.size(), "GradientHandoff has ", slots_.size(), " slots, put into slot ", slot);
    slots_[slot] = std::move(gradient);
  }
  // The gradient put into `slot` (undefined if none); the slot is empty afterwards.
  torch::Tensor Take(size_t slot) {
    TORCH_CHECK(slot < slots_.size(), "GradientHandoff has ", slots_.size(), " slots, took slot ", slot);
    return std::exchange(slots_[slot], torch::Tensor());
  }

  // Kept in an autograd node's saved data (nothing for a null one), and found there again.
  static c10::IValue ToSaved(const c10::intrusive_ptr<GradientHandoff>& h) {
    return h ? c10::IValue::make_capsule(h) : c10::IValue();
  }
  static c10::intrusive_ptr<GradientHandoff> FromSaved(const c10::IValue& saved) {
    if (!saved.isCapsule()) return {};
    return c10::static_intrusive_pointer_cast<GradientHandoff>(saved.toCapsule());
  }

 private:
  struct Output {
    const torch::autograd::Node* node = nullptr;
    int64_t output_nr = 0;
  };
  std::vector<torch::Tensor> slots_;
  std::vector<Output> outputs_;
};

// Slot `index` of a handoff: where a consumer's backward puts one input's gradient.
struct HandoffSlot {
  c10::intrusive_ptr<GradientHandoff> to;
  size_t index = 0;
  // Whether the gradient of `input` can be handed over here (the handoff's producer made it).
  bool Takes(const torch::Tensor& input) const { return to.defined() && to->Produced(index, input); }
};

// One part per column slice of a joint output whose slices are `parts` (each [.., width_i],
// the same leading sizes): the parts of one new SharedGradient in the slices' dtype and device.
inline std::vector<GradientPart> SharedGradientParts(const std::vector<torch::Tensor>& parts) {
  std::vector<int64_t> widths;
  for (const auto& p : parts) widths.push_back(p.size(-1));
  const int64_t rows = parts.empty() || widths[0] == 0 ? 0 : parts[0].numel() / widths[0];
  auto shared = c10::make_intrusive<SharedGradient>(rows, widths, parts.empty() ? torch::TensorOptions()
                                                                               : parts[0].options());
  std::vector<GradientPart> out;
  for (size_t i = 0; i < parts.size(); ++i) out.push_back({shared, i});
  return out;
}

}  // namespace nsad::nsa
