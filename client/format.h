// Human-readable and JSON rendering of nsa.v1 messages for nsactl.
//
// Every function returns a string (no printing) so tests can check the exact output.
#pragma once

#include <string>
#include <vector>

#include <google/protobuf/message.h>

#include "nsa/v1/trainer.pb.h"

namespace nsactl {

// A plain text table: a header row, then rows, columns padded to their widest cell and
// separated by two spaces. Numeric columns read best right-aligned.
class Table {
 public:
  enum class Align { kLeft, kRight };

  // `align` may be shorter than `headers`; missing columns are left-aligned.
  explicit Table(std::vector<std::string> headers, std::vector<Align> align = {});

  // Rows shorter than the header are padded with empty cells.
  void AddRow(std::vector<std::string> cells);
  size_t rows() const { return rows_.size(); }

  // Lines end with '\n' and carry no trailing spaces.
  std::string Render() const;

 private:
  std::vector<std::string> headers_;
  std::vector<Align> align_;
  std::vector<std::vector<std::string>> rows_;
};

// Protobuf JSON with the proto field names (snake_case) and zero-valued fields included,
// so scripts see a stable set of keys. `multiline` = indented; otherwise one line.
std::string ToJson(const google::protobuf::Message& message, bool multiline = true);

// Short forms used in tables: "RUNNING", "CUDA" (for ATTENTION_BACKEND_CUDA).
std::string StateName(nsa::v1::RunState state);
std::string BackendName(nsa::v1::AttentionBackend backend);

// Number formats shared by the tables; NaN and infinities print as "-" / "inf".
std::string FormatLoss(double loss);             // 4 decimals
std::string FormatRate(double tokens_per_second);  // whole tokens per second
std::string FormatLearningRate(double lr);       // 3 significant digits, e.g. 3.00e-04
std::string FormatDuration(double seconds);      // 1h02m03s, 4m05s, 12.3s
std::string FormatStepTime(double seconds);      // 110.42ms, 0.18ms; from 1 s on 1.500s

// `nsactl list`: one row per run.
std::string FormatRunList(const nsa::v1::ListRunsResponse& response);
// `nsactl status`: the run's fields, then its effective config.
std::string FormatRun(const nsa::v1::RunInfo& run);
// `nsactl gates`: one row per layer.
std::string FormatGates(const nsa::v1::InspectGatesResponse& response);
// `nsactl throughput`.
std::string FormatThroughput(const nsa::v1::GetThroughputResponse& response);
// `nsactl watch`: one line per event, without the trailing newline.
std::string FormatEvent(const nsa::v1::RunEvent& event);

}  // namespace nsactl
