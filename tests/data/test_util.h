// Helpers for the data tests: a scratch directory and writers for valid and broken shards.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace nsad::data::testing {

// A fresh directory under the system temp dir, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string File(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// A shard file with arbitrary header fields and payload, for the error cases.
void WriteRawShard(const std::string& path, int32_t magic, int32_t version, int32_t num_tokens,
                   const std::vector<unsigned char>& payload);
void WriteBytes(const std::string& path, const std::string& bytes);
std::string ReadBytes(const std::string& path);

// tokens[i] = first + i: every token is unique, so a window's tokens reveal where it came from.
std::vector<uint32_t> Iota(int64_t count, uint32_t first = 0);

}  // namespace nsad::data::testing
