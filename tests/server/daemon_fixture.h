// Runs the real nsad binary in a temporary state dir on OS-chosen ports, for tests that
// drive it over gRPC and HTTP exactly as users do. Every wait is bounded.
#pragma once

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "nsa/v1/trainer.grpc.pb.h"

namespace nsad::testing {

namespace fs = std::filesystem;

inline fs::path MakeTempDir(const std::string& prefix) {
  std::string pattern = (fs::temp_directory_path() / (prefix + "-XXXXXX")).string();
  if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return pattern;
}

inline std::string ReadFile(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Polls `done` every 20 ms until it returns true or `timeout` passes.
inline bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return done();
}

inline std::chrono::system_clock::time_point Deadline(int seconds = 10) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

// Waits (bounded) for `pid` to exit; its exit status, or -1 when it was killed by a signal or
// still ran after `timeout` (then SIGKILLed and reaped).
inline int WaitForExit(pid_t pid, std::chrono::seconds timeout) {
  int status = 0;
  if (!WaitFor([&] { return ::waitpid(pid, &status, WNOHANG) == pid; }, timeout)) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Runs nsad with `args` (after the binary) to its exit, its output into `log`; the exit
// status, or -1 if it was still running after `seconds` (then killed).
inline int RunNsadToExit(const std::vector<std::string>& args, const fs::path& log, int seconds = 60) {
  std::vector<std::string> all = {NSAD_BINARY};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&files, 1, 2);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, NSAD_BINARY, &files, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  if (rc != 0) throw std::runtime_error("cannot start " + std::string(NSAD_BINARY));
  return WaitForExit(pid, std::chrono::seconds(seconds));
}

class Daemon {
 public:
  // Starts nsad with its state in `state_dir` and waits until it serves gRPC.
  explicit Daemon(fs::path state_dir, std::vector<std::string> extra_args = {})
      : state_dir_(std::move(state_dir)) {
    fs::remove(state_dir_ / "endpoints.json");
    std::vector<std::string> args = {NSAD_BINARY, "--listen", "127.0.0.1:0", "--metrics",
                                     "127.0.0.1:0", "--state-dir", state_dir_.string(),
                                     "--log-level", "warn"};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (::posix_spawn(&pid_, NSAD_BINARY, nullptr, nullptr, argv.data(), environ) != 0) {
      throw std::runtime_error("cannot start " + std::string(NSAD_BINARY));
    }
    const fs::path endpoints = state_dir_ / "endpoints.json";
    // A daemon that exits at startup (a bad flag, a state dir in use) fails the test at once
    // with its exit status, instead of after the whole wait.
    int status = 0;
    bool exited = false;
    WaitFor([&] { return fs::exists(endpoints) || (exited = ::waitpid(pid_, &status, WNOHANG) == pid_); },
            std::chrono::seconds(60));
    if (exited) {
      pid_ = -1;
      throw std::runtime_error("nsad exited at startup (" +
                               (WIFEXITED(status) ? "status " + std::to_string(WEXITSTATUS(status))
                                                  : "signal " + std::to_string(WTERMSIG(status))) +
                               "); its log is on stderr above");
    }
    if (!fs::exists(endpoints)) {
      Stop();
      throw std::runtime_error("nsad did not write endpoints.json within 60 s");
    }
    const std::string json = ReadFile(endpoints);
    std::smatch m;
    if (std::regex_search(json, m, std::regex(R"re("grpc": "([^"]+)")re"))) address_ = m[1];
    if (std::regex_search(json, m, std::regex(R"re("metrics_port": (\d+))re"))) {
      metrics_port_ = std::stoi(m[1]);
    }
    if (std::regex_search(json, m, std::regex(R"re("alert_webhook_port": (\d+))re"))) {
      webhook_port_ = std::stoi(m[1]);
    }
    channel_ = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    if (!channel_->WaitForConnected(Deadline(30))) throw std::runtime_error("cannot connect");
    stub_ = nsa::v1::Trainer::NewStub(channel_);
  }
  ~Daemon() { Stop(); }

  // SIGTERM and wait (bounded); returns the exit status, or -1 if it had to be killed.
  int Stop() {
    if (pid_ <= 0) return exit_status_;
    // Drop our connection first, as a finished client would: gRPC's graceful shutdown
    // waits for open connections until its drain deadline.
    stub_.reset();
    channel_.reset();
    ::kill(pid_, SIGTERM);
    exit_status_ = WaitForExit(pid_, std::chrono::seconds(30));
    pid_ = -1;
    return exit_status_;
  }

  // SIGKILL, as a crash or an OOM kill would end it: no shutdown, no last records written.
  void Kill() {
    if (pid_ <= 0) return;
    stub_.reset();
    channel_.reset();
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
    exit_status_ = -1;
  }

  bool Alive() const { return pid_ > 0 && ::kill(pid_, 0) == 0; }
  pid_t pid() const { return pid_; }

  // The daemon's child processes (its nsad-workers), from /proc/<pid>/task/*/children.
  std::vector<pid_t> Children() const {
    std::vector<pid_t> children;
    for (const auto& task : fs::directory_iterator("/proc/" + std::to_string(pid_) + "/task")) {
      std::istringstream in(ReadFile(task.path() / "children"));
      pid_t child;
      while (in >> child) children.push_back(child);
    }
    return children;
  }
  nsa::v1::Trainer::Stub& stub() { return *stub_; }
  const std::string& address() const { return address_; }
  int metrics_port() const { return metrics_port_; }
  int webhook_port() const { return webhook_port_; }

 private:
  fs::path state_dir_;
  pid_t pid_ = -1;
  int exit_status_ = 0;
  std::string address_;
  int metrics_port_ = 0;
  int webhook_port_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<nsa::v1::Trainer::Stub> stub_;
};

}  // namespace nsad::testing
