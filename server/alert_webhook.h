// Alertmanager webhook receiver: lets Prometheus alerts halt training runs.
//
// Alertmanager POSTs its webhook payload (version 4) to /alertmanager. Every alert in it
// that is "firing" and carries the labels nsad_action="halt" and run_id="..." becomes a
// halt request for that run; everything else is acknowledged and ignored. The rules that
// set these labels live in deploy/prometheus/alerts.yml.
//
// Torch-free; the HTTP server (civetweb) stays out of this header.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace nsad {

struct HaltRequest {
  std::string run_id;
  std::string alertname;
  std::string reason;  // "alert <alertname>: <annotations.summary>"
};

struct AlertPayload {
  bool ok = false;                 // false: `error` says why the body is not a v4 payload
  std::string error;
  size_t alerts = 0;               // alerts in the payload, whatever their status
  std::vector<HaltRequest> halts;  // one per run, in payload order
};

// Pure parsing, no side effects. Malformed JSON, or a body without an "alerts" list of
// objects, gives ok == false. A halting alert without a run_id label is skipped (there is
// nothing to halt), as are resolved alerts.
AlertPayload ParseAlertmanagerPayload(const std::string& body);

// Owns the HTTP server. The callback runs on a server thread, once per halt request, and
// returns a short outcome text (e.g. "HALTING" or an error) that is echoed in the JSON reply.
class AlertWebhookServer {
 public:
  using HaltCallback =
      std::function<std::string(const std::string& run_id, const std::string& reason)>;

  static constexpr char kPath[] = "/alertmanager";
  static constexpr size_t kMaxBodyBytes = 1 << 20;  // Alertmanager payloads are a few KiB

  // `listen_address` is "HOST:PORT", e.g. "127.0.0.1:9465"; port 0 picks a free port
  // (see port()). Throws std::runtime_error when the address cannot be bound.
  AlertWebhookServer(const std::string& listen_address, HaltCallback on_halt);
  ~AlertWebhookServer();  // stops the server; no callback runs after it returns

  AlertWebhookServer(const AlertWebhookServer&) = delete;
  AlertWebhookServer& operator=(const AlertWebhookServer&) = delete;

  // The port actually bound.
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nsad
