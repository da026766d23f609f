// SIGKILL while saving: a training process that checkpoints every step is killed at 20 varied
// moments; each time the newest checkpoint loads and the run resumes from it. And SIGBUS: a
// mapped data file shortened under a training process.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "fusebox/core/checkpoint.h"
#include "fusebox/core/safetensors.h"
#include "trainer_test_util.h"

extern char** environ;

using namespace fusebox::trainer::testing;
namespace fs = std::filesystem;

namespace {

pid_t spawn(const std::vector<std::string>& args, const std::string& log) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  return rc == 0 ? pid : -1;
}

}  // namespace

TEST(TrainerKill, KilledWhileSavingTheLatestCheckpointStillLoadsAndResumes) {
  TempDir tmp;
  const std::string trainer = std::string(FUSEBOX_BIN_DIR) + "/trainer";
  // A model whose checkpoints take a noticeable time to write (~8 MB each), saved every step.
  std::vector<std::string> args{trainer,   "--model",
                                "mlp",     "--model-width",
                                "512",     "--model-depth",
                                "4",       "--threads",
                                "1",       "--optimizer",
                                "adamw",   "--max-train-steps",
                                "100000",  "--save-every-n-steps",
                                "1",       "--keep-last-n-checkpoints",
                                "2",       "--output-dir",
                                tmp.str(), "--log-every",
                                "1000"};
  auto resume_args = [&](const fs::path& from, int64_t steps, const std::string& out) {
    return std::vector<std::string>{
        "--model",       "mlp",   "--model-width",     "512",
        "--model-depth", "4",     "--threads",         "1",
        "--optimizer",   "adamw", "--max-train-steps", std::to_string(steps),
        "--output-dir",  out,     "--resume",          from.string(),
        "--log-every",   "1000"};
  };
  int resumed_ok = 0;
  for (int round = 0; round < 20; ++round) {
    const std::string log = tmp.file("log" + std::to_string(round));
    std::vector<std::string> a = args;
    if (round > 0) a.insert(a.end(), {"--resume", "latest"});
    pid_t pid = spawn(a, log);
    ASSERT_GT(pid, 0);
    if (round == 0) {
      // Let the first run get to its first checkpoint.
      for (int i = 0; i < 600 && fusebox::list_checkpoints(tmp.str()).empty(); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    } else {
      // Varied moments: during start-up, mid-step, mid-save.
      std::this_thread::sleep_for(std::chrono::milliseconds(300 + 113 * round));
    }
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    auto all = fusebox::list_checkpoints(tmp.str());
    ASSERT_FALSE(all.empty()) << "round " << round << ": no checkpoint; log: " << read_text(log);
    // The newest checkpoint is complete: it loads, and the trainer resumes from it.
    fusebox::Checkpoint ck = fusebox::load_checkpoint(all.back());
    auto r = run_trainer(resume_args(all.back(), ck.counters.at("step") + 1, tmp.file("resume")));
    ASSERT_EQ(r.code, 0) << "round " << round << ": " << r.err;
    ++resumed_ok;
  }
  EXPECT_EQ(resumed_ok, 20);
  // Temporaries of the killed writers are removed by the next run in the folder.
  auto latest = fusebox::list_checkpoints(tmp.str()).back();
  auto r = run_trainer(
      resume_args(latest, fusebox::load_checkpoint(latest).counters.at("step") + 1, tmp.str()));
  ASSERT_EQ(r.code, 0) << r.err;
  int temporaries = 0;
  for (const auto& e : fs::directory_iterator(tmp.str()))
    temporaries += e.path().filename().string().find(".tmp.") != std::string::npos;
  EXPECT_EQ(temporaries, 0);
}

// A data file shortened while a run reads it (mapped, its lost pages raise SIGBUS) ends the run
// with one line and exit 3, not "Bus error" and a core dump.
TEST(TrainerKill, ADataFileShortenedWhileTrainingEndsTheRunWithOneLine) {
  TempDir tmp;
  const std::string data = tmp.file("d.safetensors");
  const int64_t n = 200000;  // 6.4 MB of rows: every batch touches pages all over the file
  fusebox::save_safetensors({{"input", at::randn({n, 8})}, {"target", at::randn({n, 1})}}, data);
  const std::string log = tmp.file("log");
  pid_t pid = spawn({std::string(FUSEBOX_BIN_DIR) + "/trainer", "--model", "mlp", "--model-width",
                     "8", "--threads", "1", "--optimizer", "sgd", "--dataset", "tensors:" + data,
                     "--max-train-steps", "100000000", "--log-every", "1", "--output-dir", ""},
                    log);
  ASSERT_GT(pid, 0);
  for (int i = 0; i < 600 && read_text(log).find("step 2") == std::string::npos; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_EQ(::truncate(data.c_str(), 4096), 0);  // the header stays, the rows go
  int status = 0;
  for (int i = 0; i < 600 && ::waitpid(pid, &status, WNOHANG) == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  if (::waitpid(pid, &status, WNOHANG) == 0) ::kill(pid, SIGKILL), ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status << "; log: " << read_text(log);
  EXPECT_EQ(WEXITSTATUS(status), 3) << read_text(log);
  const std::string out = read_text(log);
  EXPECT_NE(out.find("trainer: error: a file mapped into memory (the --dataset, --eval-dataset or "
                     "--init-weights file, or a checkpoint being resumed) was shortened while "
                     "this process read it (SIGBUS)"),
            std::string::npos)
      << out;
}
