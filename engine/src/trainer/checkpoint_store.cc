#include "trainer/checkpoint_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <sstream>

namespace nsad::checkpoint {
namespace {

constexpr char kManifest[] = "MANIFEST";
constexpr char kManifestHeader[] = "nsad-checkpoint-manifest/1";
constexpr char kTmpSuffix[] = ".tmp";
constexpr char kReplacedSuffix[] = ".replaced";

[[noreturn]] void Fail(const std::string& what) {
  throw CheckpointError(what + (errno != 0 ? std::string(": ") + std::strerror(errno) : ""));
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

void MakeDirs(const std::string& path) {
  std::string prefix;
  std::stringstream parts(path);
  std::string part;
  if (!path.empty() && path[0] == '/') prefix = "/";
  while (std::getline(parts, part, '/')) {
    if (part.empty()) continue;
    prefix += part + "/";
    errno = 0;
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) Fail("cannot create " + prefix);
  }
}

// Regular files directly inside dir, sorted by name.
std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> names;
  errno = 0;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) Fail("cannot list " + dir);
  while (const dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    struct stat st {};
    if (::lstat((dir + "/" + name).c_str(), &st) == 0 && S_ISREG(st.st_mode)) names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> EntriesIn(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return names;
  while (const dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  return names;
}

// CRC-32 and size of a file, read in chunks (model archives can be large).
uint32_t FileCrc32(const std::string& path, uint64_t* size) {
  errno = 0;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) Fail("cannot open " + path);
  uLong crc = ::crc32(0L, Z_NULL, 0);
  std::vector<unsigned char> buffer(1 << 20);
  *size = 0;
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      Fail("cannot read " + path);
    }
    if (n == 0) break;
    crc = ::crc32(crc, buffer.data(), static_cast<uInt>(n));
    *size += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return static_cast<uint32_t>(crc);
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::string StepDirName(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step_%09" PRId64, step);
  return name;
}

int64_t ParseStepDirName(const std::string& name) {
  const std::string prefix = "step_";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return -1;
  if (name.size() > prefix.size() + 18) return -1;
  int64_t step = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

std::vector<StoredCheckpoint> ListCheckpoints(const std::string& root) {
  std::vector<StoredCheckpoint> found;
  for (const std::string& name : EntriesIn(root)) {
    const int64_t step = ParseStepDirName(name);
    struct stat st {};
    const std::string path = root + "/" + name;
    if (step >= 0 && ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      found.push_back({step, path});
    }
  }
  std::sort(found.begin(), found.end(),
            [](const StoredCheckpoint& a, const StoredCheckpoint& b) { return a.step < b.step; });
  return found;
}

void WriteFileDurably(const std::string& path, const std::string& contents) {
  errno = 0;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) Fail("cannot create " + path);
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      Fail("cannot write " + path);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    Fail("cannot fsync " + path);
  }
  if (::close(fd) != 0) Fail("cannot close " + path);
}

std::string ReadFile(const std::string& path) {
  errno = 0;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) Fail("cannot open " + path);
  std::string contents;
  char buffer[65536];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0) contents.append(buffer, n);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) Fail("cannot read " + path);
  return contents;
}

void SyncPath(const std::string& path) {
  errno = 0;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) Fail("cannot open " + path + " to fsync it");
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) Fail("cannot fsync " + path);
}

void RemoveTree(const std::string& path) {
  ::nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

void RemoveIncompleteCheckpoints(const std::string& root) {
  for (const std::string& name : EntriesIn(root)) {
    if (name.rfind("step_", 0) == 0 && (EndsWith(name, kTmpSuffix) || EndsWith(name, kReplacedSuffix))) {
      RemoveTree(root + "/" + name);
    }
  }
}

std::string CheckpointPath(const std::string& root, int64_t step) {
  return root + "/" + StepDirName(step);
}

std::string CommitCheckpoint(const std::string& root, int64_t step,
                             const std::function<void(const std::string& tmp_dir)>& write_files) {
  MakeDirs(root);
  const std::string final_dir = CheckpointPath(root, step);
  const std::string tmp_dir = final_dir + kTmpSuffix;
  RemoveTree(tmp_dir);  // a leftover of an interrupted attempt at this very step
  errno = 0;
  if (::mkdir(tmp_dir.c_str(), 0755) != 0) Fail("cannot create " + tmp_dir);
  try {
    write_files(tmp_dir);
    std::ostringstream manifest;
    manifest << kManifestHeader << "\n";
    for (const std::string& name : FilesIn(tmp_dir)) {
      const std::string path = tmp_dir + "/" + name;
      SyncPath(path);  // files written by other code (torch archives) are not synced yet
      uint64_t size = 0;
      const uint32_t crc = FileCrc32(path, &size);
      char line[64];
      std::snprintf(line, sizeof(line), " %" PRIu64 " %08x\n", size, crc);
      manifest << name << line;
    }
    WriteFileDurably(tmp_dir + "/" + kManifest, manifest.str());
    SyncPath(tmp_dir);
    // Re-running a step after resuming from an older checkpoint replaces its checkpoint;
    // a directory cannot be renamed over a non-empty one, so move the old one aside first.
    const std::string replaced = final_dir + kReplacedSuffix;
    const bool replacing = Exists(final_dir);
    errno = 0;
    if (replacing && ::rename(final_dir.c_str(), replaced.c_str()) != 0) {
      Fail("cannot move " + final_dir + " aside");
    }
    errno = 0;
    if (::rename(tmp_dir.c_str(), final_dir.c_str()) != 0) Fail("cannot rename " + tmp_dir);
    SyncPath(root);
    if (replacing) RemoveTree(replaced);
  } catch (const std::exception& e) {
    RemoveTree(tmp_dir);
    throw CheckpointError("checkpoint of step " + std::to_string(step) + " not written: " + e.what());
  }
  return final_dir;
}

void VerifyCheckpoint(const std::string& dir, const std::vector<std::string>& required, Verify depth) {
  const std::string manifest_path = dir + "/" + kManifest;
  if (!Exists(manifest_path)) {
    errno = 0;
    throw CheckpointError("checkpoint " + dir + " has no MANIFEST (incomplete or not a checkpoint)");
  }
  std::istringstream manifest(ReadFile(manifest_path));
  std::string header;
  std::getline(manifest, header);
  if (header != kManifestHeader) {
    throw CheckpointError(manifest_path + ": unknown format \"" + header + "\"");
  }
  std::set<std::string> listed;
  std::string line;
  while (std::getline(manifest, line)) {
    if (line.empty()) continue;
    std::istringstream fields(line);
    std::string name, crc_hex;
    uint64_t size = 0;
    if (!(fields >> name >> size >> crc_hex) || name.find('/') != std::string::npos) {
      throw CheckpointError(manifest_path + ": malformed line \"" + line + "\"");
    }
    const std::string path = dir + "/" + name;
    if (!Exists(path)) throw CheckpointError("checkpoint file " + path + " is missing");
    uint64_t actual_size = 0;
    uint32_t actual = 0;
    if (depth == Verify::kContents) {
      actual = FileCrc32(path, &actual_size);
    } else {
      struct stat st {};
      if (::stat(path.c_str(), &st) != 0) throw CheckpointError("cannot stat " + path + ": " + std::strerror(errno));
      actual_size = static_cast<uint64_t>(st.st_size);
    }
    if (actual_size != size) {
      throw CheckpointError("checkpoint file " + path + " is corrupt: " +
                            std::to_string(actual_size) + " bytes, the MANIFEST says " +
                            std::to_string(size));
    }
    char actual_hex[16];
    std::snprintf(actual_hex, sizeof(actual_hex), "%08x", actual);
    if (depth == Verify::kContents && crc_hex != actual_hex) {
      throw CheckpointError("checkpoint file " + path + " is corrupt: CRC-32 " + actual_hex +
                            ", the MANIFEST says " + crc_hex);
    }
    listed.insert(name);
  }
  for (const std::string& name : required) {
    if (!listed.count(name)) {
      throw CheckpointError("checkpoint " + dir + " lacks " + name + " in its MANIFEST");
    }
  }
}

std::vector<int64_t> PruneCheckpoints(const std::string& root, int keep, int64_t milestone_every) {
  const auto stored = ListCheckpoints(root);
  std::vector<int64_t> removed;
  const size_t n = stored.size();
  for (size_t i = 0; i < n; ++i) {
    const bool recent = i + static_cast<size_t>(std::max(keep, 0)) >= n;
    const bool milestone = milestone_every > 0 && stored[i].step % milestone_every == 0;
    if (recent || milestone) continue;
    RemoveTree(stored[i].path);
    removed.push_back(stored[i].step);
  }
  return removed;
}

}  // namespace nsad::checkpoint
