#include "alert_webhook.h"

#include <civetweb.h>
#include <CivetServer.h>

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <vector>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

namespace nsad {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

// Labels and annotations are string maps; anything else reads as absent.
std::string StringField(const Struct& object, const std::string& key) {
  const auto it = object.fields().find(key);
  if (it == object.fields().end() || it->second.kind_case() != Value::kStringValue) return "";
  return it->second.string_value();
}

const Struct* StructField(const Struct& object, const std::string& key) {
  const auto it = object.fields().find(key);
  if (it == object.fields().end() || it->second.kind_case() != Value::kStructValue) return nullptr;
  return &it->second.struct_value();
}

// A JSON string literal (protobuf's printer does the escaping).
std::string JsonString(const std::string& text) {
  Value value;
  value.set_string_value(text);
  std::string json;
  google::protobuf::util::MessageToJsonString(value, &json);
  return json;
}

void Reply(mg_connection* conn, int status, const std::string& json) {
  mg_response_header_start(conn, status);
  mg_response_header_add(conn, "Content-Type", "application/json", -1);
  mg_response_header_add(conn, "Content-Length", std::to_string(json.size()).c_str(), -1);
  mg_response_header_send(conn);
  mg_write(conn, json.data(), json.size());
}

void ReplyError(mg_connection* conn, int status, const std::string& message) {
  Reply(conn, status, "{\"error\":" + JsonString(message) + "}\n");
}

// Reads at most `limit` bytes of request body; false when the body is larger.
bool ReadBody(mg_connection* conn, size_t limit, std::string* body) {
  char buffer[8192];
  while (true) {
    const int n = mg_read(conn, buffer, sizeof buffer);
    if (n <= 0) return true;
    if (body->size() + static_cast<size_t>(n) > limit) return false;
    body->append(buffer, static_cast<size_t>(n));
  }
}

// How deep arrays and objects nest, outside strings. protobuf's JSON parser refuses deep
// objects, but not deep arrays, and takes time quadratic in their depth: 300 KB of '[' kept
// the webhook's threads busy for hours (and the daemon's shutdown waiting on them).
int NestingDepth(const std::string& body) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char ch : body) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (ch == '\\') escaped = true;
      else if (ch == '"') in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (ch == ']' || ch == '}') {
      --depth;
    }
  }
  return deepest;
}

}  // namespace

AlertPayload ParseAlertmanagerPayload(const std::string& body) {
  AlertPayload payload;
  // Alertmanager's payload nests four deep (alerts, an alert, its labels); 32 is plenty.
  constexpr int kMaxDepth = 32;
  if (const int depth = NestingDepth(body); depth > kMaxDepth) {
    payload.error = "malformed JSON: nested " + std::to_string(depth) + " deep (at most " +
                    std::to_string(kMaxDepth) + ")";
    return payload;
  }
  Struct root;
  const auto status = google::protobuf::util::JsonStringToMessage(body, &root);
  if (!status.ok()) {
    payload.error = "malformed JSON: " + status.ToString();
    return payload;
  }
  const auto alerts = root.fields().find("alerts");
  if (alerts == root.fields().end() || alerts->second.kind_case() != Value::kListValue) {
    payload.error = "payload has no \"alerts\" list";
    return payload;
  }
  for (const Value& item : alerts->second.list_value().values()) {
    if (item.kind_case() != Value::kStructValue) {
      payload.error = "an entry of \"alerts\" is not an object";
      return payload;
    }
    ++payload.alerts;
    const Struct& alert = item.struct_value();
    // Each alert carries its own status; a group's status is "firing" while any is.
    if (StringField(alert, "status") != "firing") continue;
    const Struct* labels = StructField(alert, "labels");
    if (labels == nullptr || StringField(*labels, "nsad_action") != "halt") continue;
    HaltRequest halt;
    halt.run_id = StringField(*labels, "run_id");
    if (halt.run_id.empty()) continue;
    const bool seen = std::any_of(payload.halts.begin(), payload.halts.end(),
                                  [&](const HaltRequest& h) { return h.run_id == halt.run_id; });
    if (seen) continue;  // several rules may fire for one run; halting once is enough
    halt.alertname = StringField(*labels, "alertname");
    halt.reason = "alert " + (halt.alertname.empty() ? "(unnamed)" : halt.alertname);
    const Struct* annotations = StructField(alert, "annotations");
    const std::string summary = annotations ? StringField(*annotations, "summary") : "";
    if (!summary.empty()) halt.reason += ": " + summary;
    payload.halts.push_back(std::move(halt));
  }
  payload.ok = true;
  return payload;
}

// The civetweb handler for POST /alertmanager.
class WebhookHandler : public CivetHandler {
 public:
  explicit WebhookHandler(AlertWebhookServer::HaltCallback on_halt)
      : on_halt_(std::move(on_halt)) {}

  bool handlePost(CivetServer*, mg_connection* conn) override {
    std::string body;
    if (!ReadBody(conn, AlertWebhookServer::kMaxBodyBytes, &body)) {
      ReplyError(conn, 413, "payload larger than " +
                                std::to_string(AlertWebhookServer::kMaxBodyBytes) + " bytes");
      return true;
    }
    const AlertPayload payload = ParseAlertmanagerPayload(body);
    if (!payload.ok) {
      ReplyError(conn, 400, payload.error);
      return true;
    }
    // Alertmanager retries on non-2xx replies, so a failed halt is reported in the body
    // (and by the daemon's own logs) rather than as an HTTP error that would repeat it.
    std::string halted;
    for (const HaltRequest& halt : payload.halts) {
      std::string outcome;
      try {
        outcome = on_halt_(halt.run_id, halt.reason);
      } catch (const std::exception& e) {
        outcome = std::string("error: ") + e.what();
      }
      if (!halted.empty()) halted += ",";
      halted += "{\"run_id\":" + JsonString(halt.run_id) + ",\"alertname\":" +
                JsonString(halt.alertname) + ",\"result\":" + JsonString(outcome) + "}";
    }
    Reply(conn, 200,
          "{\"alerts\":" + std::to_string(payload.alerts) + ",\"halted\":[" + halted + "]}\n");
    return true;
  }

  bool handleGet(CivetServer*, mg_connection* conn) override {
    ReplyError(conn, 405, std::string("use POST ") + AlertWebhookServer::kPath);
    return true;
  }

 private:
  AlertWebhookServer::HaltCallback on_halt_;
};

struct AlertWebhookServer::Impl {
  explicit Impl(HaltCallback on_halt) : handler(std::move(on_halt)) {}
  WebhookHandler handler;  // declared first: destroyed after the server that calls it
  std::unique_ptr<CivetServer> server;
};

AlertWebhookServer::AlertWebhookServer(const std::string& listen_address, HaltCallback on_halt)
    : impl_(std::make_unique<Impl>(std::move(on_halt))) {
  const std::vector<std::string> options = {
      "listening_ports", listen_address,
      // Alertmanager sends one request per group at a time; two threads are plenty.
      "num_threads", "2",
      "request_timeout_ms", "10000",
  };
  try {
    impl_->server = std::make_unique<CivetServer>(options);
  } catch (const CivetException& e) {
    throw std::runtime_error("alert webhook cannot listen on " + listen_address + ": " + e.what());
  }
  impl_->server->addHandler(kPath, impl_->handler);
}

AlertWebhookServer::~AlertWebhookServer() {
  // Stop (and join the worker threads) before the handler goes away.
  if (impl_ && impl_->server) impl_->server->close();
}

int AlertWebhookServer::port() const {
  const auto ports = impl_->server->getListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

}  // namespace nsad
