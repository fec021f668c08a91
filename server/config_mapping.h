// nsa.v1.RunConfig <-> nsad::TrainConfig. The proto is what users write and what GetRun
// reports; the engine struct holds the defaults. Torch-free (protobuf side of the wall).
#pragma once

#include <string>
#include <vector>

#include "nsa/v1/trainer.pb.h"
#include "nsad/config.h"
#include "nsad/engine.h"

namespace nsad::server {

// Unset proto fields take the engine's defaults.
TrainConfig FromProto(const nsa::v1::RunConfig& proto);

// Every field set: the effective config of a run.
nsa::v1::RunConfig ToProto(const TrainConfig& config);

nsa::v1::AttentionBackend ToProto(AttentionBackend backend);
AttentionBackend FromProto(nsa::v1::AttentionBackend backend);  // UNSPECIFIED = kAuto

// Gate statistics of one layer, both ways (daemon <-> worker, daemon -> InspectGates).
void ToProto(const LayerGateStats& stats, nsa::v1::LayerGates* out);
LayerGateStats FromProto(const nsa::v1::LayerGates& proto);

// Parses protobuf JSON strictly. Returns "" on success, otherwise a message that names
// the offending field, e.g. "model.dimm: unknown field".
std::string ParseRunConfigJson(const std::string& json, nsa::v1::RunConfig* out);

// Fields a newer client sent that this daemon does not know (kept by proto3 as unknown
// fields); reported as dotted paths with field numbers, e.g. "model.#42".
std::vector<std::string> UnknownFieldPaths(const google::protobuf::Message& message);

}  // namespace nsad::server
