// Which checkpoint a config resumes from, and whether that checkpoint can continue the
// config's run, decided from the checkpoint's MANIFEST and config text alone. Torch-free, so
// that ValidateConfig (StartRun) refuses a wrong resume_from before a run exists, in the
// words the trainer uses when it loads the checkpoint.
#pragma once

#include <string>

#include "nsad/config.h"
#include "trainer/checkpoint_store.h"

namespace nsad {

// The files of a trainer checkpoint (trainer/checkpoint.h says what each holds).
inline constexpr char kCheckpointModelFile[] = "model.pt";
inline constexpr char kCheckpointOptimizerFile[] = "optim.pt";
inline constexpr char kCheckpointStateFile[] = "state";
inline constexpr char kCheckpointConfigFile[] = "config";

// The checkpoint directory config.resume_from names ("latest": the newest committed one in
// checkpoint_dir). Throws ConfigError on field resume_from.
std::string ResolveResumeDir(const TrainConfig& config);

// Throws ConfigError on field resume_from when the checkpoint in `dir` cannot continue
// config's run: a file it should hold is not in its MANIFEST, a listed file is missing or
// has another size (with Verify::kContents also another CRC-32, which reads every byte), or
// it was written by a run whose trajectory-shaping fields differ (config_text.h).
void CheckResumeTarget(const std::string& dir, const TrainConfig& config, checkpoint::Verify depth);

}  // namespace nsad
