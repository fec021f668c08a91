// Pieces of the GPU kernel tests' parameter names (gtest's name generators).
#pragma once

#include <torch/torch.h>

#include <string>

namespace nsad::nsa {

// "_fp32", "_fp16" or "_bf16".
inline std::string DtypeSuffix(torch::ScalarType dtype) {
  return dtype == torch::kFloat ? "_fp32" : dtype == torch::kHalf ? "_fp16" : "_bf16";
}

}  // namespace nsad::nsa
