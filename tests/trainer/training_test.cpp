// Training runs end to end: each model learns, the three step modes agree, script models train,
// failures inside plugins are reported, outputs are complete or absent.
#include <gtest/gtest.h>
#include <torch/script.h>

#include <cmath>
#include <filesystem>

#include "fusebox/core/checkpoint.h"
#include "trainer_test_util.h"

namespace fusebox::trainer {
namespace {

namespace fs = std::filesystem;
using testing::join;
using testing::losses;
using testing::mean;
using testing::plugin_args;
using testing::read_text;
using testing::run_trainer;
using testing::TempDir;

// Runs sgd on `model_args` for `steps` steps; returns the per-step losses.
std::vector<double> train(const std::vector<std::string>& model_args, int steps,
                          const std::string& plugin = "sgd.so") {
  TempDir dir;
  auto r = run_trainer(join(
      join(plugin_args(plugin), model_args),
      {"--max-train-steps", std::to_string(steps), "--output-dir", dir.str(), "--log-every", "0"}));
  EXPECT_EQ(r.code, 0) << r.err;
  return losses(dir.file("metrics.jsonl"));
}

void expect_learns(const std::vector<double>& l, double factor) {
  ASSERT_GE(l.size(), 10u);
  for (double v : l) ASSERT_TRUE(std::isfinite(v));
  const double first = mean(l, 0, 5), last = mean(l, l.size() - 5, l.size());
  EXPECT_LT(last, first * factor) << "first " << first << " last " << last;
}

TEST(TrainerTraining, MlpLossFalls) {
  expect_learns(train({"--model", "mlp", "--model-width", "32", "--learning-rate", "0.02",
                       "--optimizer-args", "momentum=0.9"},
                      40),
                0.5);
}

TEST(TrainerTraining, TransformerLossFalls) {
  expect_learns(train({"--model", "transformer", "--model-width", "32", "--model-depth", "1",
                       "--seq-len", "16", "--vocab-size", "16", "--learning-rate", "0.3",
                       "--optimizer-args", "momentum=0.9"},
                      40),
                0.8);
}

TEST(TrainerTraining, TransformerLearnsShippedText) {
  const std::string text = testing::repo_root() + "/data/pride-and-prejudice-ch1.txt";
  expect_learns(train({"--model", "transformer", "--model-width", "32", "--model-depth", "1",
                       "--seq-len", "32", "--dataset", "text:" + text, "--learning-rate", "0.3",
                       "--optimizer-args", "momentum=0.9"},
                      30),
                0.8);
}

// A text file of exactly one window (--seq-len + 1 bytes) is enough; one byte less is refused.
TEST(TrainerTraining, ATextFileOfOneWindowIsEnough) {
  TempDir dir;
  const std::string five = dir.write("five.txt", "hello"), four = dir.write("four.txt", "hell");
  auto args = [&](const std::string& file) {
    return join(plugin_args("sgd.so"),
                {"--model", "transformer", "--model-width", "8", "--model-heads", "2", "--seq-len",
                 "4", "--dataset", "text:" + file, "--max-train-steps", "2", "--output-dir", ""});
  };
  auto r = run_trainer(args(five));
  EXPECT_EQ(r.code, 0) << r.err;
  r = run_trainer(args(four));
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_NE(r.err.find("has 4 bytes; --seq-len 4 needs at least 5"), std::string::npos) << r.err;
}

TEST(TrainerTraining, DenoiserLossFalls) {
  expect_learns(
      train({"--model", "denoiser", "--model-width", "8", "--model-depth", "2", "--image-size", "8",
             "--learning-rate", "0.05", "--optimizer-args", "momentum=0.9"},
            40),
      0.8);
}

// float64 and a per-parameter optimizer: the fused pass and optimizer groups must reproduce the
// normal loop's losses exactly.
TEST(TrainerTraining, StepModesAgreeExactlyInFloat64) {
  const std::vector<std::string> common = {
      "--model",         "transformer", "--model-width",    "16",
      "--model-depth",   "2",           "--seq-len",        "8",
      "--vocab-size",    "12",          "--dtype",          "float64",
      "--learning-rate", "0.1",         "--optimizer-args", "momentum=0.9",
      "--lr-scheduler",  "cosine"};
  auto normal = train(common, 8);
  auto fused = train(join(common, {"--fused-backward-pass"}), 8);
  auto groups = train(join(common, {"--fused-optimizer-groups", "3"}), 8);
  ASSERT_EQ(normal.size(), 8u);
  EXPECT_EQ(normal, fused);
  EXPECT_EQ(normal, groups);
  EXPECT_NE(normal.front(), normal.back());
}

TEST(TrainerTraining, GradientAccumulationAndMetricsFiles) {
  TempDir dir;
  auto r = run_trainer(
      join(plugin_args("sgd.so"),
           {"--model-width", "8", "--max-train-steps", "5", "--gradient-accumulation-steps", "3",
            "--learning-rate", "0.01", "--lr-scheduler", "linear", "--lr-warmup-steps", "2",
            "--output-dir", dir.str(), "--log-every", "2"}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(losses(dir.file("metrics.jsonl")).size(), 5u);
  const std::string csv = read_text(dir.file("metrics.csv"));
  EXPECT_EQ(csv.rfind("step,loss,lr_0,effective_lr_0,grad_norm,step_seconds,peak_bytes", 0), 0u)
      << csv;
  EXPECT_EQ(testing::count_lines(csv), 6);
  // Warm-up: step 1 trains with lr 0, step 2 with half the base lr.
  const std::string jsonl = read_text(dir.file("metrics.jsonl"));
  EXPECT_NE(jsonl.find("\"step\":1,\"loss\":"), std::string::npos);
  EXPECT_NE(jsonl.find("\"lr\":[0.005]"), std::string::npos) << jsonl;
  const std::string summary = read_text(dir.file("summary.json"));
  EXPECT_NE(summary.find("\"steps\":5"), std::string::npos) << summary;
  EXPECT_NE(r.out.find("step 4/5"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("5 steps in"), std::string::npos) << r.out;
  for (const auto& e : fs::directory_iterator(dir.str()))
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();
}

// A warm-up that the schedule ignores, or one that outlasts the run, is warned of (once) and the
// run goes on; a warm-up that ends in time is not.
TEST(TrainerTraining, AWarmUpThatDoesNothingOrNeverEndsIsWarnedOf) {
  const auto run = [](const std::string& scheduler, const std::string& warmup) {
    return run_trainer(
        join(plugin_args("sgd.so"),
             {"--model-width", "8", "--max-train-steps", "3", "--lr-scheduler", scheduler,
              "--lr-warmup-steps", warmup, "--output-dir", "", "--log-every", "0"}));
  };
  auto r = run("constant", "2");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err,
            "trainer: warning: --lr-warmup-steps 2 has no effect with --lr-scheduler constant, "
            "which holds the learning rate from the first step; use constant_with_warmup to warm "
            "up\n");
  r = run("adafactor", "2");
  EXPECT_NE(r.err.find("--lr-warmup-steps 2 has no effect with --lr-scheduler adafactor"),
            std::string::npos)
      << r.err;
  r = run("cosine", "3");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err,
            "trainer: warning: --lr-warmup-steps 3 is not below --max-train-steps 3: the learning "
            "rate never reaches its set value\n");
  for (const char* s : {"constant_with_warmup", "linear", "polynomial"}) {
    r = run(s, "2");
    EXPECT_EQ(r.err, "") << s;
  }
  r = run("constant", "0");
  EXPECT_EQ(r.err, "");
}

TEST(TrainerTraining, PluginExceptionsAreReportedAndLeaveNoFiles) {
  TempDir dir;
  auto r = run_trainer(join(plugin_args("tp_step_param_throws.so"),
                            {"--fused-backward-pass", "--model-width", "8", "--max-train-steps",
                             "3", "--output-dir", dir.str()}));
  EXPECT_EQ(r.code, kExitTraining);
  EXPECT_NE(r.err.find("training failed at step 1"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("test plugin: step_param exploded on purpose"), std::string::npos) << r.err;
  EXPECT_EQ(testing::count_lines(r.err), 1) << r.err;
  EXPECT_TRUE(fs::is_empty(dir.str()));  // no metrics, no temporary files
  r = run_trainer(join(plugin_args("tp_step_throws.so"),
                       {"--model-width", "8", "--max-train-steps", "3", "--output-dir", ""}));
  EXPECT_EQ(r.code, kExitTraining);
  EXPECT_NE(r.err.find("test plugin: step exploded"), std::string::npos) << r.err;
  r = run_trainer(join(plugin_args("tp_factory_throws.so"), {"--output-dir", ""}));
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_NE(r.err.find("factory refuses to build"), std::string::npos) << r.err;
}

TEST(TrainerTraining, Bf16MixedPrecisionAndFullBf16Train) {
  expect_learns(train({"--model-width", "32", "--learning-rate", "0.02", "--optimizer-args",
                       "momentum=0.9", "--mixed-precision", "bf16"},
                      30),
                0.7);
  expect_learns(train({"--model-width", "32", "--learning-rate", "0.02", "--optimizer-args",
                       "momentum=0.9", "--full-bf16"},
                      30),
                0.7);
  auto r = run_trainer(join(plugin_args("sgd.so"), {"--mixed-precision", "fp16",
                                                    "--max-train-steps", "1", "--output-dir", ""}));
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("warning: --mixed-precision fp16"), std::string::npos) << r.err;
}

// The denoiser trains in bf16 on the CPU both ways. Its group norms get bf16 activations under
// autocast and its transposed convolutions (depth 3: 32 -> 16 and 16 -> 8 channels) would run in
// bf16, where LibTorch 1.13's CPU kernels fail; with --full-bf16 the parameters stay bf16.
TEST(TrainerTraining, DenoiserTrainsInBf16BothWays) {
  const std::vector<std::string> model = {
      "--model",          "denoiser",    "--model-width", "8", "--model-depth",   "3",
      "--image-size",     "8",           "--threads",     "1", "--learning-rate", "0.05",
      "--optimizer-args", "momentum=0.9"};
  for (const std::string mode : {"--mixed-precision=bf16", "--full-bf16"}) {
    SCOPED_TRACE(mode);
    TempDir dir;
    auto r = run_trainer(
        join(join(plugin_args("sgd.so"), model),
             {mode, "--max-train-steps", "12", "--output-dir", dir.str(), "--log-every", "0"}));
    if (r.code != 0) {
      ADD_FAILURE() << "exit " << r.code << ": " << r.err;
      continue;
    }
    const std::vector<double> l = losses(dir.file("metrics.jsonl"));
    ASSERT_EQ(l.size(), 12u);
    for (double v : l) EXPECT_TRUE(std::isfinite(v)) << v;
    EXPECT_LT(mean(l, 9, 12), mean(l, 0, 3));
    const auto ckpt = fusebox::load_checkpoint(dir.file("checkpoint-00000012.fbx"));
    ASSERT_FALSE(ckpt.model.empty());
    const at::ScalarType want = mode == "--full-bf16" ? at::kBFloat16 : at::kFloat;
    for (const auto& [name, t] : ckpt.model) EXPECT_EQ(t.scalar_type(), want) << name;
    EXPECT_TRUE(ckpt.model.count("upsample.0.weight"));
  }
}

// A TorchScript module; `w2` is the same tensor as `w` (a tied weight).
std::string write_script(const TempDir& dir, const std::string& forward) {
  torch::jit::Module m("Net");
  torch::manual_seed(0);
  torch::Tensor w = torch::randn({8, 1});
  m.register_parameter("w", w, false);
  m.register_parameter("w2", w, false);
  m.register_parameter("b", torch::zeros({1}), false);
  m.define(forward);
  const std::string path = dir.file("net.pt");
  m.save(path);
  return path;
}

TEST(TrainerTraining, TorchScriptModelTrains) {
  TempDir dir;
  const std::string path = write_script(dir, R"(
def forward(self, x):
    y = x.sum(1, keepdim=True)
    return ((x.matmul(self.w) + self.b - y) ** 2).mean()
)");
  auto r = run_trainer(
      join(plugin_args("sgd.so"),
           {"--model-script", path, "--model-width", "8", "--learning-rate", "0.05",
            "--max-train-steps", "30", "--output-dir", dir.file("out"), "--fused-backward-pass"}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("9 parameters in 2 tensors"), std::string::npos) << r.out;  // w once
  expect_learns(losses(dir.file("out/metrics.jsonl")), 0.5);

  // --dataset none: forward gets an empty tensor and makes its own loss.
  const std::string own = write_script(dir, R"(
def forward(self, x):
    return ((self.w - 3.0) ** 2).sum() + x.numel()
)");
  r = run_trainer(join(
      plugin_args("sgd.so"),
      {"--model-script", own, "--dataset", "none", "--learning-rate", "0.05", "--max-train-steps",
       "20", "--output-dir", dir.file("own"), "--save-model", dir.file("trained.pt")}));
  ASSERT_EQ(r.code, 0) << r.err;
  expect_learns(losses(dir.file("own/metrics.jsonl")), 0.5);
  torch::jit::Module trained = torch::jit::load(dir.file("trained.pt"));
  EXPECT_LT((trained.attr("w").toTensor() - 3.0).abs().max().item<double>(), 1.0);

  // A forward without arguments makes its own data: it trains with --dataset none, and other
  // data, which it would leave unused, are refused before training.
  const std::string no_input = write_script(dir, R"(
def forward(self):
    return ((self.w + self.b - 1.0) ** 2).sum()
)");
  r = run_trainer(join(plugin_args("sgd.so"),
                       {"--model-script", no_input, "--dataset", "none", "--learning-rate", "0.05",
                        "--max-train-steps", "20", "--output-dir", dir.file("no_input")}));
  ASSERT_EQ(r.code, 0) << r.err;
  expect_learns(losses(dir.file("no_input/metrics.jsonl")), 0.5);
  r = run_trainer(join(plugin_args("sgd.so"), {"--model-script", no_input, "--output-dir",
                                               dir.file("no_input_synthetic")}));
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err,
            "trainer: error: --dataset synthetic gives the model script's forward data, and it "
            "takes no argument (it makes its own data): give --dataset none\n");
  EXPECT_FALSE(std::filesystem::exists(dir.file("no_input_synthetic")));

  // A file that is not TorchScript: one line naming it.
  const std::string junk = dir.write("junk.pt", "not a model");
  r = run_trainer(join(plugin_args("sgd.so"), {"--model-script", junk, "--output-dir", ""}));
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err.rfind("trainer: error: model script " + junk + " cannot be loaded", 0), 0u)
      << r.err;
  EXPECT_EQ(testing::count_lines(r.err), 1);

  // A TorchScript module without forward: one line saying what forward must do.
  torch::jit::Module no_forward("NoForward");
  no_forward.register_parameter("w", torch::zeros({2}), false);
  no_forward.save(dir.file("no_forward.pt"));
  r = run_trainer(join(plugin_args("sgd.so"),
                       {"--model-script", dir.file("no_forward.pt"), "--output-dir", ""}));
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_NE(r.err.find("has no forward method: it must be a TorchScript module whose "
                       "forward(batch) returns the loss"),
            std::string::npos)
      << r.err;
}

// Integer tensors of a script model keep their type whatever --dtype or --full-bf16 say: an index
// buffer still indexes, a counter still counts (in bf16 it would stop at 256), and an integer
// parameter is not trained. A failing forward reports the script's own error line.
TEST(TrainerTraining, ScriptModelIntegerTensorsKeepTheirType) {
  TempDir dir;
  torch::jit::Module m("Net");
  torch::manual_seed(0);
  m.register_parameter("w", torch::randn({8, 1}), false);
  m.register_parameter("scale", torch::full({1}, 2, torch::kLong), false);
  m.register_buffer("order", torch::arange(7, -1, -1, torch::kLong));
  m.register_buffer("calls", torch::full({1}, 300, torch::kLong));
  m.define(R"(
def forward(self, x):
    self.calls.add_(1)
    xr = x.index_select(1, self.order)
    assert x.size(0) < 1000, "the batch is too large for this test model"
    return ((xr.matmul(self.w) - x.sum(1, keepdim=True) * self.scale) ** 2).mean()
)");
  const std::string script = dir.file("ints.pt");
  m.save(script);
  auto r = run_trainer(
      join(plugin_args("sgd.so"), {"--model-script", script, "--model-width", "8", "--full-bf16",
                                   "--max-train-steps", "3", "--output-dir", dir.file("out")}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("8 parameters in 1 tensors"), std::string::npos) << r.out;
  const auto ckpt = fusebox::load_checkpoint(dir.file("out/checkpoint-00000003.fbx"));
  ASSERT_TRUE(ckpt.buffers.count("calls"));
  EXPECT_EQ(ckpt.buffers.at("calls").scalar_type(), at::kLong);
  EXPECT_EQ(ckpt.buffers.at("calls").item<int64_t>(), 303);
  EXPECT_EQ(ckpt.model.count("scale"), 0u) << "an integer parameter is not trained";
  ASSERT_TRUE(ckpt.buffers.count("scale")) << "but it is state, saved with the buffers";
  EXPECT_EQ(ckpt.buffers.at("scale").scalar_type(), at::kLong);

  r = run_trainer(join(plugin_args("sgd.so"),
                       {"--model-script", script, "--model-width", "8", "--train-batch-size",
                        "1000", "--max-train-steps", "1", "--output-dir", ""}));
  EXPECT_EQ(r.code, 3);
  EXPECT_NE(r.err.find("forward failed: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the batch is too large for this test model"), std::string::npos) << r.err;
  EXPECT_EQ(testing::count_lines(r.err), 1) << r.err;
}

// --save-model of a built-in model: a {name: tensor} dict in torch's pickle format (what Python's
// torch.load returns), holding the trained weights, which equal the final checkpoint's.
TEST(TrainerTraining, SaveModelWritesTheWeightsAsATorchPickleDict) {
  TempDir dir;
  const std::string weights = dir.file("trained.pt");
  auto r = run_trainer(
      join(plugin_args("adamw.so"),
           {"--model", "transformer", "--model-width", "16", "--model-depth", "1", "--seq-len", "8",
            "--max-train-steps", "3", "--output-dir", dir.file("out"), "--save-model", weights}));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto saved = fusebox::load_model_weights(weights);
  const auto final_ckpt = fusebox::load_checkpoint(dir.file("out/checkpoint-00000003.fbx")).model;
  ASSERT_EQ(saved.size(), final_ckpt.size());
  for (const auto& [name, t] : final_ckpt) {
    ASSERT_TRUE(saved.count(name)) << name;
    EXPECT_TRUE(at::equal(saved.at(name), t)) << name;
  }
  // The container Python's torch.load opens: a zip whose pickle is data.pkl, with no TorchScript
  // code in it (torch.load(weights_only=True) refuses TorchScript archives).
  const std::string bytes = testing::read_text(weights);
  EXPECT_EQ(bytes.rfind("PK", 0), 0u);
  EXPECT_NE(bytes.find("/data.pkl"), std::string::npos);
  EXPECT_EQ(bytes.find("constants.pkl"), std::string::npos);
  EXPECT_EQ(bytes.find("/code/"), std::string::npos);
}

TEST(TrainerTraining, ExampleConfigRunsThreeWays) {
  TempDir dir;
  std::vector<std::string> args = {
      "--config",          testing::repo_root() + "/examples/compare.toml",
      "--plugin-dir",      FUSEBOX_PLUGIN_DIR,
      "--max-train-steps", "3",
      "--output-dir",      dir.str(),
      "--threads",         "1"};
  if (!fs::exists(std::string(FUSEBOX_PLUGIN_DIR) + "/adafactor_fused.so"))
    args = join(args, {"--optimizer-plugin", "sgd.so", "--learning-rate", "0.01"});
  auto r = run_trainer(args);
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* run : {"normal", "fused", "groups4"}) {
    EXPECT_NE(r.out.find(std::string("\n") + run + "  "), std::string::npos) << r.out;
    EXPECT_EQ(losses(dir.str() + "/" + run + "/metrics.jsonl").size(), 3u) << run;
  }
  EXPECT_TRUE(fs::exists(dir.file("comparison.txt")));
  // Gradients are freed inside backward: the fused run's peak is lower.
  auto peak = [&](const std::string& run) {
    const std::string s = read_text(dir.str() + "/" + run + "/summary.json");
    return std::stoll(s.substr(s.find("\"peak_bytes\":") + 13));
  };
  EXPECT_LT(peak("fused"), peak("normal"));
  EXPECT_LT(peak("groups4"), peak("normal"));
  // A per-parameter optimizer: all three modes compute the same losses.
  EXPECT_EQ(losses(dir.str() + "/normal/metrics.jsonl"),
            losses(dir.str() + "/fused/metrics.jsonl"));
  // The example evaluates (after the last step here): the table has the held-out loss.
  EXPECT_NE(r.out.find("eval loss"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace fusebox::trainer
