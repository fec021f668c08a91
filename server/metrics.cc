#include "metrics.h"

#include <algorithm>
#include <exception>

#include "nsa/v1/run_state.h"

namespace nsad::server {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;

// Every proto state but UNSPECIFIED, so nsad_run_state always has a full one-hot row.
std::vector<nsa::v1::RunState> AllStates() {
  std::vector<nsa::v1::RunState> states;
  for (int s = nsa::v1::PENDING; s <= nsa::v1::FAILED; ++s) {
    states.push_back(static_cast<nsa::v1::RunState>(s));
  }
  return states;
}

}  // namespace

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      step_(BuildGauge().Name("nsad_run_step").Help("Optimizer steps completed").Register(*registry_)),
      loss_(BuildGauge().Name("nsad_run_loss").Help("Training loss of the last step").Register(*registry_)),
      val_loss_(BuildGauge().Name("nsad_run_val_loss").Help("Last validation loss").Register(*registry_)),
      tokens_per_second_(BuildGauge()
                             .Name("nsad_run_tokens_per_second")
                             .Help("Training throughput of the last step")
                             .Register(*registry_)),
      data_seconds_(BuildGauge()
                        .Name("nsad_run_data_seconds")
                        .Help("Host seconds of the last step spent getting its batch (loader wait and copy)")
                        .Register(*registry_)),
      tokens_total_(BuildCounter().Name("nsad_run_tokens_total").Help("Tokens trained on").Register(*registry_)),
      grad_norm_(BuildGauge().Name("nsad_run_grad_norm").Help("Gradient norm before clipping").Register(*registry_)),
      lr_(BuildGauge().Name("nsad_run_lr").Help("Learning rate of the last step").Register(*registry_)),
      state_(BuildGauge().Name("nsad_run_state").Help("1 for the run's current state").Register(*registry_)),
      gate_mean_(BuildGauge().Name("nsad_run_gate_mean").Help("Mean NSA branch gate per layer").Register(*registry_)),
      selected_blocks_(BuildGauge()
                           .Name("nsad_run_selected_blocks")
                           .Help("Mean selection blocks attended per query")
                           .Register(*registry_)),
      runs_(BuildGauge().Name("nsad_runs").Help("Runs known to the daemon by state").Register(*registry_)),
      device_info_(BuildGauge()
                       .Name("nsad_run_device_info")
                       .Help("1 for each device a live run's workers train on")
                       .Register(*registry_)) {
  auto& info = BuildGauge().Name("nsad_build_info").Help("nsad version").Register(*registry_);
  info.Add({{"version", NSAD_VERSION}}).Set(1);
  for (auto s : AllStates()) runs_.Add({{"state", nsa::v1::RunState_Name(s)}}).Set(0);
}

std::string Metrics::Serve(const std::string& address) {
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(address, /*num_threads=*/1);
    exposer_->RegisterCollectable(registry_);
    return "";
  } catch (const std::exception& e) {
    exposer_.reset();
    return e.what();
  }
}

int Metrics::bound_port() const {
  if (!exposer_) return 0;
  const auto ports = exposer_->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

void Metrics::SetState(const std::string& run_id, nsa::v1::RunState state) {
  for (auto s : AllStates()) {
    state_.Add({{"run_id", run_id}, {"state", nsa::v1::RunState_Name(s)}}).Set(s == state ? 1 : 0);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (nsa::v1::IsTerminal(state)) RemoveProgress(run_id);
  auto it = run_states_.find(run_id);
  if (it != run_states_.end()) {
    runs_.Add({{"state", nsa::v1::RunState_Name(it->second)}}).Decrement();
  }
  run_states_[run_id] = state;
  runs_.Add({{"state", nsa::v1::RunState_Name(state)}}).Increment();
}

prometheus::Gauge& Metrics::Progress(const std::string& run_id, prometheus::Family<prometheus::Gauge>& family,
                                     const Labels& labels) {
  auto& gauge = family.Add(labels);
  std::lock_guard<std::mutex> lock(mutex_);
  progress_[run_id].gauges.insert({&family, &gauge});
  return gauge;
}

void Metrics::RemoveProgress(const std::string& run_id) {
  const auto it = progress_.find(run_id);
  if (it == progress_.end()) return;
  for (const auto& [family, gauge] : it->second.gauges) family->Remove(gauge);
  if (it->second.tokens_total != nullptr) tokens_total_.Remove(it->second.tokens_total);
  progress_.erase(it);
}

void Metrics::RecordDevices(const std::string& run_id, const std::string& devices, const std::string& backend) {
  std::string::size_type begin = 0;
  while (begin <= devices.size()) {
    const auto end = std::min(devices.find(',', begin), devices.size());
    Progress(run_id, device_info_,
             {{"run_id", run_id}, {"device", devices.substr(begin, end - begin)}, {"attention_backend", backend}})
        .Set(1);
    begin = end + 1;
  }
}

void Metrics::RecordStep(const std::string& run_id, const std::string& backend,
                         const StepMetrics& m) {
  Progress(run_id, step_, {{"run_id", run_id}}).Set(static_cast<double>(m.step));
  Progress(run_id, loss_, {{"run_id", run_id}}).Set(m.loss);
  Progress(run_id, tokens_per_second_, {{"run_id", run_id}, {"attention_backend", backend}}).Set(m.tokens_per_second);
  Progress(run_id, data_seconds_, {{"run_id", run_id}}).Set(m.data_seconds);
  auto& total = tokens_total_.Add({{"run_id", run_id}});
  {
    std::lock_guard<std::mutex> lock(mutex_);
    progress_[run_id].tokens_total = &total;
  }
  const double delta = static_cast<double>(m.tokens_seen) - total.Value();
  if (delta > 0) total.Increment(delta);
  Progress(run_id, grad_norm_, {{"run_id", run_id}}).Set(m.grad_norm);
  Progress(run_id, lr_, {{"run_id", run_id}}).Set(m.lr);
}

void Metrics::RecordValLoss(const std::string& run_id, double loss) {
  Progress(run_id, val_loss_, {{"run_id", run_id}}).Set(loss);
}

void Metrics::RecordGates(const std::string& run_id, const GateReport& report) {
  for (const auto& layer : report.layers) {
    const std::string l = std::to_string(layer.layer);
    Progress(run_id, gate_mean_, {{"run_id", run_id}, {"layer", l}, {"branch", "cmp"}}).Set(layer.mean.cmp);
    Progress(run_id, gate_mean_, {{"run_id", run_id}, {"layer", l}, {"branch", "slc"}}).Set(layer.mean.slc);
    Progress(run_id, gate_mean_, {{"run_id", run_id}, {"layer", l}, {"branch", "win"}}).Set(layer.mean.win);
    Progress(run_id, selected_blocks_, {{"run_id", run_id}, {"layer", l}}).Set(layer.mean_selected_blocks);
  }
}

}  // namespace nsad::server
