// nsad-worker: hosts one run's engine Trainer (LibTorch, CUDA) for the daemon (or one rank
// of a data-parallel run's, on its own GPU), speaking
// nsa.worker.v1 on stdin/stdout (see proto/nsa/v1/worker.proto). Exits when stdin closes.
// Logs go to stderr, which the daemon sends to the run's worker.log.
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <memory>

#include "config_mapping.h"
#include "nsa/v1/worker.pb.h"
#include "nsad/engine.h"
#include "worker_channel.h"

namespace {

namespace worker = nsa::worker::v1;
using nsad::server::ToProto;

void SetError(worker::Response* response, worker::Error::Kind kind, const std::string& message,
              int64_t step = 0) {
  auto* error = response->mutable_error();
  error->set_kind(kind);
  error->set_message(message);
  error->set_step(step);
}

void FillStepped(const nsad::StepMetrics& m, const nsad::GateReport& gates, worker::Stepped* s) {
  s->set_step(m.step);
  s->set_loss(m.loss);
  s->set_lr(m.lr);
  s->set_grad_norm(m.grad_norm);
  s->set_step_seconds(m.step_seconds);
  s->set_data_seconds(m.data_seconds);
  s->set_tokens_per_second(m.tokens_per_second);
  s->set_tokens_seen(m.tokens_seen);
  s->set_skipped_reason(m.skipped_reason);
  s->set_skipped_steps(m.skipped_steps);
  s->set_checkpoint(m.checkpoint);
  s->set_gates_step(gates.step);
  for (const auto& layer : gates.layers) ToProto(layer, s->add_gates());
}

// A request that needs the trainer before the create made one is an error reply ("step before
// create").
bool HasTrainer(const std::unique_ptr<nsad::Trainer>& trainer, const char* request, worker::Response* response) {
  if (!trainer) SetError(response, worker::Error::OTHER, std::string(request) + " before create");
  return trainer != nullptr;
}

worker::Response Handle(const worker::Request& request, std::unique_ptr<nsad::Trainer>& trainer) {
  worker::Response response;
  try {
    switch (request.kind_case()) {
      case worker::Request::kProbe: {
        const auto caps = nsad::ProbeRuntime();
        auto* reply = response.mutable_capabilities();
        reply->set_cuda_devices(caps.cuda_devices);
        reply->set_cuda_kernels(caps.cuda_kernels);
        reply->set_nccl(caps.nccl);
        for (const int64_t bytes : caps.cuda_memory_bytes) reply->add_cuda_memory_bytes(bytes);
        reply->set_host_memory_bytes(caps.host_memory_bytes);
        break;
      }
      case worker::Request::kCreate: {
        if (trainer) {
          SetError(&response, worker::Error::OTHER, "a trainer already exists in this worker");
          break;
        }
        nsad::TrainConfig config = nsad::server::FromProto(request.create().config());
        config.allow_fault_injection = request.create().allow_fault_injection();
        nsad::WorkerPlace place;
        place.rank = request.create().rank();
        place.rendezvous = request.create().rendezvous();
        if (request.create().has_cuda_device()) place.cuda_device = request.create().cuda_device();
        trainer = nsad::Trainer::Create(config, place);
        auto* created = response.mutable_created();
        created->set_device(trainer->device());
        created->set_attention_backend(ToProto(trainer->attention_backend()));
        created->set_parameter_count(trainer->parameter_count());
        break;
      }
      case worker::Request::kStep:
        if (HasTrainer(trainer, "step", &response)) {
          const auto m = trainer->Step();
          FillStepped(m, trainer->gates(), response.mutable_stepped());
        }
        break;
      case worker::Request::kEvaluate:
        if (HasTrainer(trainer, "evaluate", &response)) response.mutable_evaluated()->set_loss(trainer->Evaluate());
        break;
      case worker::Request::kCheckpoint:
        if (HasTrainer(trainer, "checkpoint", &response)) {
          response.mutable_checkpointed()->set_path(trainer->Checkpoint());
        }
        break;
      default:
        SetError(&response, worker::Error::OTHER, "unknown request");
    }
  } catch (const nsad::ConfigError& e) {
    SetError(&response, worker::Error::CONFIG, e.what());
    for (const auto& f : e.errors()) {
      auto* field = response.mutable_error()->add_fields();
      field->set_field(f.field);
      field->set_message(f.message);
    }
  } catch (const nsad::TrainingHalt& e) {
    SetError(&response, worker::Error::HALT, e.what(), e.step());
  } catch (const std::exception& e) {
    SetError(&response, worker::Error::OTHER, e.what(), trainer ? trainer->step() : 0);
  }
  return response;
}

}  // namespace

int main() {
  // If the daemon dies without closing our stdin (SIGKILL), do not train on as an orphan.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) return 1;
  nsad::server::WorkerChannel channel(STDIN_FILENO, STDOUT_FILENO);
  std::unique_ptr<nsad::Trainer> trainer;
  worker::Request request;
  while (channel.Read(&request)) {
    if (!channel.Write(Handle(request, trainer))) break;
    request.Clear();
  }
  return 0;  // stdin closed: the daemon is done with this run
}
