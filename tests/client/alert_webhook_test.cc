// Alertmanager webhook: payload parsing, and the HTTP server over loopback.
#include <curl/curl.h>

#include <chrono>
#include <mutex>
#include <vector>

#include <gtest/gtest.h>

#include "alert_webhook.h"

namespace nsad {
namespace {

// One alert of an Alertmanager v4 webhook payload.
std::string Alert(const std::string& status, const std::string& labels,
                  const std::string& annotations = "{}") {
  return "{\"status\":\"" + status + "\",\"labels\":" + labels +
         ",\"annotations\":" + annotations +
         ",\"startsAt\":\"2026-01-01T00:00:00Z\",\"endsAt\":\"0001-01-01T00:00:00Z\","
         "\"generatorURL\":\"http://prometheus/graph\",\"fingerprint\":\"abc\"}";
}

std::string Payload(const std::vector<std::string>& alerts, const std::string& status = "firing") {
  std::string list;
  for (const auto& alert : alerts) list += (list.empty() ? "" : ",") + alert;
  return "{\"version\":\"4\",\"groupKey\":\"{}:{}\",\"truncatedAlerts\":0,\"status\":\"" +
         status + "\",\"receiver\":\"nsad-halt\",\"groupLabels\":{},\"commonLabels\":{},"
         "\"commonAnnotations\":{},\"externalURL\":\"http://alertmanager\",\"alerts\":[" +
         list + "]}";
}

const std::string kSpike =
    Alert("firing", R"({"alertname":"LossSpike","nsad_action":"halt","run_id":"run-7","severity":"critical"})",
          R"({"summary":"loss 9.1 is over 3x its 30m minimum","description":"long text"})");

TEST(ParseAlertmanagerPayload, FiringHaltAlertBecomesHaltRequest) {
  const AlertPayload payload = ParseAlertmanagerPayload(Payload({kSpike}));
  ASSERT_TRUE(payload.ok) << payload.error;
  EXPECT_EQ(payload.alerts, 1u);
  ASSERT_EQ(payload.halts.size(), 1u);
  EXPECT_EQ(payload.halts[0].run_id, "run-7");
  EXPECT_EQ(payload.halts[0].alertname, "LossSpike");
  EXPECT_EQ(payload.halts[0].reason, "alert LossSpike: loss 9.1 is over 3x its 30m minimum");
}

TEST(ParseAlertmanagerPayload, ResolvedAndNonHaltingAlertsAreIgnored) {
  const AlertPayload payload = ParseAlertmanagerPayload(Payload(
      {Alert("resolved", R"({"alertname":"LossSpike","nsad_action":"halt","run_id":"run-1"})"),
       Alert("firing", R"({"alertname":"RunStalled","severity":"warning","run_id":"run-2"})"),
       Alert("firing", R"({"alertname":"X","nsad_action":"page","run_id":"run-3"})")},
      "firing"));
  ASSERT_TRUE(payload.ok) << payload.error;
  EXPECT_EQ(payload.alerts, 3u);
  EXPECT_TRUE(payload.halts.empty());
}

TEST(ParseAlertmanagerPayload, MissingLabelsAreSkipped) {
  const AlertPayload payload = ParseAlertmanagerPayload(Payload(
      {Alert("firing", R"({"alertname":"LossSpike","nsad_action":"halt"})"),  // no run_id
       "{\"status\":\"firing\"}",                                               // no labels
       Alert("firing", R"({"nsad_action":"halt","run_id":"r9"})", "null")}));   // no name/summary
  ASSERT_TRUE(payload.ok) << payload.error;
  EXPECT_EQ(payload.alerts, 3u);
  ASSERT_EQ(payload.halts.size(), 1u);
  EXPECT_EQ(payload.halts[0].run_id, "r9");
  EXPECT_EQ(payload.halts[0].reason, "alert (unnamed)");
}

TEST(ParseAlertmanagerPayload, OneHaltPerRun) {
  const AlertPayload payload = ParseAlertmanagerPayload(Payload(
      {kSpike, Alert("firing", R"({"alertname":"LossNotFinite","nsad_action":"halt","run_id":"run-7"})"),
       Alert("firing", R"({"alertname":"LossNotFinite","nsad_action":"halt","run_id":"run-8"})")}));
  ASSERT_TRUE(payload.ok) << payload.error;
  ASSERT_EQ(payload.halts.size(), 2u);
  EXPECT_EQ(payload.halts[0].alertname, "LossSpike");
  EXPECT_EQ(payload.halts[1].run_id, "run-8");
}

TEST(ParseAlertmanagerPayload, MalformedPayloads) {
  for (const std::string body :
       {"", "not json", "{\"alerts\": [", "[1,2]", "{\"version\":\"4\"}", "{\"alerts\": 3}",
        "{\"alerts\": [\"firing\"]}"}) {
    const AlertPayload payload = ParseAlertmanagerPayload(body);
    EXPECT_FALSE(payload.ok) << body;
    EXPECT_FALSE(payload.error.empty()) << body;
    EXPECT_TRUE(payload.halts.empty()) << body;
  }
  EXPECT_TRUE(ParseAlertmanagerPayload("{\"alerts\": []}").ok);
}

// Deeply nested arrays (which protobuf's parser takes in time quadratic in their depth: 300 KB
// of them held the webhook for hours) are refused before parsing, and fast; brackets inside
// strings do not count.
TEST(ParseAlertmanagerPayload, DeepNestingIsRefusedBeforeParsing) {
  const std::string deep = "{\"alerts\":" + std::string(150000, '[') + std::string(150000, ']') + "}";
  const auto start = std::chrono::steady_clock::now();
  const AlertPayload payload = ParseAlertmanagerPayload(deep);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_FALSE(payload.ok);
  EXPECT_NE(payload.error.find("nested 150001 deep"), std::string::npos) << payload.error;
  EXPECT_LT(seconds, 5.0) << "a refusal, not a parse";
  const AlertPayload brackets_in_labels = ParseAlertmanagerPayload(Payload(
      {R"({"status": "firing", "labels": {"nsad_action": "halt", "run_id": "run-9", "alertname": ")" +
       std::string(100, '[') + R"("}})"}));
  ASSERT_TRUE(brackets_in_labels.ok) << brackets_in_labels.error;
  EXPECT_EQ(brackets_in_labels.halts.size(), 1u);
}

// --- HTTP over loopback -----------------------------------------------------------------

struct HttpReply {
  long status = 0;
  std::string body;
  std::string error;
};

size_t Append(char* data, size_t size, size_t count, void* target) {
  static_cast<std::string*>(target)->append(data, size * count);
  return size * count;
}

HttpReply Request(int port, const std::string& method, const std::string& body) {
  HttpReply reply;
  CURL* curl = curl_easy_init();
  const std::string url = "http://127.0.0.1:" + std::to_string(port) + AlertWebhookServer::kPath;
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
  if (method == "POST") {
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, body.c_str());
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
  }
  curl_easy_setopt(curl, CURLOPT_NOPROXY, "*");  // loopback, whatever the environment says
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, 2000L);
  curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, 5000L);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, Append);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &reply.body);
  const CURLcode code = curl_easy_perform(curl);
  if (code != CURLE_OK) reply.error = curl_easy_strerror(code);
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &reply.status);
  curl_slist_free_all(headers);
  curl_easy_cleanup(curl);
  return reply;
}

// One server for the suite: civetweb takes up to 2 s to stop (its accept loop polls with a
// 2 s quantum), so a server per test would dominate the suite's run time.
class AlertWebhookServerTest : public ::testing::Test {
 protected:
  struct Call {
    std::string run_id, reason;
  };

  static void SetUpTestSuite() {
    server_ = new AlertWebhookServer(
        "127.0.0.1:0", [](const std::string& run_id, const std::string& reason) {
          std::lock_guard<std::mutex> lock(mutex_);
          calls_.push_back({run_id, reason});
          return std::string("HALTING");
        });
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_GT(server_->port(), 0);
    std::lock_guard<std::mutex> lock(mutex_);
    calls_.clear();
  }

  static std::vector<Call> Calls() {
    std::lock_guard<std::mutex> lock(mutex_);
    return calls_;
  }

  static std::mutex mutex_;
  static std::vector<Call> calls_;
  static AlertWebhookServer* server_;
};
std::mutex AlertWebhookServerTest::mutex_;
std::vector<AlertWebhookServerTest::Call> AlertWebhookServerTest::calls_;
AlertWebhookServer* AlertWebhookServerTest::server_ = nullptr;

TEST_F(AlertWebhookServerTest, FiringHaltAlertCallsTheCallback) {
  const HttpReply reply = Request(server_->port(), "POST", Payload({kSpike}));
  ASSERT_EQ(reply.error, "");
  EXPECT_EQ(reply.status, 200);
  EXPECT_EQ(reply.body,
            "{\"alerts\":1,\"halted\":[{\"run_id\":\"run-7\",\"alertname\":\"LossSpike\","
            "\"result\":\"HALTING\"}]}\n");
  const auto calls = Calls();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].run_id, "run-7");
  EXPECT_EQ(calls[0].reason, "alert LossSpike: loss 9.1 is over 3x its 30m minimum");
}

TEST_F(AlertWebhookServerTest, ResolvedAlertIsAcknowledgedWithoutHalting) {
  const HttpReply reply = Request(
      server_->port(), "POST",
      Payload({Alert("resolved", R"({"alertname":"LossSpike","nsad_action":"halt","run_id":"r"})")},
              "resolved"));
  ASSERT_EQ(reply.error, "");
  EXPECT_EQ(reply.status, 200);
  EXPECT_EQ(reply.body, "{\"alerts\":1,\"halted\":[]}\n");
  EXPECT_TRUE(Calls().empty());
}

TEST_F(AlertWebhookServerTest, MalformedJsonIs400) {
  const HttpReply reply = Request(server_->port(), "POST", "{\"alerts\": [");
  ASSERT_EQ(reply.error, "");
  EXPECT_EQ(reply.status, 400);
  EXPECT_NE(reply.body.find("\"error\""), std::string::npos) << reply.body;
  EXPECT_TRUE(Calls().empty());
}

TEST_F(AlertWebhookServerTest, GetIsNotAllowed) {
  const HttpReply reply = Request(server_->port(), "GET", "");
  ASSERT_EQ(reply.error, "");
  EXPECT_EQ(reply.status, 405);
}

TEST(AlertWebhookServer, BusyAddressThrows) {
  AlertWebhookServer first("127.0.0.1:0", [](const std::string&, const std::string&) {
    return std::string();
  });
  const std::string taken = "127.0.0.1:" + std::to_string(first.port());
  EXPECT_THROW(AlertWebhookServer(taken, [](const std::string&, const std::string&) {
                 return std::string();
               }),
               std::runtime_error);
}

}  // namespace
}  // namespace nsad
