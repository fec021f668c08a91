#include "nsa/compress.h"

#include <c10/core/impl/LocalDispatchKeySet.h>

#include "model/row_ops.h"
#include "model/shared_input_linear.h"

namespace nsad::nsa {
namespace {

// Block j = tokens [j d, j d + l) with the position encoding added, flattened, through first.
torch::Tensor HiddenByUnfolding(const torch::Tensor& tokens, const torch::Tensor& position_encoding,
                                const torch::nn::Linear& first, const Geometry& g, int64_t N) {
  const int64_t B = tokens.size(0), G = tokens.size(2), D = tokens.size(3), l = g.cmp_block;
  // unfold gives [B,N,G,D,l]; put the l tokens before D.
  const auto blocks = tokens.unfold(1, l, g.cmp_stride).transpose(-1, -2);
  const auto with_position = blocks + position_encoding.to(blocks.scalar_type());
  return ApplyLinear(first, with_position.reshape({B, N, G, l * D}));
}

// The same for l = r d: chunk c = tokens [c d, c d + d), Y[c] = chunk c times each of W1's r
// column slices (one GEMM), hidden[j] = sum_i Y[j + i] (slice i) + b1 + W1 flatten(pos).
torch::Tensor HiddenByChunks(const torch::Tensor& tokens, const torch::Tensor& position_encoding,
                             const torch::nn::Linear& first, const Geometry& g, int64_t N) {
  const int64_t B = tokens.size(0), G = tokens.size(2), D = tokens.size(3);
  const int64_t d = g.cmp_stride, r = g.cmp_block / g.cmp_stride, chunks = N + r - 1;
  const auto& w = first->weight;  // [hidden, l*D], columns (token of the block, feature)
  const int64_t hidden = w.size(0);
  const auto chunked = tokens.narrow(1, 0, chunks * d)
                           .view({B, chunks, d, G, D})
                           .permute({0, 1, 3, 2, 4})
                           .reshape({B, chunks, G, d * D});
  const auto slices = w.view({hidden, r, d * D}).transpose(0, 1).reshape({r * hidden, d * D});
  const auto y = at::linear(chunked, slices);  // [B, chunks, G, r*hidden]
  auto sum = y.narrow(1, 0, N).narrow(3, 0, hidden);
  for (int64_t i = 1; i < r; ++i) sum = sum + y.narrow(1, i, N).narrow(3, i * hidden, hidden);
  auto bias = at::mv(w, position_encoding.reshape({-1}).to(w.scalar_type()));
  if (first->bias.defined()) bias = bias + first->bias;
  // In the GEMM's dtype: a float32 bias would promote a bf16 (autocast) hidden layer.
  return sum + bias.to(sum.scalar_type());
}

// The autograd node of CompressBlocksTogether. Inputs: the P token tensors [B,T,G,D], then
// per compressor pos [l,D], W1 [h,l*D], b1 [h], W2 [D,h], b2 [D]. Shapes: M = B*chunks*G
// chunk rows, R = B*N*G block rows, dD = d*D.
//
// Forward, per compressor (batched over P):
//   Xc [M,dD]       the tokens in chunks of d, rows (b, c, g)
//   Ws [r*h,dD]     W1's r column slices, slice i = W1[:, i dD : (i+1) dD]
//   Y = Xc Ws^T     [M, r*h]
//   H[b,j,g] = sum_i Y[b, j+i, g, slice i] + (W1 flatten(pos) + b1)
//   out = silu(H) W2^T + b2
// Backward: the transposes of the same products; dY is dH placed at each slice's shift (the
// rest zero), and W1's gradient gets the bias path's outer product dH-sum x flatten(pos).
class CompressTogetherFn : public torch::autograd::Function<CompressTogetherFn> {
 public:
  static constexpr int kParams = 5;  // pos, W1, b1, W2, b2

  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList in, int64_t P,
                                                int64_t l, int64_t d, int64_t compute_dtype) {
    // The GEMMs' dtype is chosen by the caller; autocast must not recast anything in here.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto ct = static_cast<at::ScalarType>(compute_dtype);
    const auto& x0 = in[0];
    const int64_t B = x0.size(0), T = x0.size(1), G = x0.size(2), D = x0.size(3);
    const int64_t r = l / d, N = (T - l) / d + 1, chunks = N + r - 1;
    const int64_t h = Param(in, P, 0, 1).size(0), dD = d * D, M = B * chunks * G, R = B * N * G;
    const auto opts = x0.options().dtype(ct);

    auto Xc = at::empty({P, B, chunks, G, d, D}, opts);
    auto Ws = at::empty({P, r, h, dD}, opts);
    auto W2c = at::empty({P, D, h}, opts);
    auto b2c = at::empty({P, 1, D}, opts);
    auto pos_bias = at::empty({P, h}, Param(in, P, 0, 1).options());
    for (int64_t p = 0; p < P; ++p) {
      CopyInWords(Xc[p], in[p].narrow(1, 0, chunks * d).view({B, chunks, d, G, D}).permute({0, 1, 3, 2, 4}).to(ct));
      Ws[p].copy_(Param(in, P, p, 1).view({h, r, dD}).transpose(0, 1));
      W2c[p].copy_(Param(in, P, p, 3));
      b2c[p][0].copy_(Param(in, P, p, 4));
      auto bias = pos_bias[p];
      at::addmv_out(bias, Param(in, P, p, 2), Param(in, P, p, 1), Param(in, P, p, 0).reshape({-1}));
    }
    const auto Y = at::bmm(Xc.view({P, M, dD}), Ws.view({P, r * h, dD}).transpose(1, 2))
                       .view({P, B, chunks, G, r, h});
    auto hidden = r == 1 ? Y.select(4, 0) : at::add(Y.select(4, 0).narrow(2, 0, N), Y.select(4, 1).narrow(2, 1, N));
    for (int64_t i = 2; i < r; ++i) hidden.add_(Y.select(4, i).narrow(2, i, N));
    hidden.add_(pos_bias.view({P, 1, 1, 1, h}));  // stays in ct
    const auto act = at::silu(hidden);
    const auto out = at::baddbmm(b2c, act.view({P, R, h}), W2c.transpose(1, 2));  // [P,R,D]

    torch::autograd::variable_list to_save = {Xc, Ws, hidden, act, W2c};
    for (int64_t p = 0; p < P; ++p) {
      to_save.push_back(Param(in, P, p, 0));  // pos and W1: the bias path's gradients
      to_save.push_back(Param(in, P, p, 1));
    }
    ctx->save_for_backward(to_save);
    ctx->saved_data["shape"] = std::vector<int64_t>{P, B, T, G, D, l, d, h};
    ctx->saved_data["token_dtype"] = static_cast<int64_t>(x0.scalar_type());
    torch::autograd::variable_list outs;
    for (int64_t p = 0; p < P; ++p) outs.push_back(out[p].view({B, N, G, D}));
    return outs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const auto &Xc = saved[0], &Ws = saved[1], &hidden = saved[2], &act = saved[3], &W2c = saved[4];
    const std::vector<torch::Tensor> params(saved.begin() + 5, saved.end());  // pos, W1 per compressor
    const auto s = ctx->saved_data["shape"].toIntVector();
    const int64_t P = s[0], B = s[1], T = s[2], G = s[3], D = s[4], l = s[5], d = s[6], h = s[7];
    const int64_t r = l / d, N = (T - l) / d + 1, chunks = N + r - 1, dD = d * D, M = B * chunks * G,
                  R = B * N * G;
    const auto ct = Xc.scalar_type();
    const auto pt = params[1].scalar_type();
    const auto token_dtype = static_cast<at::ScalarType>(ctx->saved_data["token_dtype"].toInt());

    std::vector<torch::Tensor> parts;
    for (int64_t p = 0; p < P; ++p) {
      parts.push_back(grads[p].defined() ? grads[p].reshape({R, D}).to(ct) : at::zeros({R, D}, Xc.options()));
    }
    const auto dout = at::stack(parts);                                             // [P,R,D]
    const auto dW2 = at::bmm(dout.transpose(1, 2), act.view({P, R, h})).to(pt);     // [P,D,h]
    const auto db2 = dout.sum(1, false, pt);                                        // [P,D]
    const auto dhidden = at::silu_backward(at::bmm(dout, W2c), hidden.view({P, R, h}));  // [P,R,h]
    const auto dbias = dhidden.sum(1, false, pt);                                   // [P,h] = db1
    auto dY = at::zeros({P, B, chunks, G, r, h}, Xc.options());
    const auto dh = dhidden.view({P, B, N, G, h});
    for (int64_t i = 0; i < r; ++i) CopyInWords(dY.select(4, i).narrow(2, i, N), dh);
    const auto dY_rows = dY.view({P, M, r * h});
    const auto dWs = at::bmm(dY_rows.transpose(1, 2), Xc.view({P, M, dD}));       // [P,r*h,dD]
    auto dW1 = at::empty({P, h, r, dD}, params[1].options());
    dW1.copy_(dWs.view({P, r, h, dD}).transpose(1, 2));
    const auto dXc = at::bmm(dY_rows, Ws.view({P, r * h, dD})).view({P, B, chunks, G, d, D});

    torch::autograd::variable_list out(P + P * kParams + 4);
    for (int64_t p = 0; p < P; ++p) {
      auto dx = at::empty({B, T, G, D}, Xc.options().dtype(token_dtype));
      CopyInWords(dx.narrow(1, 0, chunks * d).view({B, chunks, d, G, D}).permute({0, 1, 3, 2, 4}),
                  dXc[p].to(token_dtype));
      if (T > chunks * d) dx.narrow(1, chunks * d, T - chunks * d).zero_();
      out[p] = dx;
      const auto& pos = params[2 * p];
      const auto& W1 = params[2 * p + 1];
      auto dW1p = dW1[p].view({h, l * D});
      dW1p.addr_(dbias[p], pos.reshape({-1}));
      torch::Tensor* g = &out[P + p * kParams];
      g[0] = at::mv(W1.t(), dbias[p]).view({l, D});
      g[1] = dW1p;
      g[2] = dbias[p];
      g[3] = dW2[p];
      g[4] = db2[p];
    }
    return out;
  }

 private:
  // Parameter `which` (0 pos, 1 W1, 2 b1, 3 W2, 4 b2) of compressor p.
  static const torch::Tensor& Param(at::TensorList in, int64_t P, int64_t p, int which) {
    return in[P + p * kParams + which];
  }
};

}  // namespace

std::vector<torch::Tensor> CompressBlocksTogether(const std::vector<torch::Tensor>& tokens,
                                                  const std::vector<Compressor>& compressors,
                                                  const Geometry& g) {
  TORCH_CHECK(!tokens.empty() && tokens.size() == compressors.size(),
              "CompressBlocksTogether takes one compressor per token tensor");
  TORCH_CHECK(g.cmp_block % g.cmp_stride == 0, "CompressBlocksTogether needs a stride that divides the block length");
  const auto& x0 = tokens[0];
  TORCH_CHECK(x0.dim() == 4, "CompressBlocksTogether takes tokens [B,T,G,D], got ", x0.sizes());
  const int64_t B = x0.size(0), T = x0.size(1), G = x0.size(2), D = x0.size(3);
  const int64_t N = NumCmpBlocks(T, g);
  const auto compute = LinearComputeType(x0);  // as CompressBlocks' at::linear calls
  if (N == 0) {
    return std::vector<torch::Tensor>(tokens.size(), torch::zeros({B, 0, G, D}, x0.options().dtype(compute)));
  }
  torch::autograd::variable_list in;
  for (const auto& x : tokens) {
    TORCH_CHECK(x.sizes() == x0.sizes() && x.scalar_type() == x0.scalar_type(),
                "CompressBlocksTogether takes tokens of one shape and dtype");
    in.push_back(x.contiguous());
  }
  for (const auto& c : compressors) {
    TORCH_CHECK(c.first->bias.defined() && c.second->bias.defined(), "CompressBlocksTogether needs biases");
    TORCH_CHECK(c.first->weight.size(0) == compressors[0].first->weight.size(0),
                "CompressBlocksTogether takes compressors of one hidden width");
    in.insert(in.end(), {c.position_encoding, c.first->weight, c.first->bias, c.second->weight, c.second->bias});
  }
  // As a TensorList: autograd takes a list's tensors as inputs (a std::vector is not one).
  return CompressTogetherFn::apply(at::TensorList(in), static_cast<int64_t>(tokens.size()), g.cmp_block, g.cmp_stride,
                                   static_cast<int64_t>(compute));
}

torch::Tensor CompressBlocks(const torch::Tensor& tokens, const torch::Tensor& position_encoding,
                             const torch::nn::Linear& first, const torch::nn::Linear& second,
                             const Geometry& g) {
  TORCH_CHECK(tokens.dim() == 4, "CompressBlocks takes tokens [B,T,G,D], got ", tokens.sizes());
  const int64_t B = tokens.size(0), T = tokens.size(1), G = tokens.size(2), D = tokens.size(3);
  const int64_t N = NumCmpBlocks(T, g);
  if (N == 0) return torch::zeros({B, 0, G, D}, tokens.options());
  const bool chunks = g.cmp_block % g.cmp_stride == 0;
  const auto hidden = chunks ? HiddenByChunks(tokens, position_encoding, first, g, N)
                             : HiddenByUnfolding(tokens, position_encoding, first, g, N);
  return ApplyLinear(second, torch::silu(hidden));  // [B,N,G,D]
}

}  // namespace nsad::nsa
