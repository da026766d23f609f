// --eval-every: held-out losses after every N steps and the last, the same batches each time,
// and nothing of the training changed by them (losses, resume, a script model's buffers and
// random numbers).
#include <gtest/gtest.h>
#include <torch/script.h>

#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "config.h"
#include "data.h"
#include "fusebox/core/checkpoint.h"
#include "fusebox/core/distributed.h"
#include "fusebox/core/safetensors.h"
#include "fusebox/error.h"
#include "trainer_test_util.h"

namespace fusebox::trainer {
namespace {

using testing::join;
using testing::losses;
using testing::read_text;
using testing::Result;
using testing::run_trainer;
using testing::TempDir;
using testing::two_step_epochs_run;

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

// A TorchScript model whose loss is `loss`, a mean over its batch `x` ("x.mean()"), saved in
// `tmp`: its evaluation is then a mean over what the evaluation's batches held.
std::string mean_script(const TempDir& tmp, const std::string& loss) {
  torch::jit::Module m("Mean");
  m.register_parameter("w", torch::zeros({1}, torch::kFloat64), false);
  m.define("def forward(self, x):\n    return " + loss + " + 0.0 * self.w.sum()\n");
  m.save(tmp.file("mean.pt"));
  return tmp.file("mean.pt");
}

// Two float64 sgd steps of `script` on `dataset` (`extra` options added), half of it held out
// and evaluated at step 2 with --eval-batches 0, in batches of 4.
std::vector<std::string> eval_pass_run(const std::string& script, const std::string& dataset,
                                       const std::vector<std::string>& extra = {}) {
  return join({"--model-script", script,    "--dataset",      dataset, "--eval-holdout",     "0.5",
               "--eval-every",   "2",       "--eval-batches", "0",     "--train-batch-size", "4",
               "--dtype",        "float64", "--optimizer",    "sgd",   "--max-train-steps",  "2",
               "--log-every",    "0",       "--threads",      "1"},
              extra);
}

// Step 2's evaluation by `ranks` processes started by the program itself (only it starts ranks).
double eval_with_ranks(const std::vector<std::string>& args, const std::string& ranks,
                       const TempDir& tmp) {
  std::string line = "--plugin-dir " + std::string(FUSEBOX_PLUGIN_DIR);
  for (const std::string& a : args) line += " " + a;
  const std::string out = tmp.file("ranks" + ranks);
  const Result many =
      testing::run_program(line + " --nproc-per-node " + ranks + " --output-dir " + out, tmp.str());
  EXPECT_EQ(many.code, 0) << many.err;
  return eval_losses(out + "/metrics.jsonl").at(2);
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

// --eval-batches 0: every held-out sample once, the last batch smaller, each batch weighted by
// its samples. The script's loss is the batch's mean of x, so the evaluation must be the mean of
// the held-out rows exactly (batches weighted alike would give another number: the last batch
// holds 3 of 11 samples). Two ranks and four (one of which has no batch of the pass) agree.
TEST(TrainerEval, EvalBatchesZeroEvaluatesEveryHeldOutSampleOnce) {
  TempDir tmp;
  torch::manual_seed(3);
  const at::Tensor x = torch::randn({23, 3}, torch::kFloat64) + 1.0;
  save_safetensors({{"x", x}}, tmp.file("x.safetensors"));
  const double expected = x.narrow(0, 12, 11).mean().item<double>();  // floor(23 x 0.5) held out
  const std::vector<std::string> args =
      eval_pass_run(mean_script(tmp, "x.mean()"), "tensors:" + tmp.file("x.safetensors"));
  const Result one = run_trainer(join(args, {"--output-dir", tmp.file("one")}));
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_NE(one.out.find("; eval: every sample (3 batches) every 2 steps from tensors "),
            std::string::npos)
      << one.out;
  const std::map<int64_t, double> evals = eval_losses(tmp.file("one/metrics.jsonl"));
  ASSERT_EQ(evals.size(), 1u);
  EXPECT_NEAR(evals.at(2), expected, 1e-12);
  if (fusebox::distributed_available()) {
    for (const std::string ranks : {"2", "4"})
      EXPECT_NEAR(eval_with_ranks(args, ranks, tmp), expected, 1e-12) << ranks;
  }

  // Data without a pass over samples: refused before training, saying what to give.
  const Result synthetic = run_trainer(
      join(transformer(tmp.file("synthetic"), 1), {"--eval-every", "1", "--eval-batches", "0"}));
  EXPECT_EQ(synthetic.code, 2);
  EXPECT_EQ(synthetic.err,
            "trainer: error: --eval-batches: 0 evaluates every sample of a tensors or text file "
            "once, and the evaluation's data are synthetic (give --eval-dataset tensors:PATH or "
            "text:PATH, or --dataset tensors:PATH or text:PATH with --eval-holdout F; or N >= 1 "
            "batches)\n");
}

// --eval-batches 0 over text: the held-out bytes as windows of --seq-len + 1 that start every
// --seq-len bytes (each byte after the first predicted once, as a token stream's windows), the
// last batch smaller. The script's loss is its window batch's mean byte, so the evaluation must be
// the mean over those windows exactly: 9 windows in batches of 4, 4 and 1 (weighting the batches
// alike would give another number). Two ranks agree.
TEST(TrainerEval, EvalBatchesZeroEvaluatesEveryWindowOfAHeldOutTextOnce) {
  TempDir tmp;
  std::string text;
  for (int i = 0; i < 101; ++i) text += static_cast<char>('a' + (i * i * 7 + i) % 26);
  std::ofstream(tmp.file("t.txt"), std::ios::binary) << text;
  const int64_t held = 50, seq_len = 5, windows = (held - 1) / seq_len;  // floor(101 x 0.5)
  double sum = 0;
  for (int64_t k = 0; k < windows; ++k)
    for (int64_t j = 0; j <= seq_len; ++j)
      sum += static_cast<unsigned char>(text[101 - held + k * seq_len + j]);
  const double expected = sum / static_cast<double>(windows * (seq_len + 1));
  const std::vector<std::string> args = eval_pass_run(
      mean_script(tmp, "x.double().mean()"), "text:" + tmp.file("t.txt"), {"--seq-len", "5"});
  const Result one = run_trainer(join(args, {"--output-dir", tmp.file("one")}));
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_NE(one.out.find("; eval: every window (3 batches) every 2 steps from text " +
                         tmp.file("t.txt") + " (the last 50 of 101 bytes, held out"),
            std::string::npos)
      << one.out;
  EXPECT_NEAR(eval_losses(tmp.file("one/metrics.jsonl")).at(2), expected, 1e-12);
  if (fusebox::distributed_available()) {
    EXPECT_NEAR(eval_with_ranks(args, "2", tmp), expected, 1e-12);
  }
}

// --eval-every-n-epochs: an evaluation after the step in which each epoch ends (8 training
// samples in batches of 4: every 2 steps), beside --eval-every's and the last one.
TEST(TrainerEval, EvaluatesWhereEpochsEnd) {
  TempDir tmp;
  const at::Tensor input = at::arange(20, at::kFloat).reshape({10, 2}) / 20;
  save_safetensors({{"input", input}, {"target", input.sum(1)}}, tmp.file("d.safetensors"));
  const std::vector<std::string> args =
      two_step_epochs_run(tmp.file("d.safetensors"), "--eval-every-n-epochs");
  auto steps_of = [&](const std::string& out) {
    std::set<int64_t> steps;
    for (const auto& [step, loss] : eval_losses(out + "/metrics.jsonl")) steps.insert(step);
    return steps;
  };
  Result r = run_trainer(join(args, {"--output-dir", tmp.file("epochs")}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(steps_of(tmp.file("epochs")), (std::set<int64_t>{2, 4, 6, 7}));
  EXPECT_NE(r.out.find("; eval: 4 batches every epoch from tensors "), std::string::npos) << r.out;
  r = run_trainer(join(args, {"--eval-every", "3", "--output-dir", tmp.file("both")}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(steps_of(tmp.file("both")), (std::set<int64_t>{2, 3, 4, 6, 7}));
  EXPECT_NE(r.out.find("; eval: 4 batches every 3 steps and every epoch from "), std::string::npos)
      << r.out;
  r = run_trainer({"--optimizer", "sgd", "--eval-every-n-epochs", "2", "--output-dir", ""});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err,
            "trainer: error: --eval-every-n-epochs: counts passes over a --dataset tensors:PATH "
            "file's samples, and synthetic data have no epochs; give --eval-every N\n");
}

// --eval-holdout: a text file whose first 900 bytes are 'a' and last 100 'b'. With a tenth held
// out, no training window holds a 'b' and no evaluation window an 'a'; without, training reads
// the end too (so the first check can fail).
TEST(TrainerEval, AHoldoutKeepsTheTextFilesEndFromTraining) {
  TempDir tmp;
  TrainConfig c;
  c.model = "transformer", c.seq_len = 8, c.train_batch_size = 16, c.seed = 3;
  c.dataset = c.eval_dataset = "text";
  c.dataset_path = c.eval_dataset_path =
      tmp.write("ab.txt", std::string(900, 'a') + std::string(100, 'b'));
  auto tokens_seen = [](auto&& next, int batches) {
    std::set<int64_t> seen;
    for (int i = 0; i < batches; ++i) {
      const Batch b = next();
      for (const at::Tensor& t : {b.input, b.target}) {
        const at::Tensor flat = t.contiguous().flatten();
        const int64_t* data = flat.data_ptr<int64_t>();
        seen.insert(data, data + flat.numel());
      }
    }
    return seen;
  };
  const std::set<int64_t> a{'a'}, b{'b'}, ab{'a', 'b'};
  c.eval_holdout = 0.1;
  std::unique_ptr<DataSource> train = make_data(c);
  EvalData eval(c);
  EXPECT_EQ(tokens_seen([&] { return train->next(); }, 200), a);
  EXPECT_EQ(tokens_seen([&] { return eval.next(); }, 20), b);
  EXPECT_EQ(train->describe(),
            "text " + c.dataset_path + " (the first 900 of 1000 bytes, 100 held out)");
  EXPECT_EQ(eval.describe(),
            "text " + c.dataset_path + " (the last 100 of 1000 bytes, held out for evaluation)");
  c.eval_holdout = 0;
  train = make_data(c);
  EXPECT_EQ(tokens_seen([&] { return train->next(); }, 200), ab);
  EvalData whole_file(c);
  EXPECT_EQ(tokens_seen([&] { return whole_file.next(); }, 200), ab);
  // A part shorter than a window is an error that says which and what to do.
  c.eval_holdout = 0.005;
  try {
    EvalData too_short(c);
    ADD_FAILURE() << "5 held-out bytes make no window of 9";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "text file " + c.dataset_path +
                  " (1000 bytes): --eval-holdout 0.005 leaves 5 bytes for evaluation; --seq-len 8 "
                  "needs at least 9 (hold out more, or give a longer file)");
  }
}

// The trainer with --eval-holdout: the run's first line says what is held out; the evaluations
// differ from those of windows anywhere in the file, the training losses too (other windows); a
// holdout too short is refused before training, with --eval-every or without; resuming with
// another holdout is named in a warning (the training data change).
TEST(TrainerEval, TheTrainerTrainsOnTheRestAndEvaluatesOnTheHoldout) {
  TempDir tmp;
  const std::string text =
      std::string(FUSEBOX_TEST_DATA) + "/../../data/pride-and-prejudice-ch1.txt";
  const std::vector<std::string> args = {"--dataset", "text:" + text,         "--eval-every",
                                         "2",         "--save-every-n-steps", "2"};
  const Result whole = run_trainer(join(transformer(tmp.file("whole"), 4), args));
  const Result held =
      run_trainer(join(transformer(tmp.file("held"), 4), join(args, {"--eval-holdout", "0.2"})));
  ASSERT_EQ(whole.code, 0) << whole.err;
  ASSERT_EQ(held.code, 0) << held.err;
  EXPECT_NE(
      held.out.find(" held out); eval: 4 batches every 2 steps from text " + text + " (the last "),
      std::string::npos)
      << held.out;
  EXPECT_EQ(eval_losses(tmp.file("held/metrics.jsonl")).size(), 2u);
  EXPECT_NE(eval_losses(tmp.file("held/metrics.jsonl")),
            eval_losses(tmp.file("whole/metrics.jsonl")));
  EXPECT_NE(losses(tmp.file("held/metrics.jsonl")), losses(tmp.file("whole/metrics.jsonl")));

  const Result resumed =
      run_trainer(join(transformer(tmp.file("resumed"), 4),
                       join(args, {"--eval-holdout", "0.1", "--resume",
                                   tmp.file("held") + "/" + checkpoint_name(2)})));
  EXPECT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("settings differ from the run that wrote"), std::string::npos)
      << resumed.err;
  EXPECT_NE(resumed.err.find("eval_holdout = 0.1 (was 0.2)"), std::string::npos) << resumed.err;

  for (const std::vector<std::string>& every :
       {std::vector<std::string>{"--eval-every", "2"}, {}}) {
    const Result short_part = run_trainer(join(
        transformer(tmp.file("short"), 1),
        join(every, {"--dataset", "text:" + text, "--seq-len", "64", "--eval-holdout", "0.001"})));
    EXPECT_EQ(short_part.code, 2);
    EXPECT_NE(short_part.err.find("--eval-holdout 0.001 leaves "), std::string::npos)
        << short_part.err;
    EXPECT_NE(short_part.err.find(" bytes for evaluation; --seq-len 64 needs at least 65"),
              std::string::npos)
        << short_part.err;
  }
}

// --save-model-at best: with a learning rate this large the first evaluation is the best one (by
// 0.07 and more), so the file holds the parameters after step 1, not the last ones; a run resumed
// from step 4 knows that best and leaves the file alone (forgetting it, it would write step 5's).
TEST(TrainerEval, SaveModelAtBestKeepsTheBestEvaluationsParametersAcrossAResume) {
  TempDir tmp;
  const std::string model = tmp.file("best.pt");
  const std::vector<std::string> args = {
      "--eval-every", "1",   "--optimizer-args", "lr=0.2", "--save-every-n-steps", "1",
      "--save-model", model, "--save-model-at",  "best"};
  const Result r = run_trainer(join(transformer(tmp.file("whole"), 8), args));
  ASSERT_EQ(r.code, 0) << r.err;
  const std::map<int64_t, double> evals = eval_losses(tmp.file("whole/metrics.jsonl"));
  ASSERT_EQ(evals.size(), 8u);
  int64_t best = 1;
  for (const auto& [step, loss] : evals)
    if (loss < evals.at(best)) best = step;
  ASSERT_EQ(best, 1) << "the scenario needs an earlier best evaluation";
  auto same = [](const std::map<std::string, at::Tensor>& a,
                 const std::map<std::string, at::Tensor>& b) {
    if (a.size() != b.size()) return false;
    for (const auto& [name, t] : a)
      if (!b.count(name) || !at::equal(t, b.at(name))) return false;
    return true;
  };
  const auto saved = load_model_weights(model);
  EXPECT_TRUE(same(saved, load_checkpoint(tmp.file("whole/" + checkpoint_name(1))).model));
  EXPECT_FALSE(same(saved, load_checkpoint(tmp.file("whole/" + checkpoint_name(8))).model));
  const std::string summary = read_text(tmp.file("whole/summary.json"));
  EXPECT_NE(summary.find(",\"best_eval_step\":1}"), std::string::npos) << summary;
  EXPECT_NE(r.out.find("; best "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" after step 1)"), std::string::npos) << r.out;

  const std::string bytes = read_text(model);
  const Result resumed =
      run_trainer(join(transformer(tmp.file("resumed"), 8),
                       join(args, {"--resume", tmp.file("whole/" + checkpoint_name(4))})));
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_TRUE(read_text(model) == bytes) << "the resumed run replaced the best model";
  EXPECT_NE(read_text(tmp.file("resumed/summary.json")).find(",\"best_eval_step\":1}"),
            std::string::npos);

  // A checkpoint whose saved best is malformed is refused before training.
  Checkpoint bad = load_checkpoint(tmp.file("whole/" + checkpoint_name(4)));
  bad.meta["best_eval_loss"] = "nan";
  save_checkpoint(bad, tmp.file("bad.fbx"));
  const Result refused = run_trainer(
      join(transformer(tmp.file("refused"), 8), join(args, {"--resume", tmp.file("bad.fbx")})));
  EXPECT_EQ(refused.code, 2);
  EXPECT_NE(refused.err.find("--resume: the saved best evaluation ('nan') is malformed"),
            std::string::npos)
      << refused.err;
  EXPECT_TRUE(read_text(model) == bytes);

  // The default, last: the parameters after the last step.
  const Result last = run_trainer(
      join(transformer(tmp.file("last"), 8), {"--optimizer-args", "lr=0.2", "--eval-every", "1",
                                              "--save-every-n-steps", "8", "--save-model", model}));
  ASSERT_EQ(last.code, 0) << last.err;
  EXPECT_TRUE(same(load_model_weights(model),
                   load_checkpoint(tmp.file("last/" + checkpoint_name(8))).model));
}

// --early-stop-patience 3 in the same scenario (the best evaluation after step 1, none better
// after it): the run stops after step 4 with a checkpoint there, exit 0, and says so. Resumed
// with the same patience there is nothing to do; with 5 it trains on and stops after step 6, as
// an uninterrupted run with patience 5 does.
TEST(TrainerEval, EarlyStopPatienceStopsAfterEvaluationsWithoutABetterLossAcrossAResume) {
  TempDir tmp;
  const std::vector<std::string> args = {"--eval-every", "1", "--optimizer-args", "lr=0.2"};
  auto patience = [&](int n) { return join(args, {"--early-stop-patience", std::to_string(n)}); };
  const Result three = run_trainer(join(transformer(tmp.file("three"), 8), patience(3)));
  ASSERT_EQ(three.code, 0) << three.err;
  EXPECT_EQ(eval_losses(tmp.file("three/metrics.jsonl")).size(), 4u);
  EXPECT_TRUE(std::filesystem::exists(tmp.file("three/" + checkpoint_name(4))));
  EXPECT_NE(three.out.find("; stopped early after step 4: 3 evaluations in a row without a "
                           "better loss"),
            std::string::npos)
      << three.out;
  const std::string summary = read_text(tmp.file("three/summary.json"));
  EXPECT_NE(summary.find("\"steps\":4,"), std::string::npos) << summary;
  EXPECT_NE(summary.find(",\"stopped_early_at\":4}"), std::string::npos) << summary;

  const std::string from = tmp.file("three/" + checkpoint_name(4));
  const Result again =
      run_trainer(join(transformer(tmp.file("again"), 8), join(patience(3), {"--resume", from})));
  EXPECT_EQ(again.code, 2);
  EXPECT_NE(again.err.find("--resume: the checkpoint's run stopped early: 3 evaluations in a row "
                           "did not beat the best one (after step 1); to train on, raise "
                           "--early-stop-patience above 3"),
            std::string::npos)
      << again.err;
  // --resume auto (the same command for every start of a job): finished, exit 0.
  const Result automatic =
      run_trainer(join(transformer(tmp.file("three"), 8), join(patience(3), {"--resume", "auto"})));
  EXPECT_EQ(automatic.code, 0) << automatic.err;
  EXPECT_NE(automatic.out.find("the run stopped early (3 evaluations in a row without a better "
                               "loss; --early-stop-patience 3): it is finished, nothing to do"),
            std::string::npos)
      << automatic.out;
  const Result five =
      run_trainer(join(transformer(tmp.file("five"), 8), join(patience(5), {"--resume", from})));
  const Result whole = run_trainer(join(transformer(tmp.file("whole"), 8), patience(5)));
  ASSERT_EQ(five.code, 0) << five.err;
  ASSERT_EQ(whole.code, 0) << whole.err;
  EXPECT_NE(five.out.find("stopped early after step 6: 5 evaluations"), std::string::npos)
      << five.out;
  EXPECT_EQ(losses(tmp.file("five/metrics.jsonl")), losses(tmp.file("whole/metrics.jsonl")));
  EXPECT_EQ(losses(tmp.file("whole/metrics.jsonl")).size(), 6u);
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
