// Table and JSON rendering of nsactl.
#include <cmath>
#include <limits>

#include <google/protobuf/util/json_util.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include "format.h"

namespace nsactl {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

nsa::v1::RunInfo SampleRun(const std::string& id, const std::string& name, nsa::v1::RunState state,
                           int64_t step, double loss, double tok_s) {
  nsa::v1::RunInfo run;
  run.set_run_id(id);
  run.set_state(state);
  run.mutable_config()->set_name(name);
  run.mutable_config()->set_seq_len(256);
  run.set_device("cpu");
  run.set_attention_backend(nsa::v1::ATTENTION_BACKEND_REFERENCE);
  auto* p = run.mutable_progress();
  p->set_step(step);
  p->set_max_steps(1000);
  p->set_loss(loss);
  p->set_val_loss(kNaN);
  p->set_tokens_per_second(tok_s);
  p->set_lr(3e-4);
  return run;
}

TEST(Table, AlignsColumnsAndTrimsTrailingSpaces) {
  using A = Table::Align;
  Table table({"NAME", "N", "NOTE"}, {A::kLeft, A::kRight});
  table.AddRow({"a", "1", ""});
  table.AddRow({"longer", "12345", "x"});
  table.AddRow({"b"});  // short rows are padded
  EXPECT_EQ(table.Render(),
            "NAME        N  NOTE\n"
            "a           1\n"
            "longer  12345  x\n"
            "b\n");
}

TEST(Table, CountsMultibyteCharactersAsOneColumn) {
  Table table({"G", "X"});
  table.AddRow({"0.5 ±0.1", "y"});
  table.AddRow({"0.5 +0.1", "z"});
  const std::string text = table.Render();
  // Both rows put the second column at the same character offset.
  EXPECT_NE(text.find("0.5 ±0.1  y\n"), std::string::npos) << text;
  EXPECT_NE(text.find("0.5 +0.1  z\n"), std::string::npos) << text;
}

TEST(Numbers, FormatsAndUnknownValues) {
  EXPECT_EQ(FormatLoss(2.345678), "2.3457");
  EXPECT_EQ(FormatLoss(kNaN), "-");
  EXPECT_EQ(FormatLoss(std::numeric_limits<double>::infinity()), "inf");
  EXPECT_EQ(FormatRate(12345.6), "12346");
  EXPECT_EQ(FormatLearningRate(3e-4), "3.00e-04");
  EXPECT_EQ(FormatStepTime(0.11042), "110.42ms");
  EXPECT_EQ(FormatStepTime(0.00018), "0.18ms");
  EXPECT_EQ(FormatStepTime(1.5), "1.500s");
  EXPECT_EQ(FormatDuration(12.34), "12.3s");
  EXPECT_EQ(FormatDuration(245), "4m05s");
  EXPECT_EQ(FormatDuration(3723), "1h02m03s");
  EXPECT_EQ(BackendName(nsa::v1::ATTENTION_BACKEND_CUDA), "CUDA");
  EXPECT_EQ(StateName(nsa::v1::PAUSING), "PAUSING");
}

TEST(FormatRunList, OneAlignedRowPerRun) {
  nsa::v1::ListRunsResponse response;
  *response.add_runs() = SampleRun("r-1", "tiny", nsa::v1::RUNNING, 10, 5.5, 1000);
  *response.add_runs() = SampleRun("r-22", "", nsa::v1::COMPLETED, 1000, 1.25, 98765);
  const std::string text = FormatRunList(response);
  EXPECT_EQ(text,
            "RUN_ID  NAME  STATE           STEP    LOSS  VAL_LOSS  TOK/S  DEVICE  BACKEND\n"
            "r-1     tiny  RUNNING      10/1000  5.5000         -   1000  cpu     REFERENCE\n"
            "r-22          COMPLETED  1000/1000  1.2500         -  98765  cpu     REFERENCE\n");
  EXPECT_EQ(FormatRunList(nsa::v1::ListRunsResponse()), "no runs\n");
}

TEST(FormatRun, ShowsStateProgressMessageAndEffectiveConfig) {
  nsa::v1::RunInfo run = SampleRun("r-1", "tiny", nsa::v1::FAILED, 10, 5.5, 1000);
  run.set_message("loss is NaN");
  const std::string text = FormatRun(run);
  EXPECT_NE(text.find("run_id:      r-1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("state:       FAILED\n"), std::string::npos) << text;
  EXPECT_NE(text.find("step:        10/1000\n"), std::string::npos) << text;
  EXPECT_NE(text.find("val_loss:    -\n"), std::string::npos) << text;
  EXPECT_NE(text.find("message:     loss is NaN\n"), std::string::npos) << text;
  EXPECT_NE(text.find("checkpoint:  -\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\"seq_len\": 256"), std::string::npos) << text;
  // Where a resume would continue from.
  run.mutable_progress()->set_last_checkpoint("/state/runs/r-1/checkpoints/step_000000010");
  EXPECT_NE(FormatRun(run).find("checkpoint:  /state/runs/r-1/checkpoints/step_000000010\n"), std::string::npos)
      << FormatRun(run);
}

TEST(FormatGates, OneRowPerLayerWithMeanAndStddev) {
  nsa::v1::InspectGatesResponse response;
  response.set_run_id("r-1");
  response.set_step(40);
  auto* layer = response.add_layers();
  layer->set_layer(0);
  layer->mutable_mean()->set_cmp(0.25);
  layer->mutable_mean()->set_slc(0.5);
  layer->mutable_mean()->set_win(0.75);
  layer->mutable_stddev()->set_cmp(0.01);
  layer->set_mean_selected_blocks(7.25);
  const std::string text = FormatGates(response);
  EXPECT_NE(text.find("gates from step 40"), std::string::npos) << text;
  EXPECT_NE(text.find("    0  0.250 ±0.010  0.500 ±0.000  0.750 ±0.000         7.2\n"),
            std::string::npos)
      << text;
}

TEST(FormatEvent, OneLineWithStepLossRateLrState) {
  nsa::v1::RunEvent event;
  event.set_state(nsa::v1::RUNNING);
  event.mutable_progress()->set_step(20);
  event.mutable_progress()->set_max_steps(100);
  event.mutable_progress()->set_loss(3.14159);
  event.mutable_progress()->set_tokens_per_second(2048.4);
  event.mutable_progress()->set_lr(1e-3);
  EXPECT_EQ(FormatEvent(event), "step 20/100  loss 3.1416  tok/s 2048  lr 1.00e-03  RUNNING");
  event.set_state(nsa::v1::HALTED);
  event.set_message("alert LossSpike");
  EXPECT_EQ(FormatEvent(event),
            "step 20/100  loss 3.1416  tok/s 2048  lr 1.00e-03  HALTED  (alert LossSpike)");
}

TEST(ToJson, ProtoFieldNamesZeroFieldsAndRoundTrip) {
  nsa::v1::RunResponse response;
  *response.mutable_run() = SampleRun("r-1", "tiny", nsa::v1::PENDING, 0, 0, 0);
  response.mutable_run()->mutable_progress()->set_val_loss(1.5);
  const std::string json = ToJson(response);
  EXPECT_NE(json.find("\"run_id\": \"r-1\""), std::string::npos) << json;      // not runId
  EXPECT_NE(json.find("\"tokens_seen\": \"0\""), std::string::npos) << json;   // zero printed
  EXPECT_NE(json.find("\"state\": \"PENDING\""), std::string::npos) << json;
  EXPECT_EQ(json.back(), '\n');

  nsa::v1::RunResponse parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &parsed).ok());
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(parsed, response));

  const std::string line = ToJson(response, /*multiline=*/false);
  EXPECT_EQ(line.find('\n'), std::string::npos);
}

}  // namespace
}  // namespace nsactl
