// --ema-decay: an average of the parameters after every step, kept in checkpoints, evaluated and
// saved by --save-model, the same in every mode and across a resume; training itself unchanged.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
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

std::vector<std::string> mlp(const std::string& out, int steps) {
  return {"--optimizer",      "adamw",  "--model-width",     "16",
          "--threads",        "1",      "--max-train-steps", std::to_string(steps),
          "--log-every",      "0",      "--output-dir",      out,
          "--optimizer-args", "lr=0.05"};
}

std::string checkpoint_file(const std::string& dir, int64_t step) {
  return dir + "/" + checkpoint_name(step);
}

}  // namespace

// Each checkpoint's average is the one before it moved toward that step's parameters, with the
// warm-up decay; --save-model writes the last average, not the trained parameters.
TEST(TrainerEma, TheAverageFollowsEveryStepAndIsWhatSaveModelWrites) {
  TempDir tmp;
  const std::string out = tmp.file("ema");
  const Result r = run_trainer(join(mlp(out, 5), {"--ema-decay", "0.6", "--save-every-n-steps", "1",
                                                  "--save-model", tmp.file("ema.pt")}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("EMA of the parameters: decay 0.6"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" + EMA "), std::string::npos) << "the memory line counts it: " << r.out;
  Checkpoint previous = load_checkpoint(checkpoint_file(out, 1));
  EXPECT_EQ(previous.counters.at("ema_updates"), 1);
  for (int64_t step = 2; step <= 5; ++step) {
    const Checkpoint now = load_checkpoint(checkpoint_file(out, step));
    ASSERT_EQ(now.counters.at("ema_updates"), step);
    const double d = std::min(
        0.6, (1.0 + static_cast<double>(step - 1)) / (10.0 + static_cast<double>(step - 1)));
    ASSERT_EQ(now.ema.size(), now.model.size());
    for (const auto& [name, avg] : now.ema) {
      const at::Tensor expected =
          previous.ema.at(name).clone().mul_(d).add_(now.model.at(name), 1 - d);
      EXPECT_TRUE(at::equal(avg, expected)) << name << " at step " << step;
    }
    previous = now;
  }
  const auto saved = load_model_weights(tmp.file("ema.pt"));
  for (const auto& [name, t] : saved) {
    EXPECT_TRUE(at::equal(t, previous.ema.at(name))) << name;
    EXPECT_FALSE(at::equal(t, previous.model.at(name))) << name;
  }
}

// The average changes no step of the training; normal, fused and grouped runs average alike; a
// resumed run ends with the uninterrupted run's average.
TEST(TrainerEma, TrainingIsUnchangedAndEveryModeAndAResumeGiveTheSameAverage) {
  TempDir tmp;
  const Result plain = run_trainer(mlp(tmp.file("plain"), 6));
  ASSERT_EQ(plain.code, 0) << plain.err;
  std::string reference;
  for (const std::vector<std::string>& mode :
       {std::vector<std::string>{}, {"--fused-backward-pass"}, {"--fused-optimizer-groups", "2"}}) {
    const std::string name = "mode" + std::to_string(mode.size());
    const Result r = run_trainer(
        join(mlp(tmp.file(name), 6), join(mode, {"--ema-decay", "0.9", "--save-every-n-steps", "3",
                                                 "--save-model", tmp.file(name + ".pt")})));
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(losses(tmp.file(name + "/metrics.jsonl")), losses(tmp.file("plain/metrics.jsonl")));
    const std::string bytes = read_text(tmp.file(name + ".pt"));
    if (reference.empty()) reference = bytes;
    EXPECT_TRUE(bytes == reference) << name << " averaged otherwise";
  }
  const Result resumed = run_trainer(join(
      mlp(tmp.file("resumed"), 6), {"--ema-decay", "0.9", "--save-model", tmp.file("resumed.pt"),
                                    "--resume", checkpoint_file(tmp.file("mode0"), 3)}));
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_EQ(resumed.err, "");
  EXPECT_TRUE(read_text(tmp.file("resumed.pt")) == reference);
  // A checkpoint without an average: the average starts from the resumed parameters, said so.
  const Result from_plain =
      run_trainer(join(mlp(tmp.file("from_plain"), 6),
                       {"--ema-decay", "0.9", "--resume", checkpoint_file(tmp.file("plain"), 6),
                        "--max-train-steps", "7"}));
  ASSERT_EQ(from_plain.code, 0) << from_plain.err;
  EXPECT_NE(from_plain.err.find("the checkpoint holds no parameter average"), std::string::npos)
      << from_plain.err;
}

TEST(TrainerEma, EvaluationsMeasureTheAverage) {
  TempDir tmp;
  const std::vector<std::string> eval = {"--eval-every", "2"};
  const Result a = run_trainer(join(mlp(tmp.file("a"), 4), eval));
  const Result b = run_trainer(join(mlp(tmp.file("b"), 4), join(eval, {"--ema-decay", "0.9"})));
  ASSERT_EQ(a.code, 0) << a.err;
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_EQ(losses(tmp.file("a/metrics.jsonl")), losses(tmp.file("b/metrics.jsonl")));
  const std::string sa = read_text(tmp.file("a/summary.json")),
                    sb = read_text(tmp.file("b/summary.json"));
  const auto eval_loss = [](const std::string& s) {
    return std::stod(s.substr(s.find("\"eval_loss\":") + 12));
  };
  EXPECT_NE(eval_loss(sa), eval_loss(sb)) << "the average is not the trained parameters";
}

TEST(TrainerEma, BadSettingsAndCorruptAveragesAreOneLineErrors) {
  TempDir tmp;
  Result r = run_trainer(join(mlp(tmp.file("x"), 2), {"--ema-decay", "1"}));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--ema-decay: 1.0 would never move the average"), std::string::npos)
      << r.err;
  r = run_trainer(join(mlp(tmp.file("x"), 2), {"--ema-decay", "-0.5"}));
  EXPECT_EQ(r.code, 2);
  const std::string out = tmp.file("ok");
  ASSERT_EQ(run_trainer(join(mlp(out, 2), {"--ema-decay", "0.9"})).code, 0);
  Checkpoint ckpt = load_checkpoint(checkpoint_file(out, 2));
  ckpt.ema.begin()->second = at::zeros({7});
  save_checkpoint(ckpt, tmp.file("bad.fbx"));
  r = run_trainer(
      join(mlp(tmp.file("y"), 3), {"--ema-decay", "0.9", "--resume", tmp.file("bad.fbx")}));
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--resume: EMA: the saved average of"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

}  // namespace fusebox::trainer
