// Checkpoints through the trainer: a run stopped at step k and resumed equals an uninterrupted
// run bit for bit, in every mode and across modes; bad checkpoints and mismatches are refused.
#include <gtest/gtest.h>
#include <torch/script.h>

#include <algorithm>
#include <sstream>

#include "fusebox/core/checkpoint.h"
#include "trainer_test_util.h"

using namespace fusebox::trainer::testing;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> base_args(const std::string& out, const std::string& optimizer,
                                   int steps) {
  return {"--model",
          "transformer",
          "--model-width",
          "16",
          "--model-depth",
          "2",
          "--seq-len",
          "8",
          "--train-batch-size",
          "4",
          "--dtype",
          "float64",
          "--threads",
          "1",
          "--optimizer",
          optimizer,
          "--max-train-steps",
          std::to_string(steps),
          "--lr-scheduler",
          "cosine",
          "--output-dir",
          out,
          "--log-every",
          "100"};
}

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& more) {
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

void expect_same(const std::map<std::string, at::Tensor>& a,
                 const std::map<std::string, at::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [k, t] : a) EXPECT_TRUE(at::equal(t, b.at(k))) << what << ": " << k;
}

}  // namespace

TEST(TrainerResume, StoppedAndResumedEqualsUninterruptedInEveryMode) {
  TempDir tmp;
  struct Case {
    std::string optimizer;
    std::vector<std::string> before, after;
  };
  const std::vector<Case> cases{
      {"adamw", {}, {}},
      {"adamw", {"--fused-backward-pass"}, {"--fused-backward-pass"}},
      {"adamw", {"--fused-optimizer-groups", "3"}, {"--fused-optimizer-groups", "3"}},
      {"adamw", {"--fused-optimizer-groups", "3"}, {"--fused-optimizer-groups", "2"}},
      {"adamw", {"--fused-optimizer-groups", "2"}, {"--fused-backward-pass"}},
      {"adamw", {"--fused-backward-pass"}, {"--fused-backward-pass", "--gradient-checkpointing"}},
      // With an lr, so the cosine schedule applies (the relative step would refuse it).
      {"adafactor",
       {"--fused-backward-pass", "--optimizer-args", "relative_step=false", "lr=0.01"},
       {"--optimizer-args", "relative_step=false", "lr=0.01"}},
      {"prodigy", {}, {}},  // auto-LR: normal mode only
  };
  int i = 0;
  for (const Case& c : cases) {
    const std::string straight = tmp.file("straight" + std::to_string(i));
    const std::string split = tmp.file("split" + std::to_string(i++));
    // The uninterrupted run also leaves a checkpoint at step 3: the "stopped" state.
    auto r = run_trainer(
        with(base_args(straight, c.optimizer, 6), with(c.before, {"--save-every-n-steps", "3"})));
    ASSERT_EQ(r.code, 0) << r.err;
    const std::string stopped = straight + "/" + fusebox::checkpoint_name(3);
    ASSERT_TRUE(fs::exists(stopped));
    r = run_trainer(with(base_args(split, c.optimizer, 6), with(c.after, {"--resume", stopped})));
    ASSERT_EQ(r.code, 0) << r.err;
    auto a = fusebox::load_checkpoint(straight + "/" + fusebox::checkpoint_name(6));
    auto b = fusebox::load_checkpoint(split + "/" + fusebox::checkpoint_name(6));
    expect_same(a.model, b.model, c.optimizer + " resumed");
    // The run really learnt after resuming: weights moved from step 3.
    auto mid = fusebox::load_checkpoint(stopped);
    bool moved = false;
    for (const auto& [k, t] : mid.model) moved = moved || !at::equal(t, b.model.at(k));
    EXPECT_TRUE(moved) << c.optimizer;
  }
}

TEST(TrainerResume, PeriodicCheckpointsAreKeptAndPruned) {
  TempDir tmp;
  auto r = run_trainer(with(base_args(tmp.str(), "sgd", 7),
                            {"--save-every-n-steps", "2", "--keep-last-n-checkpoints", "2"}));
  ASSERT_EQ(r.code, 0) << r.err;
  auto left = fusebox::list_checkpoints(tmp.str());
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(left[0].filename(), fusebox::checkpoint_name(6));
  EXPECT_EQ(left[1].filename(), fusebox::checkpoint_name(7));  // the end of the run
  auto ck = fusebox::load_checkpoint(left[1]);
  EXPECT_EQ(ck.meta.at("plugin"), "sgd");
  EXPECT_NE(ck.meta.at("config").find("max_train_steps = 7"), std::string::npos);
}

TEST(TrainerResume, MismatchesAndBadFilesAreOneLineErrors) {
  TempDir tmp;
  ASSERT_EQ(run_trainer(base_args(tmp.str(), "adamw", 2)).code, 0);
  auto r = run_trainer(with(base_args(tmp.str(), "sgd", 4), {"--resume", "latest"}));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("written with optimizer plugin 'adamw', this run uses 'sgd'"),
            std::string::npos)
      << r.err;
  r = run_trainer(
      with(base_args(tmp.str(), "adamw", 4), {"--model-width", "32", "--resume", "latest"}));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("has shape"), std::string::npos) << r.err;
  // The error alone: no warning that the settings differ from a checkpoint that is refused.
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  const std::string bad = tmp.write("bad.fbx", "not a checkpoint");
  const std::string before = read_text(tmp.file(fusebox::checkpoint_name(2)));
  r = run_trainer(with(base_args(tmp.str(), "adamw", 4), {"--resume", bad}));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("is not a fusebox checkpoint"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(read_text(tmp.file(fusebox::checkpoint_name(2))), before);  // nothing overwritten
}

// One --output-dir used by two runs: the second run's final checkpoint replaces the first's of
// the same step, --resume latest continues the run written last (not the highest step), and
// keep-last-n never deletes what the current run just wrote.
TEST(TrainerResume, AFolderUsedByTwoRunsKeepsTheCurrentRunsCheckpoints) {
  TempDir tmp;
  const std::string dir = tmp.file("shared");
  auto first = run_trainer(with(base_args(dir, "sgd", 10), {"--save-every-n-steps", "5"}));
  ASSERT_EQ(first.code, 0) << first.err;
  const std::string ten = read_text(dir + "/" + fusebox::checkpoint_name(10));

  // A fresh run into the folder: warned about; its own final checkpoint (step 4) is written.
  auto fresh = run_trainer(with(base_args(dir, "sgd", 4), {"--seed", "7"}));
  ASSERT_EQ(fresh.code, 0) << fresh.err;
  EXPECT_NE(fresh.err.find("already holds 2 checkpoint(s) of an earlier run"), std::string::npos)
      << fresh.err;
  ASSERT_TRUE(fs::exists(dir + "/" + fusebox::checkpoint_name(4)));
  EXPECT_EQ(count_lines(read_text(dir + "/metrics.jsonl")), 4);  // its own, not the first run's
  EXPECT_NE(fusebox::load_checkpoint(dir + "/" + fusebox::checkpoint_name(4))
                .meta.at("config")
                .find("seed = 7"),
            std::string::npos);

  // --resume latest continues the step-4 run (written last), not the other run's step 10.
  auto latest = run_trainer(with(base_args(dir, "sgd", 6), {"--seed", "7", "--resume", "latest"}));
  ASSERT_EQ(latest.code, 0) << latest.err;
  EXPECT_NE(
      latest.out.find("resuming from " + dir + "/" + fusebox::checkpoint_name(4) + " (step 4)"),
      std::string::npos)
      << latest.out;

  // A copy of the folder (new modification times, in any order) resumes the same checkpoint.
  const std::string copy = tmp.file("copy");
  fs::create_directories(copy);
  std::vector<fs::path> files(fs::directory_iterator(dir), fs::directory_iterator{});
  std::sort(files.rbegin(), files.rend());
  for (const auto& f : files)
    if (fs::is_regular_file(f)) fs::copy_file(f, copy + "/" + f.filename().string());
  auto copied = run_trainer(with(base_args(copy, "sgd", 8), {"--seed", "7", "--resume", "latest"}));
  ASSERT_EQ(copied.code, 0) << copied.err;
  EXPECT_NE(copied.out.find("/" + fusebox::checkpoint_name(6) + " (step 6)"), std::string::npos)
      << copied.out;

  // A branch from step 5 with keep-last-n 1: its own newest stays, the step-10 file is left.
  auto branch = run_trainer(with(base_args(dir, "sgd", 8),
                                 {"--resume", dir + "/" + fusebox::checkpoint_name(5),
                                  "--save-every-n-steps", "2", "--keep-last-n-checkpoints", "1"}));
  ASSERT_EQ(branch.code, 0) << branch.err;
  std::vector<std::string> left;
  for (const auto& p : fusebox::list_checkpoints(dir)) left.push_back(p.filename().string());
  EXPECT_EQ(left,
            (std::vector<std::string>{fusebox::checkpoint_name(8), fusebox::checkpoint_name(10)}));
  EXPECT_EQ(read_text(dir + "/" + fusebox::checkpoint_name(10)), ten);
}

// A resumed run's metrics files continue the history of the run its checkpoint came from:
// steps 1..k from that run's files, then its own.
TEST(TrainerResume, MetricsFilesKeepTheHistoryBeforeTheResumePoint) {
  TempDir tmp;
  const std::string a = tmp.file("a"), b = tmp.file("b");
  auto r = run_trainer(with(base_args(a, "sgd", 6), {"--save-every-n-steps", "3"}));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run_trainer(
      with(base_args(b, "sgd", 6), {"--resume", a + "/" + fusebox::checkpoint_name(3)}));
  ASSERT_EQ(r.code, 0) << r.err;
  auto lines = [](const std::string& text) {
    std::vector<std::string> out;
    std::istringstream in(text);
    for (std::string l; std::getline(in, l);) out.push_back(l);
    return out;
  };
  for (const char* file : {"metrics.jsonl", "metrics.csv"}) {
    SCOPED_TRACE(file);
    const auto before = lines(read_text(a + "/" + file)), after = lines(read_text(b + "/" + file));
    const size_t header = std::string(file) == "metrics.csv" ? 1 : 0;
    ASSERT_EQ(after.size(), header + 6);
    for (size_t i = 0; i < header + 3; ++i) EXPECT_EQ(after[i], before[i]);  // carried over
    const std::string step4 = header ? "4," : "{\"step\":4,";
    EXPECT_EQ(after[header + 3].rfind(step4, 0), 0u) << after[header + 3];
  }
}

// metrics.csv has one lr column per parameter group in every mode, so a run resumed with
// optimizer groups continues it; resumed with other columns (here a second parameter group), the
// earlier rows cannot join this run's metrics.csv: a warning says so, and metrics.jsonl still has
// every step.
TEST(TrainerResume, MetricsCsvGoesOnInAnotherModeAndOtherColumnsAreNamedInAWarning) {
  TempDir tmp;
  const std::string a = tmp.file("a");
  auto r = run_trainer(with(base_args(a, "sgd", 3), {"--save-every-n-steps", "3"}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err.find("warning"), std::string::npos) << r.err;
  const std::string header = read_text(a + "/metrics.csv").substr(0, 40);
  r = run_trainer(
      with(base_args(a, "sgd", 5), {"--resume", "latest", "--fused-optimizer-groups", "2"}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err.find("other columns"), std::string::npos) << r.err;
  EXPECT_EQ(count_lines(read_text(a + "/metrics.csv")), 1 + 5);
  EXPECT_EQ(read_text(a + "/metrics.csv").substr(0, 40), header);

  r = run_trainer(with(base_args(a, "sgd", 7), {"--resume", "latest", "--lr-scale", "pos=0.5"}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("trainer: warning: --resume: " + a +
                       "/metrics.csv has other columns than this run's (other parameter groups"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("this run's metrics.csv starts at step 6; metrics.jsonl keeps every step"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(count_lines(read_text(a + "/metrics.jsonl")), 7);
  EXPECT_EQ(count_lines(read_text(a + "/metrics.csv")), 1 + 2);
  EXPECT_NE(read_text(a + "/metrics.csv").find(",lr_0,lr_1,"), std::string::npos);
}

// A script model whose forward updates a buffer (as BatchNorm's running statistics do): the
// checkpoint carries the buffer, so a resumed run equals an uninterrupted one.
TEST(TrainerResume, ScriptModelBuffersAreSavedAndRestored) {
  TempDir tmp;
  torch::jit::Module m("Net");
  torch::manual_seed(0);
  m.register_parameter("w", torch::randn({8, 1}), false);
  m.register_parameter("b", torch::zeros({1}), false);
  m.register_buffer("running", torch::zeros({8}));
  m.define(R"(
def forward(self, x):
    self.running.copy_(0.5 * self.running + 0.5 * x.mean(0).detach())
    y = x.sum(1, keepdim=True)
    return (((x - self.running).matmul(self.w) + self.b - y) ** 2).mean()
)");
  const std::string script = tmp.file("net.pt");
  m.save(script);
  auto args = [&](const std::string& out) {
    return std::vector<std::string>{"--model-script", script, "--model-width",     "8",
                                    "--optimizer",    "sgd",  "--learning-rate",   "0.05",
                                    "--threads",      "1",    "--max-train-steps", "6",
                                    "--output-dir",   out,    "--log-every",       "100"};
  };
  const std::string a = tmp.file("a"), b = tmp.file("b");
  auto r = run_trainer(with(args(a), {"--save-every-n-steps", "3"}));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run_trainer(with(args(b), {"--resume", a + "/" + fusebox::checkpoint_name(3)}));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto whole = fusebox::load_checkpoint(a + "/" + fusebox::checkpoint_name(6));
  const auto resumed = fusebox::load_checkpoint(b + "/" + fusebox::checkpoint_name(6));
  ASSERT_EQ(whole.buffers.count("running"), 1u);
  EXPECT_FALSE(at::equal(whole.buffers.at("running"), at::zeros({8})));  // forward updated it
  expect_same(whole.buffers, resumed.buffers, "buffers");
  expect_same(whole.model, resumed.model, "parameters");

  // A checkpoint without buffers (written before they were saved) still resumes, with a warning.
  auto old = fusebox::load_checkpoint(a + "/" + fusebox::checkpoint_name(3));
  old.buffers.clear();
  const std::string old_file = tmp.file("old.fbx");
  fusebox::save_checkpoint(old, old_file);
  r = run_trainer(with(args(tmp.file("c")), {"--resume", old_file}));
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("holds no model buffers"), std::string::npos) << r.err;
}

// A checkpoint written by another version of the plugin resumes with a warning naming both.
TEST(TrainerResume, AnotherPluginVersionIsNamedInAWarning) {
  TempDir tmp;
  const std::string a = tmp.file("a");
  auto r = run_trainer(with(base_args(a, "sgd", 4), {"--save-every-n-steps", "2"}));
  ASSERT_EQ(r.code, 0) << r.err;
  fusebox::Checkpoint ckpt = fusebox::load_checkpoint(a + "/" + fusebox::checkpoint_name(2));
  ckpt.meta["plugin_version"] = "0.0.1-old";
  const std::string old = tmp.file("old.fbx");
  fusebox::save_checkpoint(ckpt, old);
  r = run_trainer(with(base_args(tmp.file("b"), "sgd", 4), {"--resume", old}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("was written by sgd 0.0.1-old, this is "), std::string::npos) << r.err;
}

// A resume with settings that change the trajectory (another seed swaps the data's teacher) is
// named in a warning; what is meant to change on resume (the step mode, the output folder) is not.
TEST(TrainerResume, ChangedSettingsAreNamedInAWarning) {
  TempDir tmp;
  const std::string a = tmp.file("a");
  auto r = run_trainer(with(base_args(a, "sgd", 4), {"--save-every-n-steps", "2"}));
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string ckpt = a + "/" + fusebox::checkpoint_name(2);
  r = run_trainer(
      with(base_args(tmp.file("b"), "sgd", 4),
           {"--resume", ckpt, "--fused-optimizer-groups", "2", "--gradient-checkpointing"}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err.find("settings differ"), std::string::npos) << r.err;
  r = run_trainer(with(base_args(tmp.file("c"), "sgd", 6),
                       {"--resume", ckpt, "--seed", "7", "--train-batch-size", "2"}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(
      r.err.find("trainer: warning: --resume: settings differ from the run that wrote " + ckpt +
                 ": max_train_steps = 6 (was 4), seed = 7 (was 42), "
                 "train_batch_size = 2 (was 4); this run goes on with its own"),
      std::string::npos)
      << r.err;
}

// A data file that changed since the checkpoint was written is named in a warning (its size or its
// content); the same file resumes silently, and synthetic data carry no fingerprint.
TEST(TrainerResume, AChangedDataFileIsNamedInAWarning) {
  TempDir tmp;
  std::string text;
  for (int i = 0; i < 400; ++i) text += "the quick brown fox " + std::to_string(i) + "\n";
  const std::string data = tmp.write("data.txt", text);
  const std::vector<std::string> on_text = {"--dataset", "text:" + data, "--save-every-n-steps",
                                            "2"};
  const std::string a = tmp.file("a");
  auto r = run_trainer(with(base_args(a, "sgd", 4), on_text));
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string ckpt = a + "/" + fusebox::checkpoint_name(2);
  EXPECT_EQ(fusebox::load_checkpoint(ckpt).meta.count("data_fingerprint"), 1u);
  const std::string warning = "trainer: warning: --resume: --dataset text:" + data +
                              " is not the file the checkpoint's run trained on (";
  r = run_trainer(with(base_args(tmp.file("same"), "sgd", 4), with(on_text, {"--resume", ckpt})));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err.find("is not the file"), std::string::npos) << r.err;

  std::string other = text;
  other[1000] = '#';
  tmp.write("data.txt", other);
  r = run_trainer(with(base_args(tmp.file("other"), "sgd", 4), with(on_text, {"--resume", ckpt})));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find(warning + "the same size, other content): training goes on over this "
                                 "file's data, so it will not equal an uninterrupted run\n"),
            std::string::npos)
      << r.err;
  tmp.write("data.txt", text + "more\n");
  r = run_trainer(with(base_args(tmp.file("longer"), "sgd", 4), with(on_text, {"--resume", ckpt})));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find(warning + std::to_string(text.size() + 5) +
                       " bytes, the checkpoint's run read " + std::to_string(text.size()) + ")"),
            std::string::npos)
      << r.err;

  r = run_trainer(with(base_args(tmp.file("synthetic"), "sgd", 2), {"--save-every-n-steps", "2"}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(fusebox::load_checkpoint(tmp.file("synthetic") + "/" + fusebox::checkpoint_name(2))
                .meta.count("data_fingerprint"),
            0u);
}

// The evaluation's own file is fingerprinted too: evaluation losses over another file do not
// compare with the checkpoint's run's (nor with the best loss it kept).
TEST(TrainerResume, AChangedEvaluationFileIsNamedInAWarning) {
  TempDir tmp;
  std::string text, held;
  for (int i = 0; i < 400; ++i) text += "the quick brown fox " + std::to_string(i) + "\n";
  for (int i = 0; i < 100; ++i) held += "a lazy dog " + std::to_string(i) + "\n";
  const std::string data = tmp.write("data.txt", text), eval = tmp.write("eval.txt", held);
  const std::vector<std::string> on_text = {"--dataset",
                                            "text:" + data,
                                            "--eval-dataset",
                                            "text:" + eval,
                                            "--eval-every",
                                            "2",
                                            "--save-every-n-steps",
                                            "2",
                                            "--save-model-at",
                                            "best",
                                            "--save-model",
                                            tmp.file("best.pt")};
  const std::string a = tmp.file("a");
  auto r = run_trainer(with(base_args(a, "sgd", 4), on_text));
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string ckpt = a + "/" + fusebox::checkpoint_name(2);
  EXPECT_EQ(fusebox::load_checkpoint(ckpt).meta.count("eval_data_fingerprint"), 1u);
  r = run_trainer(with(base_args(tmp.file("same"), "sgd", 4), with(on_text, {"--resume", ckpt})));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err.find("is not the file"), std::string::npos) << r.err;

  tmp.write("eval.txt", held + "and more\n");
  r = run_trainer(with(base_args(tmp.file("other"), "sgd", 4), with(on_text, {"--resume", ckpt})));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("trainer: warning: --resume: --eval-dataset text:" + eval +
                       " is not the file the checkpoint's run evaluated on (" +
                       std::to_string(held.size() + 9) + " bytes, the checkpoint's run read " +
                       std::to_string(held.size()) +
                       "): this run's evaluation losses do not compare with that run's, nor with "
                       "the best loss it kept (--save-model-at best, --early-stop-patience)\n"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("--dataset text:" + data + " is not the file"), std::string::npos) << r.err;

  // Evaluating on the training file's held-out part: --dataset's fingerprint covers it.
  r = run_trainer(with(base_args(tmp.file("holdout"), "sgd", 2),
                       {"--dataset", "text:" + data, "--eval-holdout", "0.1", "--eval-every", "2",
                        "--save-every-n-steps", "2"}));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto meta =
      fusebox::load_checkpoint(tmp.file("holdout") + "/" + fusebox::checkpoint_name(2)).meta;
  EXPECT_EQ(meta.count("data_fingerprint"), 1u);
  EXPECT_EQ(meta.count("eval_data_fingerprint"), 0u);
}

// A folder another run has written since the checkpoint (a fresh run into it) does not lend that
// run's records as the resumed run's history: a warning, and the files start after the resume.
TEST(TrainerResume, MetricsOfAnotherRunAreNotTakenAsTheHistory) {
  TempDir tmp;
  const std::string a = tmp.file("a");
  auto r = run_trainer(with(base_args(a, "sgd", 6), {"--save-every-n-steps", "3"}));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run_trainer(with(base_args(a, "sgd", 2), {"--seed", "5"}));  // replaces the metrics files
  ASSERT_EQ(r.code, 0) << r.err;
  r = run_trainer(with(base_args(a, "sgd", 8), {"--resume", a + "/" + fusebox::checkpoint_name(6),
                                                "--lr-scheduler", "constant"}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("are not the history of steps 1..6 of the run that wrote the checkpoint"),
            std::string::npos)
      << r.err;
  const std::string text = read_text(a + "/metrics.jsonl");
  EXPECT_EQ(count_lines(text), 2) << text;
  EXPECT_EQ(text.rfind("{\"step\":7,", 0), 0u) << text;
}

// The checkpoint a run resumes from is a second copy of the weights and the optimizer state: it
// is released once restored, so the resumed steps peak as the uninterrupted run's do.
TEST(TrainerResume, TheCheckpointIsReleasedOnceRestored) {
  TempDir tmp;
  const std::string args =
      "--model mlp --model-width 256 --optimizer adamw --threads 1 --log-every 0 --output-dir ";
  ASSERT_EQ(run_program(args + tmp.file("straight") + " --max-train-steps 4", tmp.str()).code, 0);
  ASSERT_EQ(run_program(args + tmp.file("split") + " --max-train-steps 2", tmp.str()).code, 0);
  const auto r =
      run_program(args + tmp.file("split") + " --max-train-steps 4 --resume latest", tmp.str());
  ASSERT_EQ(r.code, 0) << r.err;
  // peak_bytes of each step's metrics.jsonl record.
  const auto peaks = [](const std::string& jsonl) {
    std::vector<std::string> out;
    std::istringstream in(read_text(jsonl));
    for (std::string line; std::getline(in, line);) {
      const size_t p = line.find("\"peak_bytes\":");
      if (p != std::string::npos) out.push_back(line.substr(p, line.find(',', p) - p));
    }
    return out;
  };
  const auto straight = peaks(tmp.file("straight/metrics.jsonl"));
  const auto split = peaks(tmp.file("split/metrics.jsonl"));
  ASSERT_EQ(straight.size(), 4u);
  ASSERT_EQ(split.size(), 4u);
  for (size_t step = 2; step < 4; ++step)
    EXPECT_EQ(split[step], straight[step]) << "step " << step + 1;
}

// --resume auto: the same command for every start of a job. The first start trains afresh, a
// later one continues from the newest checkpoint, and one after the run ended exits 0 and
// changes nothing.
TEST(TrainerResume, ResumeAutoStartsContinuesAndFinishes) {
  TempDir tmp;
  auto args = [&](const std::string& out, int steps) {
    return with(base_args(out, "adamw", steps), {"--lr-scheduler", "constant"});
  };
  const Result whole = run_trainer(args(tmp.file("whole"), 6));
  ASSERT_EQ(whole.code, 0) << whole.err;

  const std::string job = tmp.file("job");
  const Result first = run_trainer(with(args(job, 3), {"--resume", "auto"}));
  ASSERT_EQ(first.code, 0) << first.err;
  EXPECT_EQ(first.err, "");
  EXPECT_EQ(first.out.find("resuming from"), std::string::npos) << first.out;
  const Result second = run_trainer(with(args(job, 6), {"--resume", "auto"}));
  ASSERT_EQ(second.code, 0) << second.err;
  EXPECT_NE(second.out.find("resuming from " + job + "/" + fusebox::checkpoint_name(3)),
            std::string::npos)
      << second.out;
  expect_same(fusebox::load_checkpoint(job + "/" + fusebox::checkpoint_name(6)).model,
              fusebox::load_checkpoint(tmp.file("whole/" + fusebox::checkpoint_name(6))).model,
              "started, stopped at 3 and continued with --resume auto");

  const std::string metrics = read_text(job + "/metrics.jsonl");
  const std::string last = read_text(job + "/" + fusebox::checkpoint_name(6));
  const Result again = run_trainer(with(args(job, 6), {"--resume", "auto"}));
  EXPECT_EQ(again.code, 0) << again.err;
  EXPECT_NE(again.out.find("trainer: " + job + "/" + fusebox::checkpoint_name(6) +
                           " is at step 6 of --max-train-steps 6: the run is finished, nothing "
                           "to do"),
            std::string::npos)
      << again.out;
  EXPECT_TRUE(read_text(job + "/metrics.jsonl") == metrics);
  EXPECT_TRUE(read_text(job + "/" + fusebox::checkpoint_name(6)) == last);
  // --resume latest keeps refusing a finished run: it names a checkpoint to continue.
  EXPECT_EQ(run_trainer(with(args(job, 6), {"--resume", "latest"})).code, 2);
  const Result no_dir = run_trainer(with(args("", 6), {"--resume", "auto"}));
  EXPECT_EQ(no_dir.code, 2);
  EXPECT_NE(no_dir.err.find("auto means the newest checkpoint in --output-dir"), std::string::npos)
      << no_dir.err;
}
