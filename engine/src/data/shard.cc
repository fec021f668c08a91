#include "data/shard.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <system_error>
#include <utility>

#include "data/data_error.h"

// Shards are little-endian and read by reinterpreting mapped bytes.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the shard reader assumes a little-endian host");

namespace nsad::data {
namespace fs = std::filesystem;

TokenWidth TokenWidthForVocab(int64_t vocab_size) {
  return vocab_size <= 65536 ? TokenWidth::kUint16 : TokenWidth::kUint32;
}

int64_t BytesPerToken(TokenWidth width) { return width == TokenWidth::kUint16 ? 2 : 4; }

// ---------------------------------------------------------------------------------------
// ShardFile

ShardFile::ShardFile(std::string path, std::string field)
    : path_(std::move(path)), field_(std::move(field)) {}

ShardFile::~ShardFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

std::shared_ptr<const ShardFile> ShardFile::Open(const std::string& path,
                                                 const std::string& field) {
  auto fail = [&](const std::string& problem) {
    return DataError(field, "shard " + path + ": " + problem);
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw fail(std::string("cannot open: ") + std::strerror(errno));
  // The descriptor is only needed until the mapping exists.
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};

  struct stat st {};
  if (::fstat(fd, &st) != 0) throw fail(std::string("cannot stat: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw fail("not a regular file");
  const int64_t file_bytes = st.st_size;
  if (file_bytes == 0) throw fail("empty file (0 bytes, no header)");
  if (file_bytes < kShardHeaderBytes) {
    throw fail("truncated: " + std::to_string(file_bytes) + " bytes, shorter than the " +
               std::to_string(kShardHeaderBytes) + "-byte header");
  }

  std::shared_ptr<ShardFile> shard(new ShardFile(path, field));
  shard->map_bytes_ = static_cast<size_t>(file_bytes);
  void* map = ::mmap(nullptr, shard->map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  if (map == MAP_FAILED) throw fail(std::string("cannot mmap: ") + std::strerror(errno));
  shard->map_ = map;

  int32_t header[3];
  std::memcpy(header, map, sizeof(header));
  if (header[0] != kShardMagic) {
    throw fail("wrong magic number " + std::to_string(header[0]) + " (expected " +
               std::to_string(kShardMagic) + "): not an llm.c token shard");
  }
  if (header[1] != static_cast<int32_t>(TokenWidth::kUint16) &&
      header[1] != static_cast<int32_t>(TokenWidth::kUint32)) {
    throw fail("unknown version " + std::to_string(header[1]) +
               " (known: 1 = uint16 tokens, 2 = uint32 tokens)");
  }
  shard->width_ = static_cast<TokenWidth>(header[1]);
  shard->num_tokens_ = header[2];
  if (shard->num_tokens_ < 0) {
    throw fail("corrupt header: negative token count " + std::to_string(header[2]));
  }
  const int64_t expected = kShardHeaderBytes + shard->num_tokens_ * BytesPerToken(shard->width_);
  if (file_bytes != expected) {
    throw fail(std::string(file_bytes < expected ? "truncated" : "oversized") + ": header says " +
               std::to_string(shard->num_tokens_) + " tokens of " +
               std::to_string(BytesPerToken(shard->width_)) + " bytes, so the file should have " +
               std::to_string(expected) + " bytes, but it has " + std::to_string(file_bytes));
  }
  if (shard->num_tokens_ == 0) throw fail("empty shard (header says 0 tokens)");
  shard->tokens_ = static_cast<const unsigned char*>(map) + kShardHeaderBytes;
  return shard;
}

uint32_t ShardFile::Token(int64_t index) const {
  if (width_ == TokenWidth::kUint16) {
    return reinterpret_cast<const uint16_t*>(tokens_)[index];
  }
  return reinterpret_cast<const uint32_t*>(tokens_)[index];
}

void ShardFile::CopyTokens(int64_t begin, int64_t count, int32_t* out) const {
  // The mapping starts page-aligned and the header is 1024 bytes, so the casts are aligned.
  if (width_ == TokenWidth::kUint16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(tokens_) + begin;
    std::copy(src, src + count, out);
  } else {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(tokens_) + begin;
    std::transform(src, src + count, out, [](uint32_t t) { return static_cast<int32_t>(t); });
  }
}

namespace {
template <typename T>
int64_t FindAtLeast(const T* tokens, int64_t begin, int64_t count, int64_t limit) {
  const T* first = tokens + begin;
  const T* last = first + count;
  const T* hit =
      std::find_if(first, last, [limit](T t) { return static_cast<int64_t>(t) >= limit; });
  return hit == last ? -1 : begin + (hit - first);
}
}  // namespace

int64_t ShardFile::FindTokenOutsideVocab(int64_t vocab_size, int64_t begin, int64_t count) const {
  if (width_ == TokenWidth::kUint16) {
    if (vocab_size > 65535) return -1;  // every uint16 fits: skip the scan
    return FindAtLeast(reinterpret_cast<const uint16_t*>(tokens_), begin, count, vocab_size);
  }
  return FindAtLeast(reinterpret_cast<const uint32_t*>(tokens_), begin, count, vocab_size);
}

// ---------------------------------------------------------------------------------------
// ShardWriter

ShardWriter::ShardWriter(std::string path, TokenWidth width)
    : path_(std::move(path)), temp_path_(path_ + ".tmp"), width_(width) {
  file_ = std::fopen(temp_path_.c_str(), "wb");
  if (file_ == nullptr) {
    throw std::runtime_error("cannot create " + temp_path_ + ": " + std::strerror(errno));
  }
  WriteHeader();  // placeholder count; Finish() rewrites it
}

ShardWriter::~ShardWriter() {
  if (file_ != nullptr) {
    std::fclose(file_);
    std::remove(temp_path_.c_str());
  }
}

void ShardWriter::WriteHeader() {
  int32_t header[kShardHeaderInts] = {};
  header[0] = kShardMagic;
  header[1] = static_cast<int32_t>(width_);
  header[2] = static_cast<int32_t>(num_tokens_);
  if (std::fwrite(header, sizeof(header), 1, file_) != 1) {
    throw std::runtime_error("cannot write " + temp_path_ + ": " + std::strerror(errno));
  }
}

void ShardWriter::Append(const uint32_t* tokens, size_t count) {
  if (file_ == nullptr) throw std::logic_error("ShardWriter::Append after Finish");
  if (num_tokens_ + static_cast<int64_t>(count) > kMaxShardTokens) {
    throw std::runtime_error(path_ + ": a shard holds at most " + std::to_string(kMaxShardTokens) +
                             " tokens");
  }
  const int64_t bytes = BytesPerToken(width_);
  buffer_.resize(count * bytes);
  for (size_t i = 0; i < count; ++i) {
    if (width_ == TokenWidth::kUint16) {
      if (tokens[i] > 0xFFFF) {
        throw std::runtime_error(path_ + ": token " + std::to_string(tokens[i]) +
                                 " does not fit a uint16 shard (version 1)");
      }
      const uint16_t narrow = static_cast<uint16_t>(tokens[i]);
      std::memcpy(&buffer_[i * 2], &narrow, 2);
    } else {
      std::memcpy(&buffer_[i * 4], &tokens[i], 4);
    }
  }
  if (count > 0 && std::fwrite(buffer_.data(), buffer_.size(), 1, file_) != 1) {
    throw std::runtime_error("cannot write " + temp_path_ + ": " + std::strerror(errno));
  }
  num_tokens_ += static_cast<int64_t>(count);
}

void ShardWriter::Finish() {
  if (file_ == nullptr) throw std::logic_error("ShardWriter::Finish called twice");
  // The token count is known only now: rewrite the header in place. A throw before the file
  // is closed leaves file_ set, so the destructor removes the temporary file.
  if (std::fseek(file_, 0, SEEK_SET) != 0) {
    throw std::runtime_error("cannot seek in " + temp_path_ + ": " + std::strerror(errno));
  }
  WriteHeader();
  std::FILE* file = std::exchange(file_, nullptr);
  if (std::fclose(file) != 0 || std::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    const std::string reason = std::strerror(errno);
    std::remove(temp_path_.c_str());
    throw std::runtime_error("cannot finish " + path_ + ": " + reason);
  }
}

void WriteShard(const std::string& path, const std::vector<uint32_t>& tokens, TokenWidth width) {
  ShardWriter writer(path, width);
  writer.Append(tokens.data(), tokens.size());
  writer.Finish();
}

// ---------------------------------------------------------------------------------------
// FindShards

namespace {

bool IsGlob(const std::string& path) { return path.find_first_of("*?[") != std::string::npos; }

std::vector<std::string> ExpandGlob(const std::string& pattern) {
  glob_t matches{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &matches);
  std::vector<std::string> files;
  if (rc == 0) {
    for (size_t i = 0; i < matches.gl_pathc; ++i) {
      std::error_code ec;
      if (fs::is_regular_file(matches.gl_pathv[i], ec)) files.emplace_back(matches.gl_pathv[i]);
    }
  }
  ::globfree(&matches);
  return files;
}

std::vector<std::string> BinFilesIn(const std::string& dir, const std::string& field) {
  std::vector<std::string> files;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code type_ec;
    if (it->path().extension() == ".bin" && it->is_regular_file(type_ec)) {
      files.push_back(it->path().string());
    }
  }
  if (ec) throw DataError(field, "cannot list directory " + dir + ": " + ec.message());
  return files;
}

}  // namespace

std::vector<std::string> FindShards(const std::string& path, const std::string& field) {
  if (path.empty()) throw DataError(field, "is empty: name a shard file, directory or glob");
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  std::vector<std::string> files;
  if (fs::is_directory(status)) {
    files = BinFilesIn(path, field);
    if (files.empty())
      throw DataError(field, "no shards found: directory " + path + " has no *.bin files");
  } else if (fs::exists(status)) {
    files.push_back(path);
  } else if (IsGlob(path)) {
    files = ExpandGlob(path);
    if (files.empty())
      throw DataError(field, "no shards found: glob " + path + " matches no files");
  } else {
    throw DataError(field, "path does not exist: " + path);
  }
  // Byte-wise order, independent of the locale, so the sample order is reproducible.
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace nsad::data
