// --init-weights: a run starts from saved parameters (a --save-model file, a state_dict, a
// checkpoint's model), trains on from them in every mode, and refuses a file that does not fit
// the model in one line before anything is trained or written.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/script.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "fusebox/core/checkpoint.h"
#include "fusebox/core/safetensors.h"
#include "trainer_test_util.h"

namespace fusebox::trainer {
namespace {

using testing::join;
using testing::Result;
using testing::run_trainer;
using testing::TempDir;

using Weights = std::map<std::string, at::Tensor>;

std::vector<std::string> mlp(const std::string& out, int steps) {
  return {"--optimizer",      "adamw",  "--model-width",     "16",
          "--threads",        "1",      "--max-train-steps", std::to_string(steps),
          "--log-every",      "0",      "--output-dir",      out,
          "--optimizer-args", "lr=0.05"};
}

void expect_same(const Weights& a, const Weights& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, t] : a) {
    ASSERT_EQ(b.count(name), 1u) << what << ": " << name;
    EXPECT_TRUE(at::equal(t, b.at(name))) << what << ": " << name;
  }
}

bool any_differs(const Weights& a, const Weights& b) {
  for (const auto& [name, t] : a)
    if (!at::equal(t, b.at(name))) return true;
  return false;
}

void save(const Weights& w, const std::string& path) {
  save_model_weights(std::vector<std::pair<std::string, at::Tensor>>(w.begin(), w.end()), path);
}

// A trained model's weights, saved by a first run.
class TrainerInitWeights : public ::testing::Test {
 protected:
  void SetUp() override {
    const Result r = run_trainer(
        join(mlp(tmp.file("first"), 4), {"--save-model", pretrained, "--save-every-n-steps", "4"}));
    ASSERT_EQ(r.code, 0) << r.err;
    weights = load_model_weights(pretrained);
  }
  TempDir tmp;
  const std::string pretrained = tmp.file("pretrained.pt");
  Weights weights;
};

}  // namespace

// With every learning rate scaled to 0 nothing moves: the run ends with exactly the file's values,
// in float32 and converted to float64.
TEST_F(TrainerInitWeights, TheRunStartsFromTheFilesValues) {
  const Result r =
      run_trainer(join(mlp(tmp.file("still"), 2), {"--init-weights", pretrained, "--lr-scale",
                                                   "*=0", "--save-model", tmp.file("still.pt")}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("initial weights: " + pretrained + ": 6 parameter tensors"),
            std::string::npos)
      << r.out;
  expect_same(weights, load_model_weights(tmp.file("still.pt")), "float32");

  const Result wide = run_trainer(
      join(mlp(tmp.file("f64"), 1), {"--init-weights", pretrained, "--lr-scale", "*=0", "--dtype",
                                     "float64", "--save-model", tmp.file("f64.pt")}));
  ASSERT_EQ(wide.code, 0) << wide.err;
  for (const auto& [name, t] : load_model_weights(tmp.file("f64.pt"))) {
    EXPECT_EQ(t.scalar_type(), at::kDouble) << name;
    EXPECT_TRUE(at::equal(t, weights.at(name).to(at::kDouble))) << name;
  }
}

// A model in two files with Hugging Face's index: --init-weights INDEX reads every tensor from its
// file, safetensors (model.safetensors.index.json) or torch.save'd (pytorch_model.bin.index.json).
TEST_F(TrainerInitWeights, AShardedModelIsReadThroughItsIndex) {
  for (const std::string format : {"safetensors", "bin"}) {
    const std::string stem = format == "bin" ? "pytorch_model" : "model";
    std::vector<std::pair<std::string, at::Tensor>> first, second;
    std::string weight_map;
    for (const auto& [name, t] : weights) {
      const bool one = first.size() <= second.size();
      (one ? first : second).emplace_back(name, t);
      weight_map += std::string(weight_map.empty() ? "" : ", ") + "\"" + name + "\": \"" + stem +
                    "-0000" + (one ? "1" : "2") + "-of-00002." + format + "\"";
    }
    for (const auto& [part, file] :
         {std::pair{&first, "-00001-of-00002."}, std::pair{&second, "-00002-of-00002."}}) {
      const std::string path = tmp.file(stem + file + format);
      format == "bin" ? save_model_weights(*part, path) : save_safetensors(*part, path);
    }
    const std::string index = tmp.file(stem + "." + format + ".index.json");
    std::ofstream(index) << "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {" << weight_map
                         << "}}";
    const Result r = run_trainer(join(mlp(tmp.file("sharded-" + format), 1),
                                      {"--init-weights", index, "--lr-scale", "*=0", "--save-model",
                                       tmp.file("sharded-" + format + ".pt")}));
    ASSERT_EQ(r.code, 0) << r.err;
    expect_same(weights, load_model_weights(tmp.file("sharded-" + format + ".pt")), format);
  }
}

// A file saved from a DistributedDataParallel and torch.compile wrapper ("module._orig_mod."
// before every name) loads with the prefixes removed, and the header says so; a file with only
// some names prefixed is refused.
TEST_F(TrainerInitWeights, AWrappersPrefixIsRemoved) {
  Weights prefixed;
  for (const auto& [name, t] : weights) prefixed["module._orig_mod." + name] = t;
  save(prefixed, tmp.file("wrapped.pt"));
  Result r = run_trainer(
      join(mlp(tmp.file("wrapped"), 1), {"--init-weights", tmp.file("wrapped.pt"), "--lr-scale",
                                         "*=0", "--save-model", tmp.file("unwrapped.pt")}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("6 parameter tensors (the file's names lose a wrapper's prefix "
                       "'module._orig_mod.')"),
            std::string::npos)
      << r.out;
  expect_same(weights, load_model_weights(tmp.file("unwrapped.pt")), "unwrapped");

  Weights some = weights;
  some["module.head.bias"] = some["head.bias"];
  some.erase("head.bias");
  save(some, tmp.file("some.pt"));
  r = run_trainer(join(mlp(tmp.file("some"), 1), {"--init-weights", tmp.file("some.pt")}));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("holds 'module.head.bias', which this model has no parameter or buffer of"),
            std::string::npos)
      << r.err;
}

// --save-model PATH.safetensors writes the same tensors in safetensors, and --init-weights reads
// that format too (told by the file's first bytes, whatever its name).
TEST_F(TrainerInitWeights, SafetensorsFilesAreWrittenAndRead) {
  const std::string st = tmp.file("trained.safetensors");
  Result r = run_trainer(join(mlp(tmp.file("again"), 4), {"--save-model", st}));
  ASSERT_EQ(r.code, 0) << r.err;
  std::map<std::string, std::string> meta;
  expect_same(weights, load_safetensors(st, &meta), "--save-model .safetensors");
  EXPECT_EQ(meta.at("format"), "pt");

  std::filesystem::copy_file(st, tmp.file("renamed.bin"));
  for (const std::string& from : {st, tmp.file("renamed.bin")}) {
    r = run_trainer(join(mlp(tmp.file("from-st"), 1), {"--init-weights", from, "--lr-scale", "*=0",
                                                       "--save-model", tmp.file("back.pt")}));
    ASSERT_EQ(r.code, 0) << r.err;
    expect_same(weights, load_model_weights(tmp.file("back.pt")), from);
  }

  // A cut file is one line naming it, exit 2.
  const std::string whole = encode_safetensors({{"head.bias", at::zeros({1})}});
  const std::string cut = tmp.file("cut.safetensors");
  std::ofstream(cut, std::ios::binary) << whole.substr(0, whole.size() - 2);
  r = run_trainer(join(mlp(tmp.file("cut"), 1), {"--init-weights", cut}));
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err.rfind("trainer: error: --init-weights: " + cut + ": not ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("(a truncated file?)"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

// --save-precision converts what --save-model writes (both formats); integer tensors and the
// checkpoints keep their own types; the file starts a run again.
TEST_F(TrainerInitWeights, SavePrecisionConvertsTheSavedFile) {
  for (const std::string& file : {tmp.file("half.safetensors"), tmp.file("half.pt")}) {
    const Result r = run_trainer(
        join(mlp(tmp.file("bf16"), 4), {"--save-model", file, "--save-precision", "bf16"}));
    ASSERT_EQ(r.code, 0) << r.err;
    const Weights saved = file.back() == 's' ? load_safetensors(file) : load_model_weights(file);
    ASSERT_EQ(saved.size(), weights.size());
    for (const auto& [name, t] : saved) {
      EXPECT_EQ(t.scalar_type(), at::kBFloat16) << name;
      EXPECT_TRUE(at::equal(t, weights.at(name).to(at::kBFloat16))) << name;
    }
    const Checkpoint last = load_checkpoint(tmp.file("bf16") + "/" + checkpoint_name(4));
    EXPECT_EQ(last.model.at("head.bias").scalar_type(), at::kFloat) << "training is unchanged";
    const Result again = run_trainer(join(mlp(tmp.file("again"), 1), {"--init-weights", file}));
    EXPECT_EQ(again.code, 0) << again.err;
  }
  Result r = run_trainer(join(mlp(tmp.file("none"), 1), {"--save-precision", "fp16"}));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--save-precision: sets what --save-model writes, and --save-model is "
                       "unset"),
            std::string::npos)
      << r.err;
}

// Fine-tuning from the saved file and from the checkpoint of the same step gives the same run, in
// the normal, fused and grouped modes alike; a frozen parameter keeps the file's value. A fresh
// run (no --init-weights) ends elsewhere.
TEST_F(TrainerInitWeights, AFileAndACheckpointStartTheSameRunInEveryMode) {
  const std::string ckpt = tmp.file("first") + "/" + checkpoint_name(4);
  const std::vector<std::string> tune = {"--freeze", "layers.0.bias", "--save-model"};
  Weights reference;
  int n = 0;
  for (const std::vector<std::string>& mode :
       {std::vector<std::string>{}, {"--fused-backward-pass"}, {"--fused-optimizer-groups", "2"}}) {
    for (const std::string& from : {pretrained, ckpt}) {
      const std::string name = "tune" + std::to_string(n++);
      const Result r = run_trainer(
          join(mlp(tmp.file(name), 3),
               join(mode, join({"--init-weights", from}, join(tune, {tmp.file(name + ".pt")})))));
      ASSERT_EQ(r.code, 0) << r.err;
      const Weights tuned = load_model_weights(tmp.file(name + ".pt"));
      EXPECT_TRUE(at::equal(tuned.at("layers.0.bias"), weights.at("layers.0.bias")));
      EXPECT_TRUE(any_differs(tuned, weights)) << "it trained on";
      if (reference.empty())
        reference = tuned;
      else
        expect_same(reference, tuned, name);
    }
  }
  EXPECT_NE(run_trainer(join(mlp(tmp.file("ckpt"), 1), {"--init-weights", ckpt}))
                .out.find("initial weights: " + ckpt +
                          " (the model of checkpoint step 4): 6 parameter tensors"),
            std::string::npos);

  const Result fresh =
      run_trainer(join(mlp(tmp.file("fresh"), 3), join(tune, {tmp.file("fresh.pt")})));
  ASSERT_EQ(fresh.code, 0) << fresh.err;
  EXPECT_TRUE(any_differs(load_model_weights(tmp.file("fresh.pt")), reference));
}

// A resumed run continues its checkpoint, whatever --init-weights says (the same command starts
// and restarts a fine-tuning job): it ends where the uninterrupted run ends.
TEST_F(TrainerInitWeights, AResumedCheckpointWins) {
  const std::string whole = tmp.file("whole");
  Result r = run_trainer(join(mlp(whole, 4), {"--init-weights", pretrained, "--save-every-n-steps",
                                              "2", "--save-model", tmp.file("whole.pt")}));
  ASSERT_EQ(r.code, 0) << r.err;
  Weights other = weights;
  for (auto& [name, t] : other) t = t * 2;
  save(other, tmp.file("other.pt"));
  r = run_trainer(join(mlp(tmp.file("resumed"), 4),
                       {"--init-weights", tmp.file("other.pt"), "--resume",
                        whole + "/" + checkpoint_name(2), "--save-model", tmp.file("resumed.pt")}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("--init-weights is not used: the checkpoint holds the weights"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("initial weights:"), std::string::npos) << r.out;
  expect_same(load_model_weights(tmp.file("whole.pt")), load_model_weights(tmp.file("resumed.pt")),
              "resumed");

  // --resume auto: the first start (no checkpoint yet) takes the file, a restart the checkpoint.
  const std::string job = tmp.file("job");
  const std::vector<std::string> again = {
      "--init-weights",       pretrained, "--resume",     "auto",
      "--save-every-n-steps", "2",        "--save-model", tmp.file("job.pt")};
  r = run_trainer(join(mlp(job, 2), again));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("initial weights: " + pretrained), std::string::npos) << r.out;
  r = run_trainer(join(mlp(job, 4), again));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("--init-weights is not used"), std::string::npos) << r.out;
  expect_same(load_model_weights(tmp.file("whole.pt")), load_model_weights(tmp.file("job.pt")),
              "--resume auto");
}

// A script model's buffers come from a file that has them (a Python state_dict); a file with the
// parameters alone leaves them as the module holds them, and says so.
TEST_F(TrainerInitWeights, AScriptModelTakesItsBuffersWhenTheFileHasThem) {
  torch::jit::Module m("Net");
  m.register_parameter("w", torch::zeros({8, 1}), false);
  m.register_buffer("shift", torch::zeros({8}));
  m.define(R"(
def forward(self, x):
    return (((x - self.shift).matmul(self.w) - x.sum(1, keepdim=True)) ** 2).mean()
)");
  const std::string script = tmp.file("net.pt");
  m.save(script);
  const Weights state = {{"w", torch::randn({8, 1})}, {"shift", torch::full({8}, 0.25)}};
  save(state, tmp.file("state.pt"));
  auto args = [&](const std::string& name, const std::string& init) {
    return std::vector<std::string>{
        "--model-script", script, "--model-width",     "8", "--optimizer",          "sgd",
        "--lr-scale",     "*=0",  "--max-train-steps", "1", "--output-dir",         tmp.file(name),
        "--init-weights", init,   "--log-every",       "0", "--save-every-n-steps", "1"};
  };
  Result r = run_trainer(args("both", tmp.file("state.pt")));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find(": 1 parameter tensor, 1 buffer\n"), std::string::npos) << r.out;
  Checkpoint ck = load_checkpoint(tmp.file("both") + "/" + checkpoint_name(1));
  EXPECT_TRUE(at::equal(ck.model.at("w"), state.at("w")));
  EXPECT_TRUE(at::equal(ck.buffers.at("shift"), state.at("shift")));

  save({{"w", state.at("w")}}, tmp.file("params.pt"));
  r = run_trainer(args("params", tmp.file("params.pt")));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find(
                ": 1 parameter tensor; buffers as the model holds them (not in the file): 'shift'"),
            std::string::npos)
      << r.out;
  ck = load_checkpoint(tmp.file("params") + "/" + checkpoint_name(1));
  EXPECT_TRUE(at::equal(ck.model.at("w"), state.at("w")));
  EXPECT_TRUE(at::equal(ck.buffers.at("shift"), at::zeros({8})));

  // Its --save-model in safetensors is the module's state_dict: parameters and buffers.
  r = run_trainer(
      join(args("st", tmp.file("state.pt")), {"--save-model", tmp.file("net.safetensors")}));
  ASSERT_EQ(r.code, 0) << r.err;
  expect_same(state, load_safetensors(tmp.file("net.safetensors")), "script .safetensors");
}

// --init-weights-strict=false: the parameters the file lacks (a new head) keep the model's own
// initialisation, tensors the model lacks are left unused, and the header names both; a file with
// none of the model's parameters is still refused.
TEST_F(TrainerInitWeights, NotStrictKeepsTheInitialisationOfWhatTheFileLacks) {
  Result r = run_trainer(
      join(mlp(tmp.file("fresh"), 1), {"--lr-scale", "*=0", "--save-model", tmp.file("fresh.pt")}));
  ASSERT_EQ(r.code, 0) << r.err;
  const Weights fresh = load_model_weights(tmp.file("fresh.pt"));
  Weights backbone = weights;
  backbone.erase("head.weight");
  backbone.erase("head.bias");
  backbone["extra.weight"] = at::ones({3});
  save(backbone, tmp.file("backbone.pt"));

  r = run_trainer(join(mlp(tmp.file("strict"), 1), {"--init-weights", tmp.file("backbone.pt")}));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("holds 'extra.weight', which this model has no parameter or buffer of"),
            std::string::npos)
      << r.err;

  r = run_trainer(join(mlp(tmp.file("loose"), 1),
                       {"--init-weights", tmp.file("backbone.pt"), "--init-weights-strict=false",
                        "--lr-scale", "*=0", "--save-model", tmp.file("loose.pt")}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find(": 4 parameter tensors; initialised by the model (not in the file): "
                       "'head.weight', 'head.bias'; left unused (not in the model): "
                       "'extra.weight'"),
            std::string::npos)
      << r.out;
  const Weights loose = load_model_weights(tmp.file("loose.pt"));
  for (const auto& [name, t] : loose)
    EXPECT_TRUE(at::equal(t, (name.rfind("head.", 0) == 0 ? fresh : weights).at(name))) << name;

  save({{"other.weight", at::ones({2})}}, tmp.file("other.pt"));
  r = run_trainer(join(mlp(tmp.file("other"), 1),
                       {"--init-weights", tmp.file("other.pt"), "--init-weights-strict=false"}));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("which this model has no parameter or buffer of"), std::string::npos)
      << r.err;
  r = run_trainer(join(mlp(tmp.file("unset"), 1), {"--init-weights-strict=false"}));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--init-weights-strict: says how --init-weights is read, and "
                       "--init-weights is unset"),
            std::string::npos)
      << r.err;
}

// Every file that does not fit the model: exit 2, one line naming the file and the tensor, and no
// output written.
TEST_F(TrainerInitWeights, AFileThatDoesNotFitIsRefusedInOneLine) {
  Weights missing = weights;
  missing.erase("head.bias");
  Weights extra = weights;
  extra["head2.weight"] = at::zeros({2});
  Weights nan = weights;
  nan["layers.1.weight"] = nan["layers.1.weight"].clone();
  nan["layers.1.weight"][0][0] = std::numeric_limits<float>::quiet_NaN();
  Weights ints = weights;
  ints["head.bias"] = ints["head.bias"].to(at::kLong);
  const std::vector<std::pair<Weights, std::string>> cases = {
      {missing,
       "has no 'head.bias' of this model's parameters: is it the weights of another "
       "model or other sizes? (--list-params shows this model's names; "
       "--init-weights-strict=false keeps the initialisation of parameters the file "
       "lacks)"},
      {extra, "holds 'head2.weight', which this model has no parameter or buffer of"},
      {nan, "parameter 'layers.1.weight' holds values that are not finite"},
      {ints, "parameter 'head.bias' is Long, this model's is Float"}};
  int n = 0;
  for (const auto& [w, expected] : cases) {
    const std::string file = tmp.file("bad" + std::to_string(n) + ".pt");
    const std::string out = tmp.file("out" + std::to_string(n++));
    save(w, file);
    const Result r = run_trainer(join(mlp(out, 2), {"--init-weights", file}));
    EXPECT_EQ(r.code, 2) << expected;
    EXPECT_EQ(r.err.rfind("trainer: error: --init-weights: " + file, 0), 0u) << r.err;
    EXPECT_NE(r.err.find(expected), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_FALSE(std::filesystem::exists(out + "/metrics.jsonl")) << expected;
  }

  const std::vector<std::pair<std::vector<std::string>, std::string>> others = {
      {{"--model-width", "32", "--init-weights", pretrained},
       "parameter 'layers.0.weight' has shape [16, 16], this model's has [32, 32]"},
      {{"--init-weights", tmp.write("junk.pt", "not weights")}, "junk.pt cannot be decoded"},
      {{"--init-weights", tmp.file("none.pt")},
       "--init-weights: file " + tmp.file("none.pt") + " does not exist"},
      {{"--init-weights", tmp.file("first")}, "is a folder"}};
  for (const auto& [args, expected] : others) {
    const Result r = run_trainer(join(mlp(tmp.file("other"), 2), args));
    EXPECT_EQ(r.code, 2) << expected;
    EXPECT_NE(r.err.find(expected), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

}  // namespace fusebox::trainer
