// dashboards/nsad.json: valid JSON, the variables it promises, and only metric names the
// daemon exports (a renamed metric would otherwise leave a silently empty panel).
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

// The metric names nsad exports (server/metrics.cc).
const std::set<std::string> kExported = {
    "nsad_run_step",       "nsad_run_loss",       "nsad_run_val_loss",
    "nsad_run_tokens_per_second", "nsad_run_tokens_total", "nsad_run_grad_norm",
    "nsad_run_lr",         "nsad_run_state",      "nsad_run_gate_mean",
    "nsad_run_selected_blocks", "nsad_runs",      "nsad_build_info",
    "nsad_run_data_seconds", "nsad_run_device_info"};

Struct LoadDashboard() {
  std::ifstream file(NSAD_DASHBOARD);
  std::stringstream text;
  text << file.rdbuf();
  Struct dashboard;
  const auto status = google::protobuf::util::JsonStringToMessage(text.str(), &dashboard);
  EXPECT_TRUE(status.ok()) << NSAD_DASHBOARD << ": " << status.ToString();
  return dashboard;
}

const Value& Field(const Struct& object, const std::string& key) {
  static const Value kNull;
  const auto it = object.fields().find(key);
  return it == object.fields().end() ? kNull : it->second;
}

TEST(Dashboard, ParsesWithSchemaVersionAndVariables) {
  const Struct dashboard = LoadDashboard();
  EXPECT_GE(Field(dashboard, "schemaVersion").number_value(), 36);
  std::set<std::string> variables;
  for (const Value& variable :
       Field(Field(dashboard, "templating").struct_value(), "list").list_value().values()) {
    const Struct& v = variable.struct_value();
    variables.insert(Field(v, "name").string_value());
    if (Field(v, "name").string_value() == "datasource") {
      EXPECT_EQ(Field(v, "type").string_value(), "datasource");
      EXPECT_EQ(Field(v, "query").string_value(), "prometheus");
    }
    // The runs to pick from: every run's, from the one series an ended run keeps (its
    // progress series leave /metrics when it ends).
    if (Field(v, "name").string_value() == "run_id") {
      EXPECT_EQ(Field(v, "definition").string_value(), "label_values(nsad_run_state, run_id)");
    }
  }
  EXPECT_EQ(variables, (std::set<std::string>{"datasource", "run_id"}));
}

TEST(Dashboard, PanelsQueryOnlyExportedMetricsAndCoverTheRunMetrics) {
  const Struct dashboard = LoadDashboard();
  const std::regex metric_name("nsad_[a-z_]+");
  std::set<std::string> used;
  int panels_with_queries = 0;
  for (const Value& panel : Field(dashboard, "panels").list_value().values()) {
    const Struct& p = panel.struct_value();
    const auto& targets = Field(p, "targets").list_value().values();
    if (targets.empty()) continue;
    ++panels_with_queries;
    EXPECT_EQ(Field(Field(p, "datasource").struct_value(), "uid").string_value(), "${datasource}")
        << Field(p, "title").string_value();
    for (const Value& target : targets) {
      const std::string expr = Field(target.struct_value(), "expr").string_value();
      for (std::sregex_iterator it(expr.begin(), expr.end(), metric_name), end; it != end; ++it) {
        EXPECT_TRUE(kExported.count(it->str())) << "unknown metric " << it->str() << " in " << expr;
        used.insert(it->str());
      }
    }
  }
  EXPECT_GE(panels_with_queries, 8);
  for (const char* required : {"nsad_run_tokens_per_second", "nsad_run_loss", "nsad_run_val_loss",
                               "nsad_run_step", "nsad_run_lr", "nsad_run_grad_norm",
                               "nsad_run_state", "nsad_run_gate_mean",
                               "nsad_run_selected_blocks"}) {
    EXPECT_TRUE(used.count(required)) << required << " has no panel";
  }
}

}  // namespace
