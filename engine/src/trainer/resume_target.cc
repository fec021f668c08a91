#include "trainer/resume_target.h"

#include "nsad/engine.h"
#include "trainer/config_text.h"

namespace nsad {
namespace {

[[noreturn]] void ResumeError(const std::string& message) { throw ConfigError({{"resume_from", message}}); }

}  // namespace

std::string ResolveResumeDir(const TrainConfig& config) {
  if (config.resume_from != "latest") return config.resume_from;
  const auto stored = checkpoint::ListCheckpoints(config.checkpoint_dir);
  if (stored.empty()) ResumeError("\"latest\": no checkpoint in " + config.checkpoint_dir);
  return stored.back().path;
}

void CheckResumeTarget(const std::string& dir, const TrainConfig& config, checkpoint::Verify depth) {
  std::string config_text;
  try {
    checkpoint::VerifyCheckpoint(
        dir, {kCheckpointModelFile, kCheckpointOptimizerFile, kCheckpointStateFile, kCheckpointConfigFile}, depth);
    config_text = checkpoint::ReadFile(dir + "/" + kCheckpointConfigFile);
  } catch (const checkpoint::CheckpointError& e) {
    ResumeError(e.what());
  }
  const auto differences = TrajectoryDifferences(config_text, config);
  if (differences.empty()) return;
  std::string message = "the checkpoint " + dir + " was written by a run with another config (";
  for (size_t i = 0; i < differences.size(); ++i) message += (i ? "; " : "") + differences[i];
  ResumeError(message + ")");
}

}  // namespace nsad
