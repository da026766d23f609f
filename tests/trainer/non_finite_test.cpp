// --on-non-finite skip: skipped steps are counted, a run that only skips is stopped after
// --max-consecutive-skips steps in a row, and skip is refused outside normal mode.
#include <gtest/gtest.h>
#include <torch/script.h>

#include <sstream>
#include <string>
#include <vector>

#include "fusebox/core/checkpoint.h"
#include "trainer_test_util.h"

using namespace fusebox::trainer::testing;
namespace fs = std::filesystem;

namespace {

// A TorchScript model whose loss is NaN on every third call, so exactly those steps are skipped.
std::string nan_every_third_step_model(const TempDir& tmp) {
  torch::jit::Module m("Net");
  torch::manual_seed(0);
  m.register_parameter("w", torch::randn({8, 1}), false);
  m.register_buffer("calls", torch::zeros({1}));
  m.define(R"(
def forward(self, x):
    self.calls.add_(1.0)
    loss = ((x.matmul(self.w) - x.sum(1, keepdim=True)) ** 2).mean()
    if int(self.calls.item()) % 3 == 0:
        loss = loss * float("nan")
    return loss
)");
  const std::string path = tmp.file("nan_every_third.pt");
  m.save(path);
  return path;
}

}  // namespace

TEST(TrainerNonFinite, SkippedStepsAreCountedAndTheRunGoesOn) {
  TempDir tmp;
  const std::string args = "--model-script " + nan_every_third_step_model(tmp) +
                           " --model-width 8 --threads 1 --optimizer sgd --learning-rate 0.01 "
                           "--max-train-steps 12 --on-non-finite skip --log-every 100";
  auto r = run_program(args + " --output-dir " + tmp.file("a"), tmp.str());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(count_lines(r.err), 4) << r.err;  // steps 3, 6, 9, 12
  EXPECT_NE(r.err.find("non-finite loss at step 12: this step's update was skipped"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.out.find("4 steps skipped (non-finite)"), std::string::npos) << r.out;
  EXPECT_NE(read_text(tmp.file("a/summary.json")).find("\"skipped_steps\":4"), std::string::npos);
  // A skipped step's NaN loss: null in JSON (which has no NaN), the number itself in the CSV.
  EXPECT_NE(read_text(tmp.file("a/metrics.jsonl")).find("{\"step\":3,\"loss\":null,"),
            std::string::npos);
  EXPECT_NE(read_text(tmp.file("a/metrics.csv")).find("\n3,nan,"), std::string::npos)
      << read_text(tmp.file("a/metrics.csv"));

  // A skipped step does not use up the schedule: with a linear decay the step after a skip
  // trains at the skipped step's lr.
  r = run_program(args + " --lr-scheduler linear --output-dir " + tmp.file("lin"), tmp.str());
  ASSERT_EQ(r.code, 0) << r.err;
  std::vector<std::string> lr;  // metrics.csv's lr_0 column, by step
  std::istringstream csv(read_text(tmp.file("lin/metrics.csv")));
  std::string line;
  std::getline(csv, line);  // header: step,loss,lr_0,...
  while (std::getline(csv, line)) {
    const size_t a = line.find(',', line.find(',') + 1);
    lr.push_back(line.substr(a + 1, line.find(',', a + 1) - a - 1));
  }
  ASSERT_EQ(lr.size(), 12u);
  EXPECT_EQ(lr[3], lr[2]);  // step 4 after the skipped step 3
  EXPECT_NE(lr[2], lr[1]);  // otherwise the lr decays every step
  EXPECT_EQ(lr[6], lr[5]);

  // A limit of one skip in a row ends the run at the first one, before its checkpoint.
  r = run_program(
      args + " --max-consecutive-skips 1 --save-every-n-steps 1 --output-dir " + tmp.file("b"),
      tmp.str());
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("trainer: error: training failed at step 3: the last 1 steps were all "
                       "skipped"),
            std::string::npos)
      << r.err;
  EXPECT_TRUE(fs::exists(tmp.file("b/" + fusebox::checkpoint_name(2))));
  EXPECT_FALSE(fs::exists(tmp.file("b/" + fusebox::checkpoint_name(3))));
}

// A learning rate that blows the weights up makes every later loss non-finite: skipping cannot
// recover, so the run stops after --max-consecutive-skips steps instead of "succeeding".
TEST(TrainerNonFinite, ARunThatOnlySkipsIsStopped) {
  TempDir tmp;
  const std::string base =
      "--model mlp --model-width 8 --threads 1 --optimizer sgd --learning-rate 1e6 "
      "--max-train-steps 40 --on-non-finite skip --output-dir " +
      tmp.file("out");
  auto r = run_program(base, tmp.str());
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("the last 10 steps were all skipped"), std::string::npos) << r.err;
  EXPECT_EQ(count_lines(r.err), 11) << r.err;  // ten warnings, one error
  EXPECT_FALSE(fs::exists(tmp.file("out/summary.json")));

  r = run_program(base + " --max-consecutive-skips 0", tmp.str());  // no limit
  EXPECT_EQ(r.code, 0) << r.err;
  const std::string summary = read_text(tmp.file("out/summary.json"));
  EXPECT_NE(summary.find("\"steps\":40"), std::string::npos) << summary;
  EXPECT_EQ(summary.find("\"skipped_steps\":0"), std::string::npos) << summary;

  // The streak of skipped steps is carried across a resume: with k steps skipped up to step 5
  // (every step after the weights blew up), a limit of 6 stops the resumed run at step 11 - k,
  // where it would have stopped the whole run, not at step 11.
  auto blowing_up = [&](int steps, const std::string& out) {
    return "--model mlp --model-width 8 --threads 1 --optimizer sgd --learning-rate 1e6 "
           "--on-non-finite skip --max-train-steps " +
           std::to_string(steps) + " --output-dir " + tmp.file(out);
  };
  r = run_program(blowing_up(5, "first") + " --max-consecutive-skips 0", tmp.str());
  ASSERT_EQ(r.code, 0) << r.err;
  const int k = count_lines(r.err);  // one warning per skipped step
  ASSERT_GE(k, 2) << r.err;
  r = run_program(blowing_up(40, "resumed") + " --max-consecutive-skips 6 --resume " +
                      tmp.file("first") + "/" + fusebox::checkpoint_name(5),
                  tmp.str());
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("training failed at step " + std::to_string(11 - k) +
                       ": the last 6 steps were all skipped"),
            std::string::npos)
      << r.err;

  r = run_program(base + " --fused-backward-pass", tmp.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--on-non-finite: skip is possible only in normal mode"), std::string::npos)
      << r.err;
}

// On a terminal the progress bar is redrawn in place; a warning printed mid-run (to the same
// terminal) starts on a line of its own instead of being appended to the bar, and the bar goes
// on below it. Both sources: the trainer's skipped-step warning and a step mode's (a parameter
// without a gradient in the fused mode).
TEST(TrainerNonFinite, WarningsDuringTrainingStartOnTheirOwnLineBelowTheProgressBar) {
  TempDir tmp;
  torch::jit::Module m("Net");
  m.register_parameter("w", torch::ones({8, 1}), false);
  m.register_parameter("unused", torch::ones({2}), false);
  m.define(R"(
def forward(self, x):
    return ((x.matmul(self.w) - x.sum(1, keepdim=True)) ** 2).mean()
)");
  const std::string unused_model = tmp.file("unused.pt");
  m.save(unused_model);
  const std::vector<std::vector<std::string>> runs = {
      {"--model-script", nan_every_third_step_model(tmp), "--on-non-finite", "skip"},
      {"--model-script", unused_model, "--fused-backward-pass"}};
  for (std::vector<std::string> args : runs) {
    for (const char* a : {"--model-width", "8", "--threads", "1", "--optimizer", "sgd",
                          "--learning-rate", "0.01", "--max-train-steps", "6", "--output-dir", ""})
      args.push_back(a);
    std::ostringstream screen;  // stdout and stderr on one terminal
    ASSERT_EQ(fusebox::trainer::trainer_main(args, screen, screen, true), 0) << screen.str();
    const std::string s = screen.str();
    size_t warnings = 0;
    for (size_t p = s.find("trainer: warning:"); p != std::string::npos;
         p = s.find("trainer: warning:", p + 1), ++warnings)
      EXPECT_TRUE(p == 0 || s[p - 1] == '\n') << "a warning on the bar's line:\n" << s;
    EXPECT_GE(warnings, 1u) << s;
    EXPECT_NE(s.find("] 6/6  loss "), std::string::npos) << s;  // the bar went on to the end
  }
}
