// Prometheus metrics of the daemon (names are a contract with deploy/ and dashboards/).
// The exposer is optional: if the metrics address cannot be bound, the daemon logs it and
// keeps training (seen on the GPU machine: CivetServer failing to start).
#pragma once

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "nsa/v1/trainer.pb.h"
#include "nsad/engine.h"

namespace nsad::server {

class Metrics {
 public:
  Metrics();

  // Starts serving /metrics on host:port. Returns "" or why it could not start.
  std::string Serve(const std::string& address);
  // Port actually bound (useful with port 0); 0 when not serving.
  int bound_port() const;

  // A run that ends (COMPLETED, HALTED, FAILED) keeps its nsad_run_state row but loses its
  // progress series (step, loss, throughput, gates, ...): a daemon that hosts thousands of runs
  // over its life exports the live ones' progress, not every run's (their history stays in
  // Prometheus). A resumed run's series come back with its next step.
  void SetState(const std::string& run_id, nsa::v1::RunState state);
  // nsad_run_device_info: 1 for each device a live run's workers train on ("cuda:0,cuda:1" for
  // two), labelled with it and the attention backend, for dashboards to group runs by GPU. A
  // progress series: gone when the run ends, set again where a resumed run is placed.
  void RecordDevices(const std::string& run_id, const std::string& devices, const std::string& backend);
  void RecordStep(const std::string& run_id, const std::string& backend, const StepMetrics& m);
  void RecordValLoss(const std::string& run_id, double loss);
  void RecordGates(const std::string& run_id, const GateReport& report);

 private:
  using Labels = std::map<std::string, std::string>;
  // family.Add(labels), remembered as one of the run's progress series.
  prometheus::Gauge& Progress(const std::string& run_id, prometheus::Family<prometheus::Gauge>& family,
                              const Labels& labels);
  void RemoveProgress(const std::string& run_id);  // caller holds mutex_

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::mutex mutex_;  // guards per-state run counts and progress_
  prometheus::Family<prometheus::Gauge>& step_;
  prometheus::Family<prometheus::Gauge>& loss_;
  prometheus::Family<prometheus::Gauge>& val_loss_;
  prometheus::Family<prometheus::Gauge>& tokens_per_second_;
  prometheus::Family<prometheus::Gauge>& data_seconds_;
  prometheus::Family<prometheus::Counter>& tokens_total_;
  prometheus::Family<prometheus::Gauge>& grad_norm_;
  prometheus::Family<prometheus::Gauge>& lr_;
  prometheus::Family<prometheus::Gauge>& state_;
  prometheus::Family<prometheus::Gauge>& gate_mean_;
  prometheus::Family<prometheus::Gauge>& selected_blocks_;
  prometheus::Family<prometheus::Gauge>& runs_;
  prometheus::Family<prometheus::Gauge>& device_info_;
  std::map<std::string, nsa::v1::RunState> run_states_;
  struct RunProgress {
    std::set<std::pair<prometheus::Family<prometheus::Gauge>*, prometheus::Gauge*>> gauges;
    prometheus::Counter* tokens_total = nullptr;
  };
  std::map<std::string, RunProgress> progress_;
};

}  // namespace nsad::server
