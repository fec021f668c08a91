#include "format.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <utility>

#include <google/protobuf/util/json_util.h>

namespace nsactl {
namespace {

using nsa::v1::RunInfo;

std::string Printf(const char* format, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, format, value);
  return buffer;
}

// NaN means "not measured yet" in Progress (val_loss before the first evaluation).
bool Unknown(double value, std::string* text) {
  if (std::isnan(value)) {
    *text = "-";
    return true;
  }
  if (std::isinf(value)) {
    *text = value > 0 ? "inf" : "-inf";
    return true;
  }
  return false;
}

std::string StepOf(const nsa::v1::Progress& progress) {
  std::string step = std::to_string(progress.step());
  if (progress.max_steps() > 0) step += "/" + std::to_string(progress.max_steps());
  return step;
}

std::string Gate(double mean, double stddev) {
  return Printf("%.3f", mean) + " ±" + Printf("%.3f", stddev);
}

}  // namespace

Table::Table(std::vector<std::string> headers, std::vector<Align> align)
    : headers_(std::move(headers)), align_(std::move(align)) {
  align_.resize(headers_.size(), Align::kLeft);
}

void Table::AddRow(std::vector<std::string> cells) {
  cells.resize(headers_.size());
  rows_.push_back(std::move(cells));
}

std::string Table::Render() const {
  // Width in characters, not bytes, so that "±" does not skew the columns.
  auto width = [](const std::string& text) {
    return static_cast<size_t>(std::count_if(
        text.begin(), text.end(), [](unsigned char c) { return (c & 0xC0) != 0x80; }));
  };
  std::vector<size_t> widths(headers_.size());
  for (size_t c = 0; c < headers_.size(); ++c) {
    widths[c] = width(headers_[c]);
    for (const auto& row : rows_) widths[c] = std::max(widths[c], width(row[c]));
  }
  std::ostringstream out;
  auto render_row = [&](const std::vector<std::string>& cells) {
    std::string line;
    for (size_t c = 0; c < cells.size(); ++c) {
      const std::string padding(widths[c] - width(cells[c]), ' ');
      if (c > 0) line += "  ";
      line += align_[c] == Align::kRight ? padding + cells[c] : cells[c] + padding;
    }
    line.erase(line.find_last_not_of(' ') + 1);
    out << line << '\n';
  };
  render_row(headers_);
  for (const auto& row : rows_) render_row(row);
  return out.str();
}

std::string ToJson(const google::protobuf::Message& message, bool multiline) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = multiline;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string json;
  const auto status = google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!status.ok()) {
    // Only reachable for malformed Any payloads, which nsa.v1 does not use.
    return "{\"error\": \"cannot print " + message.GetTypeName() + " as JSON\"}\n";
  }
  if (!multiline) return json;
  // The printer already ends indented output with a newline.
  if (json.empty() || json.back() != '\n') json += '\n';
  return json;
}

std::string StateName(nsa::v1::RunState state) { return nsa::v1::RunState_Name(state); }

std::string BackendName(nsa::v1::AttentionBackend backend) {
  static const std::string kPrefix = "ATTENTION_BACKEND_";
  std::string name = nsa::v1::AttentionBackend_Name(backend);
  if (name.rfind(kPrefix, 0) == 0) name = name.substr(kPrefix.size());
  return name;
}

std::string FormatLoss(double loss) {
  std::string text;
  return Unknown(loss, &text) ? text : Printf("%.4f", loss);
}

std::string FormatRate(double tokens_per_second) {
  std::string text;
  return Unknown(tokens_per_second, &text) ? text : Printf("%.0f", tokens_per_second);
}

std::string FormatLearningRate(double lr) {
  std::string text;
  return Unknown(lr, &text) ? text : Printf("%.2e", lr);
}

// Milliseconds with two decimals below a second: a healthy step's data time is a fraction
// of a millisecond, which "%.3fs" printed as 0.000s.
std::string FormatStepTime(double seconds) {
  std::string text;
  if (Unknown(seconds, &text)) return text;
  return seconds < 1.0 ? Printf("%.2fms", seconds * 1e3) : Printf("%.3fs", seconds);
}

std::string FormatDuration(double seconds) {
  std::string text;
  if (Unknown(seconds, &text)) return text;
  if (seconds < 60) return Printf("%.1fs", seconds);
  const long total = std::lround(seconds);
  char buffer[64];
  if (total < 3600) {
    std::snprintf(buffer, sizeof buffer, "%ldm%02lds", total / 60, total % 60);
  } else {
    std::snprintf(buffer, sizeof buffer, "%ldh%02ldm%02lds", total / 3600, (total / 60) % 60,
                  total % 60);
  }
  return buffer;
}

std::string FormatRunList(const nsa::v1::ListRunsResponse& response) {
  using A = Table::Align;
  Table table({"RUN_ID", "NAME", "STATE", "STEP", "LOSS", "VAL_LOSS", "TOK/S", "DEVICE", "BACKEND"},
              {A::kLeft, A::kLeft, A::kLeft, A::kRight, A::kRight, A::kRight, A::kRight});
  for (const RunInfo& run : response.runs()) {
    const auto& p = run.progress();
    table.AddRow({run.run_id(), run.config().name(), StateName(run.state()), StepOf(p),
                  FormatLoss(p.loss()), FormatLoss(p.val_loss()),
                  FormatRate(p.tokens_per_second()), run.device(),
                  BackendName(run.attention_backend())});
  }
  if (table.rows() == 0) return "no runs\n";
  return table.Render();
}

std::string FormatRun(const RunInfo& run) {
  const auto& p = run.progress();
  std::vector<std::pair<std::string, std::string>> fields = {
      {"run_id", run.run_id()},
      {"name", run.config().name()},
      {"state", StateName(run.state())},
      {"step", StepOf(p)},
      {"loss", FormatLoss(p.loss())},
      {"val_loss", FormatLoss(p.val_loss()) +
                       (std::isnan(p.val_loss()) ? "" : " (step " + std::to_string(p.val_step()) + ")")},
      {"lr", FormatLearningRate(p.lr())},
      {"grad_norm", FormatLoss(p.grad_norm())},
      {"tokens/s", FormatRate(p.tokens_per_second())},
      {"tokens_seen", std::to_string(p.tokens_seen())},
      {"elapsed", FormatDuration(p.elapsed_seconds())},
      {"device", run.device()},
      {"backend", BackendName(run.attention_backend())},
      {"parameters", std::to_string(run.parameter_count())},
      // Where `nsactl resume` continues a halted or failed run from.
      {"checkpoint", p.last_checkpoint().empty() ? "-" : p.last_checkpoint()},
  };
  if (!run.message().empty()) fields.emplace_back("message", run.message());

  size_t key_width = 0;
  for (const auto& field : fields) key_width = std::max(key_width, field.first.size());
  std::ostringstream out;
  for (const auto& [key, value] : fields) {
    out << key << ':' << std::string(key_width - key.size() + 1, ' ') << value << '\n';
  }
  out << "effective config:\n" << ToJson(run.config(), /*multiline=*/true);
  return out.str();
}

std::string FormatGates(const nsa::v1::InspectGatesResponse& response) {
  using A = Table::Align;
  Table table({"LAYER", "CMP", "SLC", "WIN", "SEL_BLOCKS"},
              {A::kRight, A::kRight, A::kRight, A::kRight, A::kRight});
  for (const auto& layer : response.layers()) {
    table.AddRow({std::to_string(layer.layer()), Gate(layer.mean().cmp(), layer.stddev().cmp()),
                  Gate(layer.mean().slc(), layer.stddev().slc()),
                  Gate(layer.mean().win(), layer.stddev().win()),
                  Printf("%.1f", layer.mean_selected_blocks())});
  }
  std::ostringstream out;
  out << "run " << response.run_id() << ", gates from step " << response.step()
      << " (mean ±stddev of the sigmoid gate per branch)\n";
  if (table.rows() == 0) {
    out << "no gate statistics yet\n";
  } else {
    out << table.Render();
  }
  return out.str();
}

std::string FormatThroughput(const nsa::v1::GetThroughputResponse& response) {
  using A = Table::Align;
  Table table({"RUN_ID", "STEP", "TOK/S", "RECENT_TOK/S", "MEAN_TOK/S", "STEP_TIME", "DATA_TIME", "TOKENS_SEEN"},
              {A::kLeft, A::kRight, A::kRight, A::kRight, A::kRight, A::kRight, A::kRight, A::kRight});
  table.AddRow({response.run_id(), std::to_string(response.step()),
                FormatRate(response.tokens_per_second()),
                FormatRate(response.recent_tokens_per_second()) + " (" +
                    std::to_string(response.recent_steps()) + ")",
                FormatRate(response.mean_tokens_per_second()),
                FormatStepTime(response.step_seconds()), FormatStepTime(response.data_seconds()),
                std::to_string(response.tokens_seen())});
  return table.Render();
}

std::string FormatEvent(const nsa::v1::RunEvent& event) {
  const auto& p = event.progress();
  std::string line = "step " + StepOf(p) + "  loss " + FormatLoss(p.loss()) + "  tok/s " +
                     FormatRate(p.tokens_per_second()) + "  lr " + FormatLearningRate(p.lr()) +
                     "  " + StateName(event.state());
  if (!event.message().empty()) line += "  (" + event.message() + ")";
  return line;
}

}  // namespace nsactl
