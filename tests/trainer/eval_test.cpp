// --eval-every: held-out losses after every N steps and the last, the same batches each time,
// and nothing of the training changed by them (losses, resume, a script model's buffers and
// random numbers).
#include <gtest/gtest.h>
#include <torch/script.h>

#include <map>
#include <string>
#include <vector>

#include "fusebox/core/checkpoint.h"
#include "trainer_test_util.h"

namespace fusebox::trainer {
namespace {

using testing::join;
using testing::losses;
using testing::read_text;
using testing::Result;
using testing::run_trainer;
using testing::TempDir;

// step -> eval_loss of the records that have one.
std::map<int64_t, double> eval_losses(const std::string& jsonl_path) {
  std::map<int64_t, double> out;
  std::istringstream in(read_text(jsonl_path));
  std::string line;
  while (std::getline(in, line)) {
    const size_t e = line.find("\"eval_loss\":");
    if (e != std::string::npos) out[std::stoll(line.substr(8))] = std::stod(line.substr(e + 12));
  }
  return out;
}

std::vector<std::string> transformer(const std::string& out, int steps) {
  return {"--model",           "transformer",
          "--model-width",     "16",
          "--model-depth",     "1",
          "--seq-len",         "8",
          "--optimizer",       "adamw",
          "--threads",         "1",
          "--max-train-steps", std::to_string(steps),
          "--log-every",       "0",
          "--output-dir",      out};
}

}  // namespace

TEST(TrainerEval, EvaluatesEveryNStepsAndLastAndChangesNoTrainingInAnyMode) {
  TempDir tmp;
  const Result plain = run_trainer(transformer(tmp.file("plain"), 5));
  ASSERT_EQ(plain.code, 0) << plain.err;
  std::map<int64_t, double> reference;
  for (const std::vector<std::string>& mode :
       {std::vector<std::string>{}, {"--fused-backward-pass"}, {"--fused-optimizer-groups", "2"}}) {
    const std::string out = tmp.file("eval" + std::to_string(mode.size()));
    const Result r = run_trainer(join(transformer(out, 5), join(mode, {"--eval-every", "2"})));
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(losses(out + "/metrics.jsonl"), losses(tmp.file("plain/metrics.jsonl")));
    const std::map<int64_t, double> evals = eval_losses(out + "/metrics.jsonl");
    ASSERT_EQ(evals.size(), 3u) << read_text(out + "/metrics.jsonl");
    EXPECT_TRUE(evals.count(2) && evals.count(4) && evals.count(5));
    EXPECT_NE(evals.at(2), evals.at(4)) << "the model trains between evaluations";
    if (reference.empty()) reference = evals;
    EXPECT_EQ(evals, reference) << "the same parameters in every mode: the same evaluations";
    const std::string summary = read_text(out + "/summary.json");
    EXPECT_NE(summary.find("\"eval_loss\":"), std::string::npos) << summary;
    EXPECT_EQ(std::stod(summary.substr(summary.find("\"eval_loss\":") + 12)), evals.at(5));
    const std::string csv = read_text(out + "/metrics.csv");
    EXPECT_NE(csv.find(",eval_loss\n"), std::string::npos) << csv;
    EXPECT_NE(r.out.find("; eval: 4 batches every 2 steps;"), std::string::npos) << r.out;
  }
}

TEST(TrainerEval, EveryEvaluationSeesTheSameHeldOutBatches) {
  TempDir tmp;
  // A learning rate too small to move a float32 weight: the evaluations differ only if their
  // batches do.
  const Result r =
      run_trainer(join(transformer(tmp.file("out"), 4), {"--eval-every", "1", "--optimizer-args",
                                                         "lr=1e-30", "--eval-batches", "2"}));
  ASSERT_EQ(r.code, 0) << r.err;
  const std::map<int64_t, double> evals = eval_losses(tmp.file("out/metrics.jsonl"));
  ASSERT_EQ(evals.size(), 4u);
  for (const auto& [step, loss] : evals) EXPECT_EQ(loss, evals.at(1)) << "step " << step;
  // ... and they are not the training batches: those give other losses at every step.
  const std::vector<double> train = losses(tmp.file("out/metrics.jsonl"));
  EXPECT_NE(train[0], train[1]);
  for (double l : train) EXPECT_NE(l, evals.at(1));
  // A held-out text file of its own is another set of batches.
  const std::string text =
      std::string(FUSEBOX_TEST_DATA) + "/../../data/pride-and-prejudice-ch1.txt";
  const std::string other = tmp.write("other.txt", std::string(300, 'a') + "the end");
  const Result a = run_trainer(
      join(transformer(tmp.file("a"), 2), {"--dataset", "text:" + text, "--eval-every", "2"}));
  const Result b =
      run_trainer(join(transformer(tmp.file("b"), 2), {"--dataset", "text:" + text, "--eval-every",
                                                       "2", "--eval-dataset", "text:" + other}));
  ASSERT_EQ(a.code, 0) << a.err;
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_EQ(losses(tmp.file("a/metrics.jsonl")), losses(tmp.file("b/metrics.jsonl")));
  EXPECT_NE(eval_losses(tmp.file("a/metrics.jsonl")), eval_losses(tmp.file("b/metrics.jsonl")));
}

TEST(TrainerEval, AResumedRunEvaluatesAsTheUninterruptedOne) {
  TempDir tmp;
  const std::vector<std::string> eval = {"--eval-every", "2"};
  Result r = run_trainer(
      join(transformer(tmp.file("whole"), 6), join(eval, {"--save-every-n-steps", "3"})));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run_trainer(join(transformer(tmp.file("split"), 6),
                       join(eval, {"--resume", tmp.file("whole") + "/" + checkpoint_name(3)})));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto whole = eval_losses(tmp.file("whole/metrics.jsonl"));
  const auto split = eval_losses(tmp.file("split/metrics.jsonl"));
  ASSERT_EQ(whole.size(), 3u);
  EXPECT_EQ(split.at(4), whole.at(4));
  EXPECT_EQ(split.at(6), whole.at(6));
}

// A script model is evaluated in evaluation mode and gives training back its state: this one
// counts its training forwards in a buffer and returns that count as its loss when not training,
// and draws from the default generator in every forward.
TEST(TrainerEval, AScriptModelIsEvaluatedInEvaluationModeWithoutChangingItsState) {
  TempDir tmp;
  torch::jit::Module m("Counter");
  torch::manual_seed(0);
  m.register_parameter("w", torch::randn({4, 1}, torch::kFloat64), false);
  m.register_buffer("seen", torch::zeros({1}, torch::kFloat64));
  m.register_attribute("training", c10::BoolType::get(), true);  // as Python's modules have
  m.define(R"(
def forward(self, x):
    noise = torch.rand([x.size(0)], dtype=x.dtype)
    loss = ((x.matmul(self.w).squeeze(1) - x.sum(1) + 0.1 * noise) ** 2).mean()
    if self.training:
        self.seen = self.seen + 1.0
        return loss
    return loss * 0.0 + self.seen.sum()
)");
  const std::string script = tmp.file("counter.pt");
  m.save(script);
  auto run = [&](const std::string& out, const std::vector<std::string>& extra) {
    return run_trainer(join({"--model-script", script, "--model-width", "4", "--dtype", "float64",
                             "--optimizer", "sgd", "--max-train-steps", "5", "--log-every", "0",
                             "--threads", "1", "--output-dir", tmp.file(out)},
                            extra));
  };
  Result plain = run("plain", {}), evaluated = run("evaluated", {"--eval-every", "2"});
  ASSERT_EQ(plain.code, 0) << plain.err;
  ASSERT_EQ(evaluated.code, 0) << evaluated.err;
  EXPECT_EQ(losses(tmp.file("plain/metrics.jsonl")), losses(tmp.file("evaluated/metrics.jsonl")));
  const std::map<int64_t, double> evals = eval_losses(tmp.file("evaluated/metrics.jsonl"));
  EXPECT_EQ(evals, (std::map<int64_t, double>{{2, 2.0}, {4, 4.0}, {5, 5.0}}));
}

TEST(TrainerEval, AnEvaluationSettingWithoutEveryIsNamedInAWarning) {
  TempDir tmp;
  const Result r = run_trainer(join(transformer(tmp.file("out"), 1), {"--eval-batches", "2"}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("trainer: warning: --eval-batches has no effect without --eval-every N"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(read_text(tmp.file("out/metrics.jsonl")).find("eval_loss"), std::string::npos);
}

}  // namespace fusebox::trainer
