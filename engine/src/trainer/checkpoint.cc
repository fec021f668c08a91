#include "trainer/checkpoint.h"

#include <ATen/Context.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <mutex>
#include <sstream>

#include "nsad/engine.h"
#include "trainer/checkpoint_store.h"
#include "trainer/config_text.h"
#include "trainer/resume_target.h"

namespace nsad {
namespace {

constexpr char kStateFormat[] = "nsad-checkpoint-state/1";

std::string ToHex(const torch::Tensor& bytes) {
  static const char kDigits[] = "0123456789abcdef";
  const auto contiguous = bytes.contiguous().to(torch::kCPU);
  const auto* data = contiguous.data_ptr<uint8_t>();
  std::string hex;
  hex.reserve(2 * contiguous.numel());
  for (int64_t i = 0; i < contiguous.numel(); ++i) {
    hex.push_back(kDigits[data[i] >> 4]);
    hex.push_back(kDigits[data[i] & 15]);
  }
  return hex;
}

torch::Tensor FromHex(const std::string& hex) {
  auto nibble = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw checkpoint::CheckpointError("bad hex digit in an RNG state");
  };
  if (hex.size() % 2 != 0) throw checkpoint::CheckpointError("odd-length RNG state");
  auto bytes = torch::empty({static_cast<int64_t>(hex.size() / 2)}, torch::kUInt8);
  auto* data = bytes.data_ptr<uint8_t>();
  for (size_t i = 0; i < hex.size(); i += 2) data[i / 2] = nibble(hex[i]) << 4 | nibble(hex[i + 1]);
  return bytes;
}

// The default generator torch uses for `device` (CPU, or the CUDA device's own).
at::Generator DefaultGenerator(const torch::Device& device) {
  return at::globalContext().defaultGenerator(device.is_cuda() ? device : torch::Device(torch::kCPU));
}

std::string GeneratorState(const torch::Device& device) {
  at::Generator generator = DefaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return ToHex(generator.get_state());
}

void SetGeneratorState(const torch::Device& device, const std::string& hex) {
  at::Generator generator = DefaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(FromHex(hex));
}

std::string StateToText(const ResumeState& state, const torch::Device& device) {
  std::ostringstream out;
  out << "format=" << kStateFormat << "\n"
      << "step=" << state.step << "\n"
      << "tokens_seen=" << state.tokens_seen << "\n"
      << "skipped_steps=" << state.skipped_steps << "\n"
      << "data_position=" << state.data_position << "\n"
      << "rng.cpu=" << GeneratorState(torch::Device(torch::kCPU)) << "\n";
  if (device.is_cuda()) out << "rng.cuda=" << GeneratorState(device) << "\n";
  return out.str();
}

[[noreturn]] void ResumeError(const std::string& message) {
  throw ConfigError({{"resume_from", message}});
}

const std::string& Require(const std::map<std::string, std::string>& values, const std::string& key,
                           const std::string& file) {
  const auto it = values.find(key);
  if (it == values.end()) ResumeError(file + " lacks " + key);
  return it->second;
}

int64_t ParseInt(const std::string& text, const std::string& what) {
  try {
    size_t used = 0;
    const int64_t value = std::stoll(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  ResumeError(what + " is not an integer: \"" + text + "\"");
}

}  // namespace

void SaveArchive(torch::serialize::OutputArchive& archive, const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw checkpoint::CheckpointError("cannot create " + path + ": " + std::strerror(errno));
  int error = 0;
  archive.save_to([&](const void* data, size_t n) -> size_t {
    const char* next = static_cast<const char*>(data);
    size_t left = n;
    while (error == 0 && left > 0) {
      const ssize_t written = ::write(fd, next, left);
      if (written < 0 && errno == EINTR) continue;
      if (written <= 0) {
        error = written < 0 ? errno : ENOSPC;
        break;
      }
      next += written;
      left -= static_cast<size_t>(written);
    }
    // All of it, even after a failure: a short count makes the stream writer throw, and it
    // throws again from its destructor. The failure is reported below instead.
    return n;
  });
  ::close(fd);
  if (error != 0) throw checkpoint::CheckpointError("cannot write " + path + ": " + std::strerror(error));
}

std::string SaveCheckpoint(const TrainConfig& config, const torch::nn::Module& model,
                           const AdamW& optimizer, const ResumeState& state,
                           const torch::Device& device, bool prune) {
  const std::string path = checkpoint::CommitCheckpoint(
      config.checkpoint_dir, state.step, [&](const std::string& dir) {
        try {
          torch::serialize::OutputArchive model_archive;
          model.save(model_archive);
          SaveArchive(model_archive, dir + "/" + kCheckpointModelFile);
          torch::serialize::OutputArchive optimizer_archive;
          optimizer.Save(optimizer_archive);
          SaveArchive(optimizer_archive, dir + "/" + kCheckpointOptimizerFile);
        } catch (const c10::Error& e) {
          throw checkpoint::CheckpointError(e.what_without_backtrace());
        }
        checkpoint::WriteFileDurably(dir + "/" + kCheckpointStateFile, StateToText(state, device));
        checkpoint::WriteFileDurably(dir + "/" + kCheckpointConfigFile, ConfigToText(config));
      });
  if (prune) {
    checkpoint::PruneCheckpoints(config.checkpoint_dir, config.checkpoint_keep, config.checkpoint_milestone_every);
  }
  return path;
}

ResumeState LoadCheckpoint(const std::string& dir, const TrainConfig& config,
                           torch::nn::Module& model, AdamW& optimizer,
                           const torch::Device& device) {
  CheckResumeTarget(dir, config, checkpoint::Verify::kContents);

  const std::string state_path = dir + "/" + kCheckpointStateFile;
  const auto values = ParseKeyValueLines(checkpoint::ReadFile(state_path));
  if (Require(values, "format", state_path) != kStateFormat) {
    ResumeError(state_path + ": unknown format \"" + values.at("format") + "\"");
  }
  ResumeState state;
  state.step = ParseInt(Require(values, "step", state_path), state_path + " step");
  state.tokens_seen = ParseInt(Require(values, "tokens_seen", state_path), state_path + " tokens_seen");
  state.skipped_steps =
      ParseInt(Require(values, "skipped_steps", state_path), state_path + " skipped_steps");
  state.data_position = Require(values, "data_position", state_path);

  std::string file;
  try {
    file = dir + "/" + kCheckpointModelFile;
    torch::serialize::InputArchive model_archive;
    model_archive.load_from(file, device);
    model.load(model_archive);
    file = dir + "/" + kCheckpointOptimizerFile;
    torch::serialize::InputArchive optimizer_archive;
    optimizer_archive.load_from(file, device);
    optimizer.Load(optimizer_archive);
    file = state_path;
    SetGeneratorState(torch::Device(torch::kCPU), Require(values, "rng.cpu", state_path));
    // A CPU checkpoint resumed on a GPU (or the reverse) keeps the seeded CUDA generator.
    const auto cuda = values.find("rng.cuda");
    if (device.is_cuda() && cuda != values.end()) SetGeneratorState(device, cuda->second);
  } catch (const c10::Error& e) {
    ResumeError(file + " cannot be loaded: " + e.what_without_backtrace());
  } catch (const checkpoint::CheckpointError& e) {
    ResumeError(file + ": " + e.what());
  }
  return state;
}

}  // namespace nsad
