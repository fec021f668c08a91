// Checkpoint directories on disk, independent of what they hold: atomic commit, a MANIFEST of
// sizes and CRC-32s verified on load, listing, "latest", and retention. Torch-free.
//
// Layout: <root>/step_000000123/ holds the files of the checkpoint after step 123 plus a
// MANIFEST ("nsad-checkpoint-manifest/1", then one "<name> <bytes> <crc32 hex>" line per
// file). A directory is only ever seen complete: it is written as step_000000123.tmp/,
// every file and the directory are fsynced, then it is renamed into place and <root> is
// fsynced. Names other than step_<digits> (leftover .tmp from a crash) are never loaded.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace nsad::checkpoint {

// A checkpoint that cannot be used: missing, incomplete or corrupt. what() names the file.
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct StoredCheckpoint {
  int64_t step = 0;
  std::string path;
};

// "step_000000123": zero-padded so that names sort like steps.
std::string StepDirName(int64_t step);
// The step of a committed checkpoint's directory name; -1 for anything else (e.g. ".tmp").
int64_t ParseStepDirName(const std::string& name);

// Committed checkpoints in root, oldest first; empty when root does not exist.
std::vector<StoredCheckpoint> ListCheckpoints(const std::string& root);

// <root>/step_N: where CommitCheckpoint puts the checkpoint after `step`.
std::string CheckpointPath(const std::string& root, int64_t step);

// Writes a checkpoint atomically: write_files(tmp_dir) creates the files in a fresh
// temporary directory; then the MANIFEST is added and everything is made durable and
// renamed to <root>/step_N. Returns the final path. Throws CheckpointError (also when
// write_files throws: the temporary directory is removed and nothing else changes).
std::string CommitCheckpoint(const std::string& root, int64_t step,
                             const std::function<void(const std::string& tmp_dir)>& write_files);

// Checks every MANIFEST entry (present, size, and with kContents its CRC-32, which reads every
// byte) and that `required` files are listed. Throws CheckpointError naming the offending file.
enum class Verify { kSizes, kContents };
void VerifyCheckpoint(const std::string& dir, const std::vector<std::string>& required,
                      Verify depth = Verify::kContents);

// Deletes committed checkpoints except the newest `keep` and milestones (step divisible by
// milestone_every, when > 0). Returns the steps deleted.
std::vector<int64_t> PruneCheckpoints(const std::string& root, int keep, int64_t milestone_every);

// Removes leftovers of interrupted commits (step_*.tmp, step_*.replaced) from root.
void RemoveIncompleteCheckpoints(const std::string& root);

// Helpers for write_files callbacks: write a whole file / flush one to disk.
void WriteFileDurably(const std::string& path, const std::string& contents);
std::string ReadFile(const std::string& path);  // throws CheckpointError
void SyncPath(const std::string& path);          // fsync a file or directory

// Deletes a directory tree (nftw; std::filesystem::remove_all is unusable next to libtorch).
void RemoveTree(const std::string& path);

}  // namespace nsad::checkpoint
