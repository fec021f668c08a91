// The effective TrainConfig as stable text, one "dotted.proto.name=value" line per field in
// a fixed order, for checkpoints: humans can read it, and resuming can say exactly which
// field differs from the run that wrote the checkpoint. Torch-free.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "nsad/config.h"

namespace nsad {

std::string ConfigToText(const TrainConfig& config);

// "key=value" lines -> map (values may contain '=' and spaces; lines without '=' ignored).
std::map<std::string, std::string> ParseKeyValueLines(const std::string& text);

// Fields that shape the training trajectory (model, optimizer, data, batch geometry, seed):
// resuming with any of them changed would not continue the same run. Returns one
// "field: checkpoint X, now Y" per difference.
std::vector<std::string> TrajectoryDifferences(const std::string& checkpoint_config_text,
                                               const TrainConfig& now);

}  // namespace nsad
