// SIGTERM (a scheduler's preemption, `kill`) and SIGINT (Ctrl-C) stop a run after its step with a
// checkpoint it resumes from: the real program, signalled once it trains.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "fusebox/core/checkpoint.h"
#include "fusebox/core/distributed.h"
#include "trainer_test_util.h"

using namespace fusebox::trainer::testing;
namespace fs = std::filesystem;

namespace {

// Starts `trainer ARGS` in `d`, sends SIG`signal` once it has printed "step 3/", and writes its
// exit code and the seconds it took to stop to `code` and `seconds`.
void run_and_terminate(const TempDir& d, const std::string& args,
                       const std::string& signal = "TERM") {
  const std::string trainer = std::string(FUSEBOX_BIN_DIR) + "/trainer";
  const std::string script = d.write("term.sh",
                                     "cd \"$(dirname \"$0\")\"\n"
                                     "timeout -k 30 300 " +
                                         trainer + " " + args +
                                         R"sh( >out.txt 2>err.txt & p=$!
for i in $(seq 1200); do grep -q "step 3/" out.txt 2>/dev/null && break; sleep 0.1; done
kill -)sh" + signal + R"sh( $p
start=$(date +%s)
wait $p
echo $? >code
echo $(( $(date +%s) - start )) >seconds
)sh");
  ASSERT_EQ(std::system(("bash " + script).c_str()), 0);
}

// "after step N: saved" -> N, or -1.
int64_t stopped_after(const std::string& err) {
  const std::string key = "after step ";
  const size_t p = err.find(key);
  return p == std::string::npos ? -1 : std::stoll(err.substr(p + key.size()));
}

}  // namespace

TEST(TrainerInterrupt, SigtermSavesACheckpointAfterTheStepAndTheRunResumesFromIt) {
  TempDir d;
  const std::string args =
      "--optimizer adamw --threads 1 --log-every 1 --max-train-steps 100000000 --output-dir " +
      d.file("out");
  run_and_terminate(d, args);
  const std::string err = read_text(d.file("err.txt"));
  EXPECT_EQ(read_text(d.file("code")), "143\n") << err;  // 128 + SIGTERM
  EXPECT_LT(std::stoi(read_text(d.file("seconds"))), 30);
  EXPECT_EQ(count_lines(err), 1) << err;
  EXPECT_EQ(err.rfind("trainer: stopped by SIGTERM after step ", 0), 0u) << err;
  EXPECT_NE(err.find("; continue with --resume latest"), std::string::npos) << err;
  const int64_t step = stopped_after(err);
  ASSERT_GE(step, 3) << err;
  const fs::path ckpt = fs::path(d.file("out")) / fusebox::checkpoint_name(step);
  EXPECT_NE(err.find("saved " + ckpt.string()), std::string::npos) << err;
  ASSERT_TRUE(fs::exists(ckpt)) << err;
  EXPECT_EQ(fusebox::load_checkpoint(ckpt).counters.at("step"), step);
  EXPECT_EQ(count_lines(read_text(d.file("out/metrics.jsonl"))), step);

  Result r =
      run_program("--optimizer adamw --threads 1 --log-every 100 --output-dir " + d.file("out") +
                      " --resume latest --max-train-steps " + std::to_string(step + 2),
                  d.str());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("(step " + std::to_string(step) + ")"), std::string::npos) << r.out;
  EXPECT_EQ(count_lines(read_text(d.file("out/metrics.jsonl"))), step + 2);
}

// A closed terminal (SIGHUP) stops a run the same way, instead of killing it.
TEST(TrainerInterrupt, SighupSavesACheckpointAfterTheStep) {
  TempDir d;
  run_and_terminate(d,
                    "--optimizer sgd --threads 1 --log-every 1 --max-train-steps 100000000 "
                    "--output-dir " +
                        d.file("out"),
                    "HUP");
  const std::string err = read_text(d.file("err.txt"));
  EXPECT_EQ(read_text(d.file("code")), "129\n") << err;  // 128 + SIGHUP
  EXPECT_EQ(err.rfind("trainer: stopped by SIGHUP after step ", 0), 0u) << err;
  const int64_t step = stopped_after(err);
  ASSERT_GE(step, 3) << err;
  EXPECT_TRUE(fs::exists(fs::path(d.file("out")) / fusebox::checkpoint_name(step))) << err;
}

// The launcher hands the signal to every rank; they agree (in the loss's all-reduce) to stop
// after the same step, and rank 0's checkpoint resumes the job.
TEST(TrainerInterrupt, ADataParallelJobStopsEveryRankAfterTheSameStep) {
  if (!fusebox::distributed_available()) GTEST_SKIP() << "built without c10d";
  TempDir d;
  run_and_terminate(d,
                    "--nproc-per-node 2 --train-batch-size 8 --fused-backward-pass --optimizer "
                    "adamw --threads 1 --log-every 1 --max-train-steps 100000000 --output-dir " +
                        d.file("out"));
  const std::string err = read_text(d.file("err.txt"));
  EXPECT_EQ(read_text(d.file("code")), "143\n") << err;
  EXPECT_EQ(count_lines(err), 1) << "rank 0 speaks for the job: " << err;
  const int64_t step = stopped_after(err);
  ASSERT_GE(step, 3) << err;
  EXPECT_TRUE(fs::exists(fs::path(d.file("out")) / fusebox::checkpoint_name(step))) << err;
}

// Without --output-dir there is nothing to save: the run still stops after its step, and says so.
TEST(TrainerInterrupt, WithoutAnOutputFolderTheStopSaysNothingWasSaved) {
  TempDir d;
  run_and_terminate(
      d, "--optimizer sgd --threads 1 --log-every 1 --max-train-steps 100000000 --output-dir ''");
  const std::string err = read_text(d.file("err.txt"));
  EXPECT_EQ(read_text(d.file("code")), "143\n") << err;
  EXPECT_NE(err.find("(no --output-dir: nothing was saved)"), std::string::npos) << err;
}
