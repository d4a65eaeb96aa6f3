// The --json report's failure side without processes: which process a failure is blamed on, the
// checks of the path, and who keeps the last word on a failed run's report (docs/runtime.md,
// "Report"; docs/report.schema.json).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "harness/rank.h"
#include "control/store.h"
#include "runtime/failure.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::TempDir;

// One identity type, one formatter and one parser for each spelling of a rank.
TEST(ReportBlame, ProcessNames) {
  auto t = RankId::from_name("trainer rank 3", 2);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->role, Role::kTrainer);
  EXPECT_EQ(t->rank, 3);
  EXPECT_STREQ(role_name(t->role), "trainer");
  auto e = RankId::from_name("engine 1 tp rank 1", 4);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->role, Role::kEngine);
  EXPECT_EQ(e->rank, 5);  // engine index * tp_size + tp rank
  EXPECT_EQ(e->name(), "engine 1 tp rank 1");
  EXPECT_EQ(e->mailbox(), "engine/5");
  EXPECT_EQ(RankId::from_mailbox("engine/5", 4), e);
  EXPECT_EQ(RankId::from_mailbox(RankId::trainer(7).mailbox(), 4), RankId::trainer(7));
  EXPECT_FALSE(RankId::from_name("trainer rank 3x", 2).has_value());
  EXPECT_FALSE(RankId::from_name("the launcher", 2).has_value());
  EXPECT_FALSE(RankId::from_name("engine 1 tp rank 4", 4).has_value());  // past the TP size
  EXPECT_FALSE(RankId::from_mailbox("engine/-1", 4).has_value());
  EXPECT_FALSE(RankId::from_mailbox("engine/1/0", 4).has_value());
}

// The root cause another process recorded in the store travels with the failure as its origin,
// and the report blames that process.
TEST(ReportBlame, RootCauseFromElsewhere) {
  auto server = StoreServer::start("127.0.0.1", 0, nullptr);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  auto store = connect_store("127.0.0.1", (*server)->port(), std::chrono::seconds(5), nullptr);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  const FailureOrigin verify{.rank = RankId::engine(1, 2),
                             .code = StatusCode::kCorruption,
                             .error = "corruption: verify: engine 0 tp rank 1: tensor x element 3"};
  announce_failure(store->get(), verify);
  announce_failure(store->get(), FailureOrigin{.rank = RankId::trainer(1), .error = "later"});
  const Status st = with_root_cause(store->get(), RankId::trainer(0),
                                    Status::Timeout("mailbox (waiting)").with_context("step 1"));
  EXPECT_EQ(st.code(), StatusCode::kAborted);
  EXPECT_EQ(st.message(),
            "aborted because engine 0 tp rank 1: corruption: verify: engine 0 tp rank 1: tensor x "
            "element 3 (seen here as: timeout: step 1: mailbox (waiting))");
  const Blame b = blame_failure(RankId::trainer(0), st);
  EXPECT_EQ(b.process, "engine 0 tp rank 1");
  EXPECT_EQ(b.role, "engine");
  EXPECT_EQ(b.rank, 1);
  EXPECT_EQ(b.message, "engine 0 tp rank 1: corruption: verify: engine 0 tp rank 1: tensor x element 3");
  // The process that recorded it keeps its own failure.
  const Status own = with_root_cause(store->get(), RankId::engine(1, 2), Status::Corruption("x"));
  EXPECT_EQ(own.message(), "x");
  // The origin survives contexts added on the way.
  const Blame l = blame_failure(
      RankId::trainer(0),
      Status::Aborted("aborted because trainer rank 1: the process was killed by signal 9")
          .with_origin(FailureOrigin{.rank = RankId::trainer(1),
                                     .code = StatusCode::kAborted,
                                     .error = "aborted: the process was killed by signal 9"})
          .with_context("waiting for the commit"));
  EXPECT_EQ(l.process, "trainer rank 1");
  EXPECT_EQ(l.message, "trainer rank 1: aborted: the process was killed by signal 9");
}

// A refit that failed at its end is blamed on the engine rank that reported it, also through the
// CLI's summary around it.
TEST(ReportBlame, FailedRefitNamesTheEngineThatReportedIt) {
  const Status failed =
      failed_refit(StatusCode::kCorruption, 2, "step-2",
                   FailureOrigin{.rank = RankId::engine(2, 2),
                                 .code = StatusCode::kCorruption,
                                 .error = "checksum mismatch in refit step 2"});
  EXPECT_EQ(failed.message(),
            "refit step 2: the engines did not publish version 'step-2': engine 1 tp rank 0 "
            "reported: checksum mismatch in refit step 2 (the session stays usable: the next "
            "refit publishes a new version)");
  const Blame b = blame_failure(
      RankId::trainer(1), failed.with_context("1 of 3 refit(s) failed (steps 2); the first failure"));
  EXPECT_EQ(b.process, "engine 1 tp rank 0");
  EXPECT_EQ(b.role, "engine");
  EXPECT_EQ(b.rank, 2);
  EXPECT_EQ(b.message, "engine 1 tp rank 0: checksum mismatch in refit step 2");
}

TEST(ReportBlame, OwnFailure) {
  const Blame b = blame_failure(RankId::trainer(0), Status::Timeout("no engine answered"));
  EXPECT_EQ(b.process, "trainer rank 0");
  EXPECT_EQ(b.role, "trainer");
  EXPECT_EQ(b.rank, 0);
  EXPECT_EQ(b.message, "trainer rank 0: timeout: no engine answered");
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

TEST(ReportPath, SetupChecks) {
  TempDir dir;
  EXPECT_EQ(prepare_report_path(dir.path()).code(), StatusCode::kInvalidArgument);
  const Status missing = prepare_report_path(dir.path() + "/no/report.json");
  EXPECT_EQ(missing.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.message().find("--json " + dir.path() + "/no/report.json"), std::string::npos)
      << missing.message();
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/no"));
  // Passing the check creates nothing and removes an earlier run's report.
  EXPECT_TRUE(prepare_report_path(dir.path() + "/new.json").ok());
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/new.json"));
  const std::string old = dir.write("old.json", R"({"ok": true})");
  EXPECT_TRUE(prepare_report_path(old).ok());
  EXPECT_FALSE(std::filesystem::exists(old));
}

TEST(ReportFile, FailedRunReports) {
  TempDir dir;
  RankOptions o;
  o.steps = 2;
  o.verify = true;
  const std::string path = dir.path() + "/report.json";
  const Blame engine = blame_of(FailureOrigin{
      .rank = RankId::engine(1, 2), .code = StatusCode::kCorruption, .error = "corruption: verify: …"});
  ASSERT_TRUE(write_failure_report_json(path, o, engine).ok());
  auto j = read_json(path);
  EXPECT_EQ(j.at("schema_version"), kReportSchemaVersion);
  EXPECT_EQ(j.at("ok"), false);
  EXPECT_EQ(j.at("steps"), 2);
  EXPECT_EQ(j.at("error").at("rank"), 1);
  EXPECT_EQ(j.at("error").at("role"), "engine");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()),
                          std::filesystem::directory_iterator()),
            1)
      << "the temporary file was renamed";

  // The launcher keeps trainer rank 0's failure report when the first process to fail exited...
  const Blame trainer = blame_of(FailureOrigin{.rank = RankId::trainer(1),
                                               .code = StatusCode::kAborted,
                                               .error = "aborted: the process exited with code 1"});
  ASSERT_TRUE(settle_failed_run_report(path, o, trainer, /*killed=*/false).ok());
  EXPECT_EQ(read_json(path).at("error").at("process"), "engine 0 tp rank 1");
  // ...and blames a process killed outright.
  ASSERT_TRUE(settle_failed_run_report(path, o, trainer, /*killed=*/true).ok());
  EXPECT_EQ(read_json(path).at("error").at("process"), "trainer rank 1");
  // A success report of a run that failed afterwards, or none at all, is replaced.
  dir.write("report.json", R"({"schema_version": 3, "ok": true})");
  ASSERT_TRUE(settle_failed_run_report(path, o, engine, /*killed=*/false).ok());
  EXPECT_EQ(read_json(path).at("ok"), false);
  std::filesystem::remove(path);
  ASSERT_TRUE(settle_failed_run_report(path, o, engine, /*killed=*/false).ok());
  EXPECT_EQ(read_json(path).at("error").at("rank"), 1);
}

TEST(ReportFile, SetupErrorReports) {
  TempDir dir;
  const std::string path = dir.path() + "/report.json";
  // The config could not be read: no config, no executor, no rank.
  ASSERT_TRUE(write_setup_failure_report_json(
                  path, SetupFailure{.command = "refit run",
                                     .steps = 3,
                                     .verify = true,
                                     .message = "not found: config file /x.yaml cannot be opened"})
                  .ok());
  auto j = read_json(path);
  EXPECT_EQ(j.at("schema_version"), kReportSchemaVersion);
  EXPECT_EQ(j.at("ok"), false);
  EXPECT_EQ(j.at("steps"), 3);
  EXPECT_EQ(j.at("verified"), true);
  EXPECT_EQ(j.at("error").at("role"), "setup");
  EXPECT_EQ(j.at("error").at("process"), "refit run");
  EXPECT_EQ(j.at("error").at("message"),
            "refit run: not found: config file /x.yaml cannot be opened");
  EXPECT_FALSE(j.at("error").contains("rank"));
  EXPECT_FALSE(j.contains("config"));
  EXPECT_FALSE(j.contains("executor"));
  // A config that was read goes into the report, with its executor.
  auto cfg = parse_config("model: tiny-qwen3\nrefit: {executor: p2p}\n");
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  ASSERT_TRUE(write_setup_failure_report_json(
                  path, SetupFailure{.command = "refit bench",
                                     .steps = 3,
                                     .config = &*cfg,
                                     .message = "invalid argument: --fault corrupt:999: …"})
                  .ok());
  j = read_json(path);
  EXPECT_EQ(j.at("error").at("process"), "refit bench");
  EXPECT_EQ(j.at("executor"), "p2p");
  EXPECT_EQ(j.at("config").at("model"), "tiny-qwen3");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()),
                          std::filesystem::directory_iterator()),
            1)
      << "the temporary file was renamed";
}

}  // namespace
}  // namespace refit
