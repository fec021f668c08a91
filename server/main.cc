// nsad: the training daemon. Serves nsa.v1.Trainer over gRPC, /metrics for Prometheus and
// (optionally) an Alertmanager webhook that halts runs.
#include <grpcpp/grpcpp.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>
#include <spdlog/spdlog.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "daemon_options.h"
#include "metrics.h"
#include "remote_trainer.h"
#include "run_manager.h"
#include "trainer_service.h"

namespace {

int g_signal_pipe[2] = {-1, -1};

void OnShutdownSignal(int signal_number) {
  // write(2) is async-signal-safe; the main thread does the rest.
  const ssize_t ignored = ::write(g_signal_pipe[1], &signal_number, sizeof(signal_number));
  (void)ignored;
}

// The daemon records where it actually listens (ports may be chosen by the OS with :0) so
// tests and scripts never guess.
void WriteEndpointsFile(const std::string& state_dir, const std::string& grpc_address,
                        int metrics_port, int webhook_port) {
  const auto path = std::filesystem::path(state_dir) / "endpoints.json";
  const auto tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp);
    out << "{\"grpc\": \"" << grpc_address << "\", \"metrics_port\": " << metrics_port
        << ", \"alert_webhook_port\": " << webhook_port << ", \"pid\": " << ::getpid() << "}\n";
  }
  std::filesystem::rename(tmp, path);
}

std::string HostOf(const std::string& address) {
  const auto colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

}  // namespace

int main(int argc, char** argv) {
  nsad::server::DaemonOptions options;
  std::string error;
  if (!nsad::server::ParseDaemonOptions(argc, argv, &options, &error)) {
    std::fprintf(stderr, "nsad: %s\n\n%s", error.c_str(), nsad::server::DaemonUsage().c_str());
    return error == "help" ? 0 : 2;
  }
  spdlog::set_level(spdlog::level::from_str(options.log_level));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");

  // SIGINT/SIGTERM only wake the main thread through a pipe; shutdown then runs there, in
  // one well-defined place. A process-wide handler (rather than a blocked mask and
  // sigwait) holds whichever thread the kernel picks: gRPC starts threads of its own.
  if (::pipe2(g_signal_pipe, O_CLOEXEC) != 0) {
    spdlog::critical("cannot create the signal pipe");
    return 1;
  }
  struct sigaction action {};
  action.sa_handler = OnShutdownSignal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);

  try {
    std::filesystem::create_directories(options.state_dir);
  } catch (const std::exception& e) {
    spdlog::critical("cannot create state dir {}: {}", options.state_dir, e.what());
    return 1;
  }
  // One daemon per state dir: a second one would mark the first one's live runs FAILED and
  // hand out the same run ids. The lock goes with the process (close, exit or crash).
  const std::string lock_path = options.state_dir + "/nsad.lock";
  const int lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd < 0) {
    spdlog::critical("cannot use state dir {}: cannot create {}: {}", options.state_dir, lock_path,
                     std::strerror(errno));
    return 1;
  }
  if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    spdlog::critical("state dir {} is in use by another nsad (it holds {})", options.state_dir, lock_path);
    return 1;
  }

  nsad::server::Metrics metrics;
  if (options.metrics_address != "off") {
    const std::string why = metrics.Serve(options.metrics_address);
    if (why.empty()) {
      spdlog::info("metrics on http://{}:{}/metrics", HostOf(options.metrics_address),
                   metrics.bound_port());
    } else {
      // Training matters more than scraping: keep going without /metrics.
      spdlog::error("metrics endpoint {} could not start ({}); continuing without it",
                    options.metrics_address, why);
    }
  }

  // Torch never loads in this process: a worker reports what the machine offers.
  const std::string worker = options.worker_binary.empty() ? nsad::server::DefaultWorkerBinary()
                                                           : options.worker_binary;
  nsad::RuntimeCapabilities caps;
  try {
    caps = nsad::server::ProbeWorker(worker, options.state_dir + "/probe.log");
  } catch (const std::exception& e) {
    spdlog::critical("cannot run {}: {}", worker, e.what());
    return 1;
  }
  constexpr double kGib = 1024.0 * 1024.0 * 1024.0;
  std::string gpu_memory;  // " (139.8, 139.8 GiB)": what StartRun holds a model's training state to
  for (const int64_t bytes : caps.cuda_memory_bytes) {
    gpu_memory += fmt::format("{}{:.1f}", gpu_memory.empty() ? " (" : ", ", static_cast<double>(bytes) / kGib);
  }
  if (!gpu_memory.empty()) gpu_memory += " GiB)";
  spdlog::info("workers: {} CUDA device(s){}, NSA CUDA kernels {}, host memory {:.1f} GiB", caps.cuda_devices,
               gpu_memory, caps.cuda_kernels ? "available" : "unavailable",
               static_cast<double>(caps.host_memory_bytes) / kGib);
  std::unique_ptr<nsad::server::RunManager> runs;
  try {
    runs = std::make_unique<nsad::server::RunManager>(
        options.state_dir, &metrics, nsad::server::WorkerTrainerFactory(worker),
        nsad::server::DefaultConfigChecker(caps),
        nsad::server::RunManagerOptions{options.allow_fault_injection,
                                        std::chrono::seconds(options.halt_timeout_seconds), caps.cuda_devices,
                                        options.runs_per_gpu});
  } catch (const std::exception& e) {
    spdlog::critical("cannot load the run records in {}: {}", options.state_dir, e.what());
    return 1;
  }
  nsad::server::TrainerService service(runs.get());

  int port = 0;
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default: a second daemon on a taken port would then share it,
  // and calls would reach either daemon at random.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(options.listen_address, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    spdlog::critical("cannot listen on {}", options.listen_address);
    return 1;
  }
  int webhook_port = 0;
  auto webhook =
      nsad::server::StartAlertWebhook(options.alert_webhook_address, runs.get(), &webhook_port);
  const std::string bound = HostOf(options.listen_address) + ":" + std::to_string(port);
  // Written last: its presence means every endpoint is up.
  WriteEndpointsFile(options.state_dir, bound, metrics.bound_port(), webhook_port);
  spdlog::info("nsad {} serving nsa.v1.Trainer on {} (state in {})", NSAD_VERSION, bound,
               options.state_dir);

  int signal_number = 0;
  while (::read(g_signal_pipe[0], &signal_number, sizeof(signal_number)) < 0 && errno == EINTR) {
  }
  spdlog::info("signal {}: halting runs and shutting down", signal_number);
  webhook.reset();
  runs->Shutdown();     // HALTING every run; each stops after its current step (or --halt-timeout)
  runs->WaitForRuns();  // HALTED and persisted; watchers got their final event
  // Then drain gRPC briefly: open client connections hold a graceful shutdown until this.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  runs.reset();
  spdlog::info("nsad stopped");
  return 0;
}
