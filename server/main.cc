// nsad: the training daemon. Serves nsa.v1.Trainer over gRPC, /metrics for Prometheus and
// (optionally) an Alertmanager webhook that halts runs.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "daemon_options.h"
#include "metrics.h"
#include "run_manager.h"
#include "trainer_service.h"

namespace {

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

  // SIGINT/SIGTERM are taken synchronously by the main thread (sigwait), so every thread
  // created below inherits the blocked mask and shutdown runs in one well-defined place.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  try {
    std::filesystem::create_directories(options.state_dir);
  } catch (const std::exception& e) {
    spdlog::critical("cannot create state dir {}: {}", options.state_dir, e.what());
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

  auto runs = std::make_unique<nsad::server::RunManager>(
      options.state_dir, &metrics, &nsad::Trainer::Create, nsad::server::DefaultConfigChecker());
  nsad::server::TrainerService service(runs.get());

  int port = 0;
  grpc::ServerBuilder builder;
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
  sigwait(&signals, &signal_number);
  spdlog::info("signal {}: halting runs and shutting down", signal_number);
  webhook.reset();
  runs->Shutdown();  // HALTING every run, so watchers see the end and threads finish
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  runs.reset();      // joins the run threads
  spdlog::info("nsad stopped");
  return 0;
}
