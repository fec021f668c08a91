#include "daemon_options.h"

#include <spdlog/spdlog.h>

#include <filesystem>

#include "nsa/v1/run_state.h"
#include "remote_trainer.h"
#include "data/data_error.h"
#include "data/dataset.h"
#ifdef NSAD_HAVE_ALERT_WEBHOOK
#include "alert_webhook.h"
#endif

namespace nsad::server {

namespace {

// An alert's summary can be long; its halt must not be refused for it. Cut at a UTF-8
// character boundary (proto3 strings must stay valid UTF-8).
std::string ShortenedReason(const std::string& reason) {
  if (reason.size() <= nsa::v1::kMaxHaltReasonBytes) return reason;
  const std::string ellipsis = "...";
  size_t end = nsa::v1::kMaxHaltReasonBytes - ellipsis.size();
  while (end > 0 && (static_cast<unsigned char>(reason[end]) & 0xC0) == 0x80) --end;
  return reason.substr(0, end) + ellipsis;
}

}  // namespace

ConfigChecker DefaultConfigChecker(const RuntimeCapabilities& caps) {
  return [caps](const TrainConfig& config) -> std::vector<FieldError> {
    auto errors = PlanRuntime(config, caps).errors;
    if (!errors.empty()) return errors;
    try {
      data::ValidateDataset(config.data, config.seq_len, config.model.vocab_size);
    } catch (const data::DataError& e) {
      errors.push_back({e.field(), e.message()});
    }
    return errors;
  };
}

TrainerFactory WorkerTrainerFactory(const std::string& worker_binary) {
  return [worker_binary](const std::string& run_dir, const TrainConfig& config, const std::vector<int>& gpus,
                         AbortSlot* abort) {
    return CreateRemoteTrainer(worker_binary, run_dir, config, gpus, abort);
  };
}

std::string DefaultWorkerBinary() {
  std::error_code error;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", error);
  return (error ? std::filesystem::path(".") : self.parent_path()) / "nsad-worker";
}

std::shared_ptr<void> StartAlertWebhook(const std::string& address, RunManager* runs,
                                        int* bound_port) {
  *bound_port = 0;
  if (address == "off") return nullptr;
#ifdef NSAD_HAVE_ALERT_WEBHOOK
  try {
    auto server = std::make_shared<AlertWebhookServer>(
        address, [runs](const std::string& run_id, const std::string& reason) -> std::string {
          nsa::v1::RunInfo info;
          const grpc::Status status = runs->Halt(run_id, ShortenedReason(reason), &info);
          // Echoed in the webhook's reply: the new state, or why the halt was refused.
          if (status.ok()) return nsa::v1::RunState_Name(info.state());
          return status.error_message();
        });
    *bound_port = server->port();
    spdlog::info("Alertmanager webhook on port {} (POST {})", *bound_port, AlertWebhookServer::kPath);
    return server;
  } catch (const std::exception& e) {
    spdlog::error("Alertmanager webhook {} could not start ({}); continuing without it", address,
                  e.what());
    return nullptr;
  }
#else
  spdlog::error("this build has no Alertmanager webhook; ignoring --alert-webhook {}", address);
  return nullptr;
#endif
}

}  // namespace nsad::server
