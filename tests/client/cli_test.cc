// Command-line parsing of nsactl.
#include <gtest/gtest.h>

#include "cli.h"

namespace nsactl {
namespace {

ParseResult Parse(std::vector<std::string> args, const std::string& env_address = "") {
  return ParseCommandLine(args, env_address);
}

TEST(ParseCommandLine, DefaultsForAddressTimeoutAndOutput) {
  const ParseResult r = Parse({"status", "run-1"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.text;
  EXPECT_EQ(r.invocation.command, Command::kStatus);
  EXPECT_EQ(r.invocation.run_id, "run-1");
  EXPECT_EQ(r.invocation.address, "127.0.0.1:50051");
  EXPECT_DOUBLE_EQ(r.invocation.timeout_seconds, 10.0);
  EXPECT_FALSE(r.invocation.json);
}

TEST(ParseCommandLine, EnvironmentAddressIsOverriddenByFlag) {
  EXPECT_EQ(Parse({"list"}, "10.0.0.2:7000").invocation.address, "10.0.0.2:7000");
  EXPECT_EQ(Parse({"--addr", "h:1", "list"}, "10.0.0.2:7000").invocation.address, "h:1");
  EXPECT_EQ(Parse({"--addr=h:2", "list"}, "10.0.0.2:7000").invocation.address, "h:2");
}

TEST(ParseCommandLine, GlobalOptionsAreAcceptedAfterTheCommand) {
  const ParseResult r = Parse({"gates", "r7", "--json", "--timeout", "2.5"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.text;
  EXPECT_EQ(r.invocation.command, Command::kGates);
  EXPECT_TRUE(r.invocation.json);
  EXPECT_DOUBLE_EQ(r.invocation.timeout_seconds, 2.5);
}

TEST(ParseCommandLine, StartTakesConfigNameAndWatch) {
  const ParseResult r = Parse({"start", "--config", "a.json", "--name=exp 1", "--watch"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.text;
  EXPECT_EQ(r.invocation.command, Command::kStart);
  EXPECT_EQ(r.invocation.config_path, "a.json");
  EXPECT_EQ(r.invocation.name_override, "exp 1");
  EXPECT_TRUE(r.invocation.watch_after_start);
}

TEST(ParseCommandLine, StartWithoutConfigIsAUsageError) {
  const ParseResult r = Parse({"start"});
  EXPECT_EQ(r.kind, ParseResult::Kind::kError);
  EXPECT_EQ(r.exit_code(), kExitUsage);
  EXPECT_NE(r.text.find("--config"), std::string::npos) << r.text;
}

TEST(ParseCommandLine, ListStatesRepeatedListedOrCommaSeparated) {
  using nsa::v1::RunState;
  const std::vector<RunState> expected = {nsa::v1::RUNNING, nsa::v1::PAUSED, nsa::v1::FAILED};
  EXPECT_EQ(Parse({"list", "--state", "RUNNING", "paused", "FAILED"}).invocation.states, expected);
  EXPECT_EQ(Parse({"list", "--state=RUNNING,PAUSED", "--state", "failed"}).invocation.states,
            expected);
  EXPECT_EQ(Parse({"list", "--state", "running", "--json", "--state", "PAUSED,FAILED,RUNNING"})
                .invocation.states,
            expected);
  EXPECT_TRUE(Parse({"list"}).invocation.states.empty());
}

TEST(ParseCommandLine, UnknownStateIsRejectedByName) {
  const ParseResult r = Parse({"list", "--state", "SLEEPING"});
  EXPECT_EQ(r.kind, ParseResult::Kind::kError);
  EXPECT_NE(r.text.find("SLEEPING"), std::string::npos) << r.text;
  EXPECT_EQ(Parse({"list", "--state", "RUN_STATE_UNSPECIFIED"}).kind, ParseResult::Kind::kError);
  EXPECT_EQ(Parse({"list", "--state"}).kind, ParseResult::Kind::kError);
}

TEST(ParseCommandLine, HaltReason) {
  const ParseResult r = Parse({"halt", "r1", "--reason", "loss diverged"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.text;
  EXPECT_EQ(r.invocation.run_id, "r1");
  EXPECT_EQ(r.invocation.halt_reason, "loss diverged");
}

TEST(ParseCommandLine, RunIdCommandsNeedExactlyOneRunId) {
  for (const std::string command : {"status", "pause", "resume", "halt", "gates", "throughput",
                                    "watch"}) {
    EXPECT_EQ(Parse({command}).kind, ParseResult::Kind::kError) << command;
    EXPECT_EQ(Parse({command, "a", "b"}).kind, ParseResult::Kind::kError) << command;
    const ParseResult ok = Parse({command, "a"});
    ASSERT_EQ(ok.kind, ParseResult::Kind::kRun) << command << ": " << ok.text;
    EXPECT_STREQ(CommandName(ok.invocation.command), command.c_str());
  }
  // "--" lets a run id start with a dash.
  EXPECT_EQ(Parse({"status", "--", "-odd"}).invocation.run_id, "-odd");
}

TEST(ParseCommandLine, UsageErrors) {
  EXPECT_EQ(Parse({}).kind, ParseResult::Kind::kError);
  EXPECT_EQ(Parse({"frobnicate"}).kind, ParseResult::Kind::kError);
  EXPECT_EQ(Parse({"list", "extra"}).kind, ParseResult::Kind::kError);
  EXPECT_EQ(Parse({"status", "r", "--reason", "x"}).kind, ParseResult::Kind::kError);
  EXPECT_EQ(Parse({"--bogus", "list"}).kind, ParseResult::Kind::kError);
  EXPECT_EQ(Parse({"list", "--timeout", "0"}).kind, ParseResult::Kind::kError);
  EXPECT_EQ(Parse({"list", "--timeout", "3s"}).kind, ParseResult::Kind::kError);
  EXPECT_EQ(Parse({"list", "--timeout"}).kind, ParseResult::Kind::kError);
  EXPECT_EQ(Parse({"list", "--json=yes"}).kind, ParseResult::Kind::kError);
  const ParseResult r = Parse({"frobnicate"});
  EXPECT_NE(r.text.find("unknown command 'frobnicate'"), std::string::npos) << r.text;
}

TEST(ParseCommandLine, HelpIsGeneralOrPerCommand) {
  const ParseResult general = Parse({"--help"});
  ASSERT_EQ(general.kind, ParseResult::Kind::kHelp);
  EXPECT_EQ(general.exit_code(), kExitOk);
  for (const char* command : {"start", "status", "list", "pause", "resume", "halt", "gates",
                              "throughput", "watch"}) {
    EXPECT_NE(general.text.find(command), std::string::npos) << command;
  }
  const ParseResult start = Parse({"start", "--help"});
  ASSERT_EQ(start.kind, ParseResult::Kind::kHelp);
  EXPECT_NE(start.text.find("--config FILE.json"), std::string::npos) << start.text;
  EXPECT_EQ(start.text, Parse({"help", "start"}).text);
  EXPECT_EQ(start.text, CommandHelp(Command::kStart));
  // Help wins over missing arguments.
  EXPECT_EQ(Parse({"watch", "-h"}).kind, ParseResult::Kind::kHelp);
}

}  // namespace
}  // namespace nsactl
