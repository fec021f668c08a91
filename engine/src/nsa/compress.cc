#include "nsa/compress.h"

#include <c10/core/impl/LocalDispatchKeySet.h>

#include "model/row_ops.h"
#include "model/shared_input_linear.h"

#ifdef NSAD_HAVE_CUDA_KERNELS
#include "compress_mlp.h"
#endif

namespace nsad::nsa {

torch::Tensor TokensAsChunks(const torch::Tensor& tokens, int64_t chunks, int64_t len) {
  return tokens.narrow(1, 0, chunks * len)
      .view({tokens.size(0), chunks, len, tokens.size(2), tokens.size(3)})
      .permute({0, 1, 3, 2, 4});
}

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
  const auto chunked = TokensAsChunks(tokens, chunks, d).reshape({B, chunks, G, d * D});
  const auto slices = w.view({hidden, r, d * D}).transpose(0, 1).reshape({r * hidden, d * D});
  const auto y = at::linear(chunked, slices);  // [B, chunks, G, r*hidden]
  auto sum = y.narrow(1, 0, N).narrow(3, 0, hidden);
  for (int64_t i = 1; i < r; ++i) sum = sum + y.narrow(1, i, N).narrow(3, i * hidden, hidden);
  auto bias = at::mv(w, position_encoding.reshape({-1}).to(w.scalar_type()));
  if (first->bias.defined()) bias = bias + first->bias;
  // In the GEMM's dtype: a float32 bias would promote a bf16 (autocast) hidden layer.
  return sum + bias.to(sum.scalar_type());
}

// The autograd node of CompressBlocksTogether and CompressChunksTogether. Inputs: the P token
// tensors [B,T,G,D] (or, chunked, their chunks [P,B,chunks,G,d,D] as one tensor), then per
// compressor pos [l,D], W1 [h,l*D], b1 [h], W2 [D,h], b2 [D]. Shapes: M = B*chunks*G chunk
// rows, R = B*N*G block rows, dD = d*D.
//
// Forward, per compressor (batched over P):
//   Xc [M,dD]       the tokens in chunks of d, rows (b, c, g)
//   Y = Xc W1s^T    [M, h*r], W1s = W1 viewed [h*r, dD]: row (hh, i) is hidden unit hh's
//                   column slice i (tokens i d .. i d + d - 1 of the block), so the GEMM
//                   reads W1 as it lies
//   H[b,j,g,hh] = sum_i Y[b, j+i, g, (hh, i)] + (W1 flatten(pos) + b1)
//   out = silu(H) W2^T + b2
// Backward: the transposes of the same products; dY is dH placed at each slice's shift (the
// rest zero), so dY^T Xc is W1's gradient as it lies, plus the bias path's outer product
// dH-sum x flatten(pos).
//
// The steps between the GEMMs (the parameters' casts and pos_bias, the chunk sum with silu,
// silu's backward with the shifted placement and the bias sums, the position encodings'
// gradients) run as the kernels of kernels/compress_mlp.h where those take the node (CUDA, a
// 16-bit or float32 compute type, float32 parameters), else as the ATen code below, which is
// their oracle.
class CompressTogetherFn : public torch::autograd::Function<CompressTogetherFn> {
 public:
  static constexpr int kParams = 5;  // pos, W1, b1, W2, b2

  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList in, int64_t P,
                                                int64_t l, int64_t d, int64_t compute_dtype, bool chunked) {
    // The GEMMs' dtype is chosen by the caller; autocast must not recast anything in here.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto ct = static_cast<at::ScalarType>(compute_dtype);
    const auto& x0 = in[0];
    const int64_t first = chunked ? 1 : P;  // the first parameter's input
    const int64_t r = l / d;
    // Token mode: [B,T,G,D] each; chunked: [P,B,chunks,G,d,D], positions past chunks * d gone.
    const int64_t B = chunked ? x0.size(1) : x0.size(0), G = chunked ? x0.size(3) : x0.size(2),
                  D = x0.size(-1), T = chunked ? x0.size(2) * d : x0.size(1);
    const int64_t N = (T - l) / d + 1, chunks = N + r - 1;
    const int64_t h = Param(in, first, 0, 1).size(0), dD = d * D, M = B * chunks * G, R = B * N * G;
    const auto opts = x0.options().dtype(ct);

    torch::Tensor Xc;
    if (chunked) {
      Xc = x0.to(ct).contiguous();  // as it comes from RoPE: no copy
    } else {
      Xc = at::empty({P, B, chunks, G, d, D}, opts);
      for (int64_t p = 0; p < P; ++p) {
        CopyInWords(Xc[p], TokensAsChunks(in[p], chunks, d).to(ct));
      }
    }
    const auto prepared = Prepare(in, first, P, ct);
    const auto Y = at::bmm(Xc.view({P, M, dD}), prepared.w1.view({P, h * r, dD}).transpose(1, 2))
                       .view({P, B, chunks, G, h, r});
    const auto [hidden, act] = HiddenForward(Y, prepared.pos_bias, N);
    const auto out = at::baddbmm(prepared.b2.view({P, 1, D}), act.view({P, R, h}), prepared.w2.transpose(1, 2));

    torch::autograd::variable_list to_save = {Xc, prepared.w1, hidden, act, prepared.w2};
    for (int64_t p = 0; p < P; ++p) {
      to_save.push_back(Param(in, first, p, 0));  // pos and W1: the bias path's gradients
      to_save.push_back(Param(in, first, p, 1));
    }
    ctx->save_for_backward(to_save);
    ctx->saved_data["shape"] = std::vector<int64_t>{P, B, T, G, D, l, d, h};
    ctx->saved_data["chunked"] = chunked;
    ctx->saved_data["token_dtype"] = static_cast<int64_t>(x0.scalar_type());
    torch::autograd::variable_list outs;
    for (int64_t p = 0; p < P; ++p) outs.push_back(out[p].view({B, N, G, D}));
    return outs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const auto &Xc = saved[0], &W1c = saved[1], &hidden = saved[2], &act = saved[3], &W2c = saved[4];
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
    const auto dout = at::stack(parts);                                                   // [P,R,D]
    const auto dW2 = ProductIn(pt, dout.transpose(1, 2), act.view({P, R, h}));            // [P,D,h]
    const auto dact = at::bmm(dout, W2c);                                                 // [P,R,h]
    const auto [dY, dbias, db2] = HiddenBackward(dact.view({P, B, N, G, h}), hidden, dout.view({P, B, N, G, D}), r,
                                                 pt);  // dY [P,B,chunks,G,h,r]; dbias = db1
    const auto W1s = W1c.view({P, h * r, dD});
    const auto dY_rows = dY.view({P, M, h * r});
    auto dW1 = ProductIn(pt, dY_rows.transpose(1, 2), Xc.view({P, M, dD})).view({P, h, l * D});
    const auto dpos = PositionGrads(dW1, dbias, params, P);  // also adds dbias x pos into dW1
    const auto dXc = at::bmm(dY_rows, W1s).view({P, B, chunks, G, d, D});

    const bool chunked = ctx->saved_data["chunked"].toBool();
    const int64_t first = chunked ? 1 : P;
    // One gradient per forward input: the tensors of `in` (P token tensors or one chunk
    // tensor, then the parameters), then one, undefined, per non-tensor argument (P, l, d,
    // compute_dtype, chunked).
    torch::autograd::variable_list out(first + P * kParams + 5);
    if (chunked) out[0] = dXc.to(token_dtype);  // in the chunk layout, as RoPE's backward reads it
    for (int64_t p = 0; p < P; ++p) {
      if (!chunked) {
        auto dx = at::empty({B, T, G, D}, Xc.options().dtype(token_dtype));
        CopyInWords(TokensAsChunks(dx, chunks, d), dXc[p].to(token_dtype));
        if (T > chunks * d) dx.narrow(1, chunks * d, T - chunks * d).zero_();
        out[p] = dx;
      }
      torch::Tensor* g = &out[first + p * kParams];
      g[0] = dpos[p].view({l, D});
      g[1] = dW1[p];
      g[2] = dbias[p];
      g[3] = dW2[p];
      g[4] = db2[p];
    }
    return out;
  }

 private:
  // Parameter `which` (0 pos, 1 W1, 2 b1, 3 W2, 4 b2) of compressor p; the parameters start
  // at input `first`.
  static const torch::Tensor& Param(at::TensorList in, int64_t first, int64_t p, int which) {
    return in[first + p * kParams + which];
  }

  struct Prepared {
    torch::Tensor w1, w2, b2, pos_bias;  // [P,h,l*D], [P,D,h], [P,D] in ct; [P,h] in the parameters' dtype
  };

#ifdef NSAD_HAVE_CUDA_KERNELS
  // The compressors as the kernels take them, or none when they do not.
  static std::vector<cuda::detail::CompressorParams> KernelParams(at::TensorList in, int64_t first, int64_t P,
                                                                  at::ScalarType ct) {
    std::vector<cuda::detail::CompressorParams> params;
    for (int64_t p = 0; p < P; ++p) {
      params.push_back({Param(in, first, p, 0), Param(in, first, p, 1), Param(in, first, p, 2),
                        Param(in, first, p, 3), Param(in, first, p, 4)});
    }
    if (!cuda::detail::CompressMlpTakes(params, ct)) params.clear();
    return params;
  }
#endif

  // W1, W2, b2 in ct and pos_bias = W1 flatten(pos) + b1 in the parameters' dtype.
  static Prepared Prepare(at::TensorList in, int64_t first, int64_t P, at::ScalarType ct) {
#ifdef NSAD_HAVE_CUDA_KERNELS
    const auto kernel_params = KernelParams(in, first, P, ct);
    if (!kernel_params.empty()) {
      auto k = cuda::detail::PrepareCompressors(kernel_params, ct);
      return {k.w1, k.w2, k.b2, k.pos_bias};
    }
#endif
    std::vector<torch::Tensor> w1, w2, b2, pos_bias;
    for (int64_t p = 0; p < P; ++p) {
      w1.push_back(Param(in, first, p, 1).to(ct));
      w2.push_back(Param(in, first, p, 3).to(ct));
      b2.push_back(Param(in, first, p, 4).to(ct));
      pos_bias.push_back(
          at::addmv(Param(in, first, p, 2), Param(in, first, p, 1), Param(in, first, p, 0).reshape({-1})));
    }
    return {at::stack(w1), at::stack(w2), at::stack(b2), at::stack(pos_bias)};
  }

  // hidden [P,B,N,G,h] = sum_i Y[.., j+i, .., (hh, i)] + pos_bias (summed in pos_bias's
  // dtype, rounded once to Y's), and act = silu(hidden).
  static std::pair<torch::Tensor, torch::Tensor> HiddenForward(const torch::Tensor& Y, const torch::Tensor& pos_bias,
                                                              int64_t N) {
#ifdef NSAD_HAVE_CUDA_KERNELS
    if (Y.is_cuda() && cuda::detail::CompressMlpType(Y.scalar_type()) && pos_bias.scalar_type() == at::kFloat) {
      return cuda::detail::CompressHiddenForward(Y, pos_bias);
    }
#endif
    const int64_t P = Y.size(0), r = Y.size(5), h = Y.size(4);
    auto sum = pos_bias.view({P, 1, 1, 1, h}) + Y.select(5, 0).narrow(2, 0, N).to(pos_bias.scalar_type());
    for (int64_t i = 1; i < r; ++i) sum.add_(Y.select(5, i).narrow(2, i, N));
    const auto hidden = sum.to(Y.scalar_type());
    return {hidden, at::silu(hidden)};
  }

  // dY [P,B,chunks,G,h,r]: dh = silu'(hidden) dact placed at each slice's shift; dbias [P,h]
  // and db2 [P,D], the column sums of dh and dout, in the parameters' dtype pt.
  static std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> HiddenBackward(const torch::Tensor& dact,
                                                                                const torch::Tensor& hidden,
                                                                                const torch::Tensor& dout, int64_t r,
                                                                                at::ScalarType pt) {
#ifdef NSAD_HAVE_CUDA_KERNELS
    if (dact.is_cuda() && cuda::detail::CompressMlpType(dact.scalar_type()) && pt == at::kFloat) {
      return cuda::detail::CompressHiddenBackward(dact, hidden, dout, r);
    }
#endif
    const int64_t P = hidden.size(0), B = hidden.size(1), N = hidden.size(2), G = hidden.size(3), h = hidden.size(4);
    const auto dh = at::silu_backward(dact, hidden);
    auto dY = at::zeros({P, B, N + r - 1, G, h, r}, hidden.options());
    for (int64_t i = 0; i < r; ++i) dY.select(5, i).narrow(2, i, N).copy_(dh);
    return {dY, dh.view({P, -1, h}).sum(1, false, pt), dout.view({P, -1, dout.size(4)}).sum(1, false, pt)};
  }

  // a b (batched) with the result in dtype: straight out of the GEMM on CUDA.
  static torch::Tensor ProductIn(at::ScalarType dtype, const torch::Tensor& a, const torch::Tensor& b) {
    if (a.is_cuda() && dtype != a.scalar_type()) return at::bmm(a, b, dtype);
    return at::bmm(a, b).to(dtype);
  }

  // The position encodings' gradients [P,l*D] = W1^T dbias; dW1 [P,h,l*D] += dbias x
  // flatten(pos) in place. params: pos, W1 per compressor.
  static torch::Tensor PositionGrads(torch::Tensor& dW1, const torch::Tensor& dbias,
                                     const std::vector<torch::Tensor>& params, int64_t P) {
#ifdef NSAD_HAVE_CUDA_KERNELS
    if (dW1.is_cuda() && dW1.scalar_type() == at::kFloat) {
      std::vector<torch::Tensor> pos, w1;
      for (int64_t p = 0; p < P; ++p) pos.push_back(params[2 * p]), w1.push_back(params[2 * p + 1]);
      if (cuda::detail::CompressPositionGradsTake(pos, w1)) return cuda::detail::CompressPositionGrads(dW1, dbias, pos, w1);
    }
#endif
    std::vector<torch::Tensor> dpos;
    for (int64_t p = 0; p < P; ++p) {
      const auto& pos = params[2 * p];
      const auto& W1 = params[2 * p + 1];
      dW1[p].addr_(dbias[p], pos.reshape({-1}));
      dpos.push_back(at::mv(W1.t(), dbias[p]));
    }
    return at::stack(dpos);
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
                                   static_cast<int64_t>(compute), false);
}

std::vector<torch::Tensor> CompressChunksTogether(const torch::Tensor& chunks,
                                                  const std::vector<Compressor>& compressors,
                                                  const Geometry& g) {
  TORCH_CHECK(g.cmp_block % g.cmp_stride == 0, "CompressChunksTogether needs a stride that divides the block length");
  TORCH_CHECK(chunks.dim() == 6 && chunks.size(0) == static_cast<int64_t>(compressors.size()) &&
                  chunks.size(4) == g.cmp_stride,
              "CompressChunksTogether takes chunks [P,B,chunks,G,d,D] with one compressor per part and d = ",
              g.cmp_stride, ", got ", chunks.sizes(), " for ", compressors.size(), " compressors");
  const int64_t r = g.cmp_block / g.cmp_stride;
  TORCH_CHECK(chunks.size(2) >= r, "CompressChunksTogether needs at least one block: ", chunks.size(2),
              " chunks of ", g.cmp_stride, " for blocks of ", g.cmp_block);
  // As CompressBlocks' at::linear calls (the chunk tensor carries the tokens' dtype).
  const auto compute = LinearComputeType(chunks);
  torch::autograd::variable_list in{chunks};
  for (const auto& c : compressors) {
    TORCH_CHECK(c.first->bias.defined() && c.second->bias.defined(), "CompressChunksTogether needs biases");
    TORCH_CHECK(c.first->weight.size(0) == compressors[0].first->weight.size(0),
                "CompressChunksTogether takes compressors of one hidden width");
    in.insert(in.end(), {c.position_encoding, c.first->weight, c.first->bias, c.second->weight, c.second->bias});
  }
  return CompressTogetherFn::apply(at::TensorList(in), static_cast<int64_t>(compressors.size()), g.cmp_block,
                                   g.cmp_stride, static_cast<int64_t>(compute), true);
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
