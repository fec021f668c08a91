// What a trainer checkpoint holds and how it is written and read back. A checkpoint taken
// after step k lets a new trainer continue with step k+1 exactly as the original would have:
//   model.pt   parameters and buffers (torch archive)
//   optim.pt   AdamW moments and step counts (torch archive, AdamW::Save; checkpoints
//              written with torch::optim::AdamW's archive load too)
//   state      "key=value" lines: step, tokens seen, skipped steps, the data stream position
//              (data::BatchLoader::SavePosition) and the torch RNG states (hex)
//   config     the run's effective config (trainer/config_text.h)
//   MANIFEST   sizes and CRC-32s of the above (trainer/checkpoint_store.h)
// The learning-rate schedule is a pure function of the step, so the step restores it.
#pragma once

#include <torch/torch.h>

#include <string>

#include "nsad/config.h"
#include "trainer/optimizer.h"

namespace nsad {

struct ResumeState {
  int64_t step = 0;  // optimizer steps completed
  int64_t tokens_seen = 0;
  int64_t skipped_steps = 0;  // non-finite steps skipped so far (nonfinite_policy "skip")
  std::string data_position;  // data::BatchLoader::SavePosition()
};

// Writes <config.checkpoint_dir>/step_<state.step> atomically, then, with `prune`, prunes old
// checkpoints (checkpoint_keep, checkpoint_milestone_every). Saves the CPU RNG state and, on a
// CUDA device, that device's RNG state. Returns the checkpoint's path; throws
// checkpoint::CheckpointError.
std::string SaveCheckpoint(const TrainConfig& config, const torch::nn::Module& model,
                           const AdamW& optimizer, const ResumeState& state,
                           const torch::Device& device, bool prune = true);

// Writes a torch archive to `path` through checked writes: a failed write (a full disk)
// throws checkpoint::CheckpointError naming the file. (OutputArchive::save_to(path) throws
// from the stream writer's destructor on such a failure: std::terminate, the worker gone
// without a word.)
void SaveArchive(torch::serialize::OutputArchive& archive, const std::string& path);

// Verifies the checksums, checks that the checkpoint's run had the same trajectory-shaping
// config (model, optim, data, seq_len, batch_size, grad_accum, seed), then loads model and
// optimizer onto `device` and restores the RNG states. Throws ConfigError on field
// resume_from naming the file or the differing fields.
ResumeState LoadCheckpoint(const std::string& dir, const TrainConfig& config,
                           torch::nn::Module& model, AdamW& optimizer,
                           const torch::Device& device);

}  // namespace nsad
