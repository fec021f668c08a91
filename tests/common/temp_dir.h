// A temporary directory removed with its contents at scope exit.
//
// Why not std::filesystem::remove_all: libtorch.so (torch 2.11 wheel) exports its own copy,
// built against gcc 13's libstdc++, which calls a weak symbol that Debian 12's libstdc++
// lacks; in any process linking torch the call jumps to address 0. nftw(3) has no such trap.
#pragma once

#include <ftw.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <stdexcept>
#include <string>

namespace nsad::testing {

inline void RemoveTree(const std::string& path) {
  ::nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "nsad-test") {
    std::string pattern = "/tmp/" + prefix + "-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() { RemoveTree(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace nsad::testing
