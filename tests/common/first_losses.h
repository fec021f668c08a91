// The training losses of the first `steps` steps of a fresh trainer built from `config`:
// what tests compare when two configs must (or must not) train the same way.
#pragma once

#include <vector>

#include "nsad/engine.h"

namespace nsad::testing {

inline std::vector<double> FirstLosses(const TrainConfig& config, int steps) {
  auto trainer = Trainer::Create(config);
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) losses.push_back(trainer->Step().loss);
  return losses;
}

}  // namespace nsad::testing
