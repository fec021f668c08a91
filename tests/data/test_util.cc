#include "test_util.h"

#include <stdlib.h>

#include <fstream>
#include <numeric>
#include <sstream>
#include <stdexcept>

namespace nsad::data::testing {

TempDir::TempDir() {
  std::string templ = (std::filesystem::temp_directory_path() / "nsad-data-test-XXXXXX").string();
  if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = templ;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

void WriteRawShard(const std::string& path, int32_t magic, int32_t version, int32_t num_tokens,
                   const std::vector<unsigned char>& payload) {
  int32_t header[256] = {};
  header[0] = magic;
  header[1] = version;
  header[2] = num_tokens;
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header), sizeof(header));
  out.write(reinterpret_cast<const char*>(payload.data()),
            static_cast<std::streamsize>(payload.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
  if (!out) throw std::runtime_error("cannot write " + path);
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream content;
  content << in.rdbuf();
  return content.str();
}

std::vector<uint32_t> Iota(int64_t count, uint32_t first) {
  std::vector<uint32_t> tokens(static_cast<size_t>(count));
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

}  // namespace nsad::data::testing
