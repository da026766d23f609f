// What the trainer checks before anything trains: folders it cannot write, a --resume that is no
// checkpoint, every [[runs]] entry's checkpoint; and how a command line unsets a config's choice.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include <torch/script.h>

#include "fusebox/core/checkpoint.h"
#include "trainer_test_util.h"

using namespace fusebox::trainer::testing;
namespace fs = std::filesystem;

namespace {

const std::string kQuick = "--optimizer sgd --max-train-steps 3 --threads 1 --log-every 1 ";

// Runs the trainer as an unprivileged user (root writes anywhere, so a read-only folder would
// not refuse it); empty code -1 when that is not possible here.
Result run_unprivileged(const std::string& args, const TempDir& d) {
  std::string prefix;
  if (::geteuid() == 0) {
    prefix = "runuser -u nobody -- ";
    // The build may lie where that user cannot reach it (under /root, say).
    if (std::system((prefix + std::string(FUSEBOX_BIN_DIR) + "/trainer --version >/dev/null 2>&1")
                        .c_str()) != 0)
      return Result{-1, "", ""};
  }
  const std::string cmd = prefix + std::string(FUSEBOX_BIN_DIR) + "/trainer " + args + " >" +
                          d.file("stdout.txt") + " 2>" + d.file("stderr.txt");
  const int status = std::system(cmd.c_str());
  Result r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_text(d.file("stdout.txt")), r.err = read_text(d.file("stderr.txt"));
  return r;
}

}  // namespace

// A folder this user cannot write is refused before the first step, not after the last.
TEST(TrainerPlanning, AFolderThatCannotBeWrittenIsRefusedBeforeTraining) {
  TempDir d;
  ASSERT_EQ(::chmod(d.str().c_str(), 0755), 0);  // others reach the folder below
  const std::string ro = d.file("ro");
  fs::create_directories(ro);
  ASSERT_EQ(::chmod(ro.c_str(), 0555), 0);
  Result r = run_unprivileged(kQuick + "--output-dir " + ro + "/run", d);
  if (r.code == -1) GTEST_SKIP() << "no unprivileged user to run as";
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(
      r.err.find("trainer: error: --output-dir: cannot write in " + ro + " (Permission denied)"),
      std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("step 1/"), std::string::npos) << "it trained first: " << r.out;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;

  r = run_unprivileged(kQuick + "--output-dir '' --save-model " + ro + "/model.pt", d);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("trainer: error: --save-model: cannot write in " + ro), std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("step 1/"), std::string::npos) << r.out;
}

// Permission bits let root write anywhere, but /proc takes no new files even from root: the
// trainer tries to make an entry, so the refusal still comes before the first step.
TEST(TrainerPlanning, AFolderThatTakesNoNewFilesIsRefusedBeforeTraining) {
  std::error_code ec;
  if (!fs::exists("/proc/self", ec)) GTEST_SKIP() << "no /proc here";
  TempDir d;
  // Root passes the permission check and meets the file system's refusal; another user is
  // refused by the permission check already. Either way it names the option and the folder.
  const std::string why = ::geteuid() == 0 ? "cannot create files in " : "cannot write in ";
  Result r = run_program(kQuick + "--output-dir '' --save-model /proc/fusebox-model.pt", d.str());
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("trainer: error: --save-model: " + why + "/proc ("), std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("step 1/"), std::string::npos) << "it trained first: " << r.out;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;

  r = run_program(kQuick + "--output-dir /proc/fusebox-run", d.str());
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("trainer: error: --output-dir: " + why + "/proc ("), std::string::npos)
      << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
}

TEST(TrainerPlanning, SaveModelMayGoIntoTheOutputFolderItMakes) {
  TempDir d;
  Result r = run_program(
      kQuick + "--output-dir " + d.file("new/run") + " --save-model " + d.file("new/run/model.pt"),
      d.str());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(fs::is_regular_file(d.file("new/run/model.pt")));
  // A folder below the output folder is made too.
  r = run_program(
      kQuick + "--output-dir " + d.file("sm") + " --save-model " + d.file("sm/sub/deeper/model.pt"),
      d.str());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(fs::is_regular_file(d.file("sm/sub/deeper/model.pt")));
  r = run_program(
      kQuick + "--output-dir " + d.file("out") + " --save-model " + d.file("elsewhere/model.pt"),
      d.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--save-model: folder " + d.file("elsewhere") + " does not exist"),
            std::string::npos)
      << r.err;
}

TEST(TrainerPlanning, AResumeThatIsNoCheckpointFileOrFolderIsRefused) {
  TempDir d;
  const std::string fifo = d.file("pipe");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  Result r = run_program(kQuick + "--output-dir " + d.file("out") + " --resume " + fifo, d.str());
  EXPECT_EQ(r.code, 2) << "a pipe would block the trainer: " << r.err;
  EXPECT_NE(r.err.find("--resume: " + fifo + " is neither a checkpoint file nor a folder"),
            std::string::npos)
      << r.err;
  // Saving periodically without an output folder blames the option that asks for it.
  r = run_program(kQuick + "--output-dir '' --save-every-n-steps 2 --resume " + fifo, d.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--resume"), std::string::npos) << "the pipe first: " << r.err;
  r = run_program(kQuick + "--output-dir '' --save-every-n-steps 2", d.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("trainer: error: --save-every-n-steps: checkpoints live in --output-dir"),
            std::string::npos)
      << r.err;
}

// The command line overrides the config: an empty path unsets one, groups 0 switch groups off.
TEST(TrainerPlanning, TheCommandLineUnsetsAConfigsResumeSaveModelAndGroups) {
  TempDir d;
  const std::string config = d.write("run.toml",
                                     "optimizer = \"sgd\"\n"
                                     "fused_optimizer_groups = 2\n"
                                     "resume = \"latest\"\n"
                                     "save_model = \"" +
                                         d.file("model.pt") + "\"\n");
  Result r = run_program("--config " + config + " --max-train-steps 2 --threads 1 --output-dir " +
                             d.file("out") +
                             " --resume '' --save-model '' --fused-optimizer-groups 0 "
                             "--fused-backward-pass",
                         d.str());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("(fused"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(d.file("model.pt")));
  EXPECT_EQ(r.out.find("resuming"), std::string::npos) << r.out;
}

// Every [[runs]] entry's checkpoint is looked up before the first run trains; a later run that
// fails in its set-up after an earlier one trained is named, with exit 3 (something trained).
TEST(TrainerPlanning, EveryRunsCheckpointIsFoundBeforeAnyRunTrains) {
  TempDir d;
  const std::string config = d.write("runs.toml",
                                     "optimizer = \"sgd\"\n"
                                     "max_train_steps = 3\n"
                                     "threads = 1\n"
                                     "output_dir = \"" +
                                         d.file("out") +
                                         "\"\n"
                                         "[[runs]]\nname = \"a\"\n"
                                         "[[runs]]\nname = \"b\"\nmodel_width = 32\n");
  Result r = run_program("--config " + config + " --run a", d.str());
  ASSERT_EQ(r.code, 0) << r.err;
  r = run_program("--config " + config + " --max-train-steps 6 --resume latest", d.str());
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("trainer: error: run 'b': --resume latest: no checkpoint-*.fbx in"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(d.file("out/a/" + fusebox::checkpoint_name(6)))) << "run a trained";

  // b's checkpoint exists but is of another model width: found only when b starts.
  r = run_program("--config " + config + " --run b --model-width 16", d.str());
  ASSERT_EQ(r.code, 0) << r.err;
  r = run_program("--config " + config + " --max-train-steps 6 --resume latest", d.str());
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("trainer: error: run 'b': --resume"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("(after 1 earlier run(s) completed)"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::exists(d.file("out/a/" + fusebox::checkpoint_name(6))));
}

// Two trainers writing one output folder at once would interleave their metrics and checkpoints:
// the second is refused, naming the first, and the folder is free again once the first ends.
TEST(TrainerPlanning, ASecondTrainerInAFolderInUseIsRefused) {
  TempDir d;
  const std::string trainer = std::string(FUSEBOX_BIN_DIR) + "/trainer";
  const std::string args = "--optimizer sgd --threads 1 --log-every 1 --output-dir " +
                           d.file("out") + " --max-train-steps ";
  const std::string script = d.write(
      "two.sh",
      "cd \"$(dirname \"$0\")\"\ntimeout -k 30 300 " + trainer + " " + args +
          "100000000 >first.out 2>first.err & p=$!\n" +
          R"sh(for i in $(seq 1200); do grep -q "step 3/" first.out 2>/dev/null && break; sleep 0.1; done
echo $p >pid
)sh" + "timeout -k 5 120 " +
          trainer + " " + args + "3 >second.out 2>second.err\necho $? >code\n" +
          "kill -TERM $p; wait $p\ntrue\n");
  ASSERT_EQ(std::system(("bash " + script).c_str()), 0);
  const std::string err = read_text(d.file("second.err"));
  EXPECT_EQ(read_text(d.file("code")), "2\n") << err;
  EXPECT_NE(err.find("trainer: error: --output-dir: another trainer is writing " + d.file("out") +
                     " now; wait for it to finish"),
            std::string::npos)
      << err;
  EXPECT_EQ(read_text(d.file("second.out")).find("step 1/"), std::string::npos);
  // The first has stopped (SIGTERM): the folder is free again.
  const Result r = run_program(args + "2", d.str());
  EXPECT_EQ(r.code, 0) << r.err;
}

// A script whose loss ignores its parameters has nothing to train: one line naming the script,
// not autograd's "element 0 of tensors does not require grad".
TEST(TrainerPlanning, ALossWithoutTrainableParametersNamesTheScript) {
  TempDir d;
  torch::jit::Module m("Net");
  m.register_parameter("w", torch::ones({8, 1}), false);
  m.define(R"(
def forward(self, x):
    return (x ** 2).mean()
)");
  const std::string script = d.file("nograd.pt");
  m.save(script);
  const Result r =
      run_program(kQuick + "--output-dir '' --model-width 8 --model-script " + script, d.str());
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("the model's loss does not depend on any trainable parameter, so there is "
                       "nothing to train (check that --model-script " +
                       script + "'s forward uses its parameters)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
}
