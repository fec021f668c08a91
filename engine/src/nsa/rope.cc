#include "nsa/rope.h"

#include <vector>

namespace nsad::nsa {

RopeTable MakeRopeTable(const torch::Tensor& positions, int64_t head_dim, double theta,
                        torch::ScalarType acc) {
  TORCH_CHECK(head_dim % 2 == 0, "RoPE needs an even head dim, got ", head_dim);
  const int64_t half = head_dim / 2;
  const auto opts = torch::TensorOptions().dtype(acc).device(positions.device());
  const auto inv_freq = torch::pow(theta, torch::arange(half, opts) * (-2.0 / head_dim));  // [D/2]
  const auto angles = positions.to(acc).unsqueeze(1) * inv_freq.unsqueeze(0);             // [T,D/2]
  return {angles.cos(), angles.sin()};
}

torch::Tensor ApplyRope(const torch::Tensor& x, const RopeTable& table) {
  const int64_t D = x.size(-1), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "RoPE needs an even head dim, got ", D);
  TORCH_CHECK(x.dim() >= 3 && table.cos.size(0) == x.size(1) && table.cos.size(1) == half,
              "rope table ", table.cos.sizes(), " does not fit x ", x.sizes());
  // [T, D/2] -> [1, T, 1, ..., 1, D/2]: broadcast over batch and every dim between T and D.
  std::vector<int64_t> shape(x.dim(), 1);
  shape[1] = x.size(1);
  shape.back() = half;
  const auto cos = table.cos.view(shape), sin = table.sin.view(shape);
  const auto xf = x.to(table.cos.scalar_type());
  const auto x1 = xf.narrow(-1, 0, half), x2 = xf.narrow(-1, half, half);
  return torch::cat({x1 * cos - x2 * sin, x1 * sin + x2 * cos}, -1).to(x.scalar_type());
}

torch::Tensor ApplyRope(const torch::Tensor& x, const torch::Tensor& positions, double theta) {
  const auto acc = x.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  return ApplyRope(x, MakeRopeTable(positions.to(x.device()), x.size(-1), theta, acc));
}

}  // namespace nsad::nsa
