// Token shards in the llm.c format, so shards made by llm.c's dev/data scripts (FineWeb-Edu,
// TinyStories, ...) plug in unchanged:
//
//   header   256 x int32, little-endian
//              [0] magic 20240520
//              [1] version: 1 = tokens are uint16, 2 = tokens are uint32 (vocab > 65536)
//              [2] number of tokens N (so a shard holds fewer than 2^31 tokens)
//              [3..255] zero
//   tokens   N x uint16 or N x uint32, little-endian
//
// A shard's file size is therefore exactly 1024 + N * (2 or 4) bytes. Shards are read through
// a read-only mmap: multi-GB shards cost address space, not memory. A shard must not be
// truncated in place while a run maps it (reads past the new end raise SIGBUS); replacing it
// by rename, as ShardWriter and nsa-shard do, is safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace nsad::data {

inline constexpr int32_t kShardMagic = 20240520;
inline constexpr int kShardHeaderInts = 256;
inline constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;
inline constexpr int64_t kMaxShardTokens = INT32_MAX;  // header[2] is an int32

// The header's version field, which decides the token width.
enum class TokenWidth : int32_t { kUint16 = 1, kUint32 = 2 };

// The narrowest width that holds every token id below vocab_size.
TokenWidth TokenWidthForVocab(int64_t vocab_size);
int64_t BytesPerToken(TokenWidth width);

// One opened, header-checked shard. Immutable and thread-safe after Open.
class ShardFile {
 public:
  // Maps `path` read-only and checks magic, version, token count against the file size and
  // non-emptiness. Throws DataError blaming `field` (the config field naming the data).
  static std::shared_ptr<const ShardFile> Open(const std::string& path, const std::string& field);

  ~ShardFile();
  ShardFile(const ShardFile&) = delete;
  ShardFile& operator=(const ShardFile&) = delete;

  const std::string& path() const { return path_; }
  const std::string& field() const { return field_; }
  TokenWidth width() const { return width_; }
  int64_t num_tokens() const { return num_tokens_; }

  uint32_t Token(int64_t index) const;
  // Copies tokens [begin, begin + count) into out, widened to int32. Caller keeps it in range.
  void CopyTokens(int64_t begin, int64_t count, int32_t* out) const;
  // Index of the first token in [begin, begin + count) that is >= vocab_size, or -1.
  int64_t FindTokenOutsideVocab(int64_t vocab_size, int64_t begin, int64_t count) const;

 private:
  ShardFile(std::string path, std::string field);

  std::string path_;
  std::string field_;
  TokenWidth width_ = TokenWidth::kUint16;
  int64_t num_tokens_ = 0;
  void* map_ = nullptr;  // the whole file, header included
  size_t map_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;  // first token byte inside map_
};

// Writes one shard. Tokens go to "<path>.tmp", which Finish() renames to `path`, so a reader
// (or an interrupted run) never sees a half-written shard. Errors throw std::runtime_error.
class ShardWriter {
 public:
  ShardWriter(std::string path, TokenWidth width);
  ~ShardWriter();  // without Finish(): removes the temporary file
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Throws if a token does not fit the width or the shard would exceed kMaxShardTokens.
  void Append(const uint32_t* tokens, size_t count);
  void Finish();
  int64_t num_tokens() const { return num_tokens_; }

 private:
  void WriteHeader();

  std::string path_;
  std::string temp_path_;
  TokenWidth width_;
  int64_t num_tokens_ = 0;
  std::FILE* file_ = nullptr;
  std::vector<unsigned char> buffer_;
};

void WriteShard(const std::string& path, const std::vector<uint32_t>& tokens, TokenWidth width);

// The shard files a data path names, in the order they are read (byte-wise sorted):
//   a file                 -> that file
//   a directory            -> every regular *.bin file directly inside it
//   a glob (has * ? or [)  -> every regular file it matches
// Throws DataError(field, ...) when the path does not exist or names no shard.
std::vector<std::string> FindShards(const std::string& path, const std::string& field);

}  // namespace nsad::data
