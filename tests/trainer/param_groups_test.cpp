// --lr-scale and --no-weight-decay: parameter groups with their own lr and weight decay, the
// same in every step mode, and refused in one line where they cannot apply.
#include "param_groups.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "../error_of.h"
#include "fusebox/core/checkpoint.h"
#include "fusebox/error.h"
#include "trainer_test_util.h"

namespace fusebox::trainer {
namespace {

using fusebox::testing::error_of;
using testing::join;
using testing::losses;
using testing::read_text;
using testing::Result;
using testing::run_trainer;
using testing::TempDir;

using Named = std::vector<std::pair<std::string, at::Tensor>>;

Named tensors(const std::vector<std::string>& names) {
  Named out;
  for (const std::string& n : names) out.emplace_back(n, at::zeros({2}));
  return out;
}

// A small MLP run (names layers.0.weight, layers.0.bias, ..., head.weight, head.bias).
std::vector<std::string> mlp(const std::string& out, const std::string& model_file) {
  return {"--optimizer",  "adamw", "--model-width",     "16",      "--model-depth", "2",
          "--threads",    "1",     "--max-train-steps", "4",       "--log-every",   "0",
          "--output-dir", out,     "--save-model",      model_file};
}

}  // namespace

TEST(ParamGroups, WithoutRulesEveryParameterIsInOneGroupWithThePluginsSettings) {
  const GroupedParams g = make_param_groups(tensors({"a.weight", "a.bias"}), {}, 0.1, 0.01);
  ASSERT_EQ(g.groups.size(), 1u);
  EXPECT_EQ(g.groups[0].names, (std::vector<std::string>{"a.weight", "a.bias"}));
  EXPECT_TRUE(std::isnan(g.groups[0].lr));
  EXPECT_TRUE(std::isnan(g.groups[0].weight_decay));
  EXPECT_EQ(g.summary, "");
}

TEST(ParamGroups, GroupsFollowTheFirstMatchingScaleAndTheDecayGlobsInModelOrder) {
  GroupRules rules;
  rules.lr_scale = {{"emb.*", 0.5}, {"*", 2.0}};
  rules.no_weight_decay = {"*.bias", "norm.*"};
  const GroupedParams g = make_param_groups(
      tensors({"emb.weight", "fc.weight", "fc.bias", "norm.weight", "emb.bias", "out.weight"}),
      rules, 0.25, 0.01);
  ASSERT_EQ(g.groups.size(), 4u);
  EXPECT_EQ(g.groups[0].names, (std::vector<std::string>{"emb.weight"}));
  EXPECT_EQ(g.groups[0].lr, 0.125);
  EXPECT_TRUE(std::isnan(g.groups[0].weight_decay));
  EXPECT_EQ(g.groups[1].names, (std::vector<std::string>{"fc.weight", "out.weight"}));
  EXPECT_EQ(g.groups[1].lr, 0.5);
  EXPECT_EQ(g.groups[2].names, (std::vector<std::string>{"fc.bias", "norm.weight"}));
  EXPECT_EQ(g.groups[2].lr, 0.5);
  EXPECT_EQ(g.groups[2].weight_decay, 0.0);
  EXPECT_EQ(g.groups[3].names, (std::vector<std::string>{"emb.bias"}));
  EXPECT_EQ(g.groups[3].lr, 0.125);
  EXPECT_EQ(g.groups[3].weight_decay, 0.0);
  EXPECT_NE(g.summary.find("param groups: 4 (lr ×0.5 (0.125), weight decay 0.01: 1 tensors, 2 "
                           "values; lr ×2.0 (0.5), weight decay 0.01: 2 tensors"),
            std::string::npos)
      << g.summary;
}

TEST(ParamGroups, AFactorOfOneKeepsThePluginsLr) {
  GroupRules rules;
  rules.lr_scale = {{"*", 1.0}};
  const GroupedParams g = make_param_groups(tensors({"w"}), rules, std::nullopt, std::nullopt);
  ASSERT_EQ(g.groups.size(), 1u);
  EXPECT_TRUE(std::isnan(g.groups[0].lr));
}

TEST(ParamGroups, BadRulesAreErrorsNamingTheOption) {
  GroupRules rules;
  rules.no_weight_decay = {"*.bais"};
  rules.no_weight_decay_label = "--no-weight-decay";
  EXPECT_NE(error_of([&] { make_param_groups(tensors({"a.bias"}), rules, 0.1, 0.1); })
                .find("--no-weight-decay: '*.bais' matches no parameter of this model; its names "
                      "are a.bias"),
            std::string::npos);
  rules = {};
  rules.lr_scale = {{"a*", 0.5}};
  rules.lr_scale_label = "--lr-scale";
  EXPECT_NE(error_of([&] {
              make_param_groups(tensors({"a"}), rules, std::nullopt, 0.1);
            }).find("--lr-scale: scales the learning rate, but the plugin runs without one"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_lr_scale("emb*", "--lr-scale"); }).find("is not GLOB=FACTOR"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              parse_lr_scale("emb*=-1", "--lr-scale");
            }).find("the factor '-1' must be a finite number >= 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_lr_scale("emb*=x", "--lr-scale"); }).find("the factor 'x'"),
            std::string::npos);
  const LrScaleRule r = parse_lr_scale("a[=]b=0.25", "--lr-scale");
  EXPECT_EQ(r.glob, "a[=]b");
  EXPECT_EQ(r.factor, 0.25);
  EXPECT_TRUE(glob_matches("a[=]b", "a=b"));
  EXPECT_TRUE(glob_matches("blocks.*.ln?.weight", "blocks.0.ln1.weight"));
  EXPECT_FALSE(glob_matches("*.bias", "fc.bias.x"));
}

// One step, from the same start and batch in every run, so each tensor's update depends on its
// own group's settings alone: no decay on every parameter is weight_decay=0; on the biases, the
// biases step as without decay and the weights as with it; a factor of 0 keeps the matching
// parameters at their start and the others step as usual.
TEST(ParamGroups, TheTrainerAppliesEachGroupsWeightDecayAndLr) {
  TempDir tmp;
  const std::vector<std::string> big_decay = {"--optimizer-args", "lr=0.01", "weight_decay=0.5"};
  auto run = [&](const std::string& name, const std::vector<std::string>& extra) {
    const Result r = run_trainer(
        join(join(mlp(tmp.file(name), tmp.file(name + ".pt")), {"--max-train-steps", "1"}), extra));
    EXPECT_EQ(r.code, 0) << name << ": " << r.err;
    return load_model_weights(tmp.file(name + ".pt"));
  };
  const auto decayed = run("decayed", big_decay);
  const auto none = run("none", {"--optimizer-args", "lr=0.01", "weight_decay=0"});
  const auto all_excluded = run("all", join(big_decay, {"--no-weight-decay", "*"}));
  const auto biases = run("biases", join(big_decay, {"--no-weight-decay", "*.bias"}));
  ASSERT_EQ(decayed.size(), 6u);
  for (const auto& [name, t] : none) {
    EXPECT_TRUE(at::equal(all_excluded.at(name), t)) << name;
    const bool bias = name.size() > 5 && name.substr(name.size() - 5) == ".bias";
    EXPECT_TRUE(at::equal(biases.at(name), bias ? t : decayed.at(name))) << name;
    EXPECT_FALSE(at::equal(decayed.at(name), t)) << name << ": the decay must show";
  }

  const auto frozen = run("frozen", join(big_decay, {"--lr-scale", "*=0"}));
  const auto first_frozen = run("first", join(big_decay, {"--lr-scale", "layers.0.*=0"}));
  for (const auto& [name, t] : frozen) {
    const bool first = name.rfind("layers.0.", 0) == 0;
    EXPECT_EQ(at::equal(first_frozen.at(name), t), first) << name;
    EXPECT_EQ(at::equal(first_frozen.at(name), decayed.at(name)), !first) << name;
  }
}

// lr × 0.5 everywhere is the halved lr, under a schedule with warm-up, bit for bit; and the
// groups train alike in the normal loop, the fused backward pass and optimizer groups.
TEST(ParamGroups, AScaledGroupFollowsTheScheduleAndEveryModeAgrees) {
  TempDir tmp;
  const std::vector<std::string> schedule = {"--lr-scheduler", "cosine", "--lr-warmup-steps", "2"};
  const Result half = run_trainer(join(mlp(tmp.file("half"), tmp.file("half.pt")),
                                       join(schedule, {"--learning-rate", "0.005"})));
  ASSERT_EQ(half.code, 0) << half.err;
  const Result scaled =
      run_trainer(join(mlp(tmp.file("scaled"), tmp.file("scaled.pt")),
                       join(schedule, {"--learning-rate", "0.01", "--lr-scale", "*=0.5"})));
  ASSERT_EQ(scaled.code, 0) << scaled.err;
  EXPECT_EQ(losses(tmp.file("half/metrics.jsonl")), losses(tmp.file("scaled/metrics.jsonl")));
  EXPECT_TRUE(read_text(tmp.file("half.pt")) == read_text(tmp.file("scaled.pt")));

  const std::vector<std::string> rules = {"--learning-rate", "0.01",         "--lr-scale",
                                          "head.*=0.1",      "layers.0.*=3", "--no-weight-decay",
                                          "*.bias"};
  std::string reference, reference_columns;
  for (const std::vector<std::string>& mode :
       {std::vector<std::string>{}, {"--fused-backward-pass"}, {"--fused-optimizer-groups", "2"}}) {
    const std::string name = "mode" + std::to_string(mode.size());
    const Result r = run_trainer(
        join(mlp(tmp.file(name), tmp.file(name + ".pt")), join(schedule, join(rules, mode))));
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_NE(r.out.find("param groups: 6 (lr ×3.0 (0.03), weight decay 0.01: 1 tensors, 256 "
                         "values; lr ×3.0 (0.03), weight decay 0: 1 tensors"),
              std::string::npos)
        << r.out;
    const std::string weights = read_text(tmp.file(name + ".pt"));
    if (reference.empty()) reference = weights;
    EXPECT_TRUE(weights == reference) << "mode " << name << " trained other weights";
    const std::string csv = read_text(tmp.file(name + "/metrics.csv"));
    EXPECT_NE(csv.find(",lr_5,effective_lr_0,"), std::string::npos)
        << "one lr column per group: " << csv;
    // Step, loss and the 12 lr columns: the same in every mode (the timings differ).
    std::string schedule_columns;
    std::istringstream rows(csv);
    for (std::string row; std::getline(rows, row);) {
      size_t end = 0;
      for (int field = 0; field < 14 && end != std::string::npos; ++field)
        end = row.find(',', end + (field ? 1 : 0));
      schedule_columns += row.substr(0, end) + "\n";
    }
    if (reference_columns.empty()) reference_columns = schedule_columns;
    EXPECT_EQ(schedule_columns, reference_columns) << "mode " << name;
  }
  EXPECT_FALSE(reference == read_text(tmp.file("half.pt")));
}

TEST(ParamGroups, RulesThatCannotApplyAreOneLineErrors) {
  TempDir tmp;
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"--no-weight-decay", "*.bais"},
       "--no-weight-decay: '*.bais' matches no parameter of this model; its names are "
       "layers.0.weight, layers.0.bias"},
      {{"--lr-scale", "head*"}, "--lr-scale: 'head*' is not GLOB=FACTOR"},
      {{"--lr-scale", "head*=-2"}, "must be a finite number >= 0"},
      {{"--no-weight-decay", ""}, "--no-weight-decay: a glob must not be empty"},
      {{"--optimizer", "prodigy", "--lr-scale", "head*=0.5"},
       "prodigy estimates one step size for all parameters"},
      {{"--optimizer", "adafactor", "--lr-scale", "head*=0.5"},
       "adafactor with relative_step=true computes its own step size and ignores the lr"},
      {{"--optimizer-plugin", std::string(FUSEBOX_TEST_PLUGIN_DIR) + "/tp_step_throws.so",
        "--no-weight-decay", "*.bias"},
       "has no weight_decay hyperparameter"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = mlp(tmp.file("out"), tmp.file("m.pt"));
    args.erase(args.begin(), args.begin() + 2);  // the cases may choose another optimizer
    if (std::find(c.args.begin(), c.args.end(), "--optimizer") == c.args.end() &&
        std::find(c.args.begin(), c.args.end(), "--optimizer-plugin") == c.args.end())
      args = join(args, {"--optimizer", "adamw"});
    const Result r = run_trainer(join(args, c.args));
    EXPECT_EQ(r.code, 2) << c.expected << "\n" << r.out;
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

// --freeze: the frozen parameters keep their initial values, get no gradient and no optimizer
// state (less state memory), and every mode and a resume agree.
TEST(ParamGroups, FrozenParametersStayAndHoldNoState) {
  TempDir tmp;
  auto run = [&](const std::string& name, const std::vector<std::string>& extra) {
    const Result r = run_trainer(join(mlp(tmp.file(name), tmp.file(name + ".pt")), extra));
    EXPECT_EQ(r.code, 0) << name << ": " << r.err;
    return r;
  };
  run("still", {"--lr-scale", "*=0"});  // every parameter at its start
  const auto start = load_model_weights(tmp.file("still.pt"));
  const Result frozen = run("frozen", {"--freeze", "layers.0.*", "--save-every-n-steps", "2"});
  EXPECT_NE(frozen.out.find("; frozen: 2 tensors, 272 values (no gradients, no optimizer state)"),
            std::string::npos)
      << frozen.out;
  const auto trained = load_model_weights(tmp.file("frozen.pt"));
  ASSERT_EQ(trained.size(), 6u) << "--save-model holds the frozen parameters too";
  for (const auto& [name, t] : trained)
    EXPECT_EQ(at::equal(t, start.at(name)), name.rfind("layers.0.", 0) == 0) << name;
  const Checkpoint ckpt = load_checkpoint(tmp.file("frozen/" + checkpoint_name(4)));
  EXPECT_EQ(ckpt.model.size(), 6u);
  for (const auto& [key, t] : ckpt.optimizer)
    EXPECT_NE(key.rfind("layers.0.", 0), 0u) << "state for a frozen parameter: " << key;
  run("all", {});
  const auto state_bytes = [&](const std::string& name) {
    const std::string s = read_text(tmp.file(name + "/summary.json"));
    return std::stoll(s.substr(s.find("\"optimizer_state_bytes\":") + 24));
  };
  EXPECT_LT(state_bytes("frozen"), state_bytes("all"));

  const std::string bytes = read_text(tmp.file("frozen.pt"));
  for (const std::vector<std::string>& mode : {std::vector<std::string>{"--fused-backward-pass"},
                                               {"--fused-optimizer-groups", "2"},
                                               {"--gradient-checkpointing"}}) {
    const std::string name = "mode" + mode.front();
    run(name, join({"--freeze", "layers.0.*"}, mode));
    EXPECT_TRUE(read_text(tmp.file(name + ".pt")) == bytes) << mode.front();
  }
  run("resumed", {"--freeze", "layers.0.*", "--resume", tmp.file("frozen/" + checkpoint_name(2))});
  EXPECT_TRUE(read_text(tmp.file("resumed.pt")) == bytes);

  const Result everything =
      run_trainer(join(mlp(tmp.file("x"), tmp.file("x.pt")), {"--freeze", "layers.*", "head.*"}));
  EXPECT_EQ(everything.code, 2);
  EXPECT_NE(everything.err.find("--freeze: freezes every parameter of this model"),
            std::string::npos)
      << everything.err;
}

// --list-params: every parameter in model order with the group, lr and weight decay it would
// train with; nothing is trained or written.
TEST(ParamGroups, ListParamsShowsWhatEachParameterTrainsWith) {
  TempDir tmp;
  const Result r =
      run_trainer({"--optimizer", "adamw", "--model-width", "16", "--output-dir", tmp.file("out"),
                   "--list-params", "--lr-scale", "head.*=0.5", "--no-weight-decay", "*.bias"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out,
            "parameters of mlp (width 16, depth 2): 561 parameters in 6 tensors with adamw (4 "
            "param groups; lr before any schedule):\n"
            "  NAME             SHAPE     VALUES  GROUP  LR     WEIGHT DECAY\n"
            "  layers.0.weight  [16, 16]  256     0      0.001  0.01\n"
            "  layers.0.bias    [16]      16      1      0.001  0.0\n"
            "  layers.1.weight  [16, 16]  256     0      0.001  0.01\n"
            "  layers.1.bias    [16]      16      1      0.001  0.0\n"
            "  head.weight      [1, 16]   16      2      5e-04  0.01\n"
            "  head.bias        [1]       1       3      5e-04  0.0\n");
  const Result frozen = run_trainer(
      {"--optimizer", "adamw", "--model-width", "16", "--list-params", "--freeze", "layers.1.*"});
  ASSERT_EQ(frozen.code, 0) << frozen.err;
  EXPECT_NE(frozen.out.find("  layers.1.bias    [16]      16      frozen  -      -\n"),
            std::string::npos)
      << frozen.out;
  EXPECT_FALSE(std::filesystem::exists(tmp.file("out")));
  // The rules are checked as for training.
  const Result bad = run_trainer({"--optimizer", "adamw", "--list-params", "--lr-scale", "x=1"});
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("'x' matches no parameter"), std::string::npos) << bad.err;
}

TEST(ParamGroups, AConfigFileSetsTheRulesAsLists) {
  TempDir tmp;
  const std::string config = tmp.write("run.toml",
                                       "lr_scale = [\"head.*=0\"]\n"
                                       "no_weight_decay = [\"*.bias\", \"layers.1.*\"]\n");
  const Result r = run_trainer(join(mlp(tmp.file("out"), tmp.file("m.pt")), {"--config", config}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(
      r.out.find("param groups: 4 (lr ×1.0 (0.001), weight decay 0.01: 1 tensors, 256 values; "
                 "lr ×1.0 (0.001), weight decay 0: 3 tensors"),
      std::string::npos)
      << r.out;
  const Result printed =
      run_trainer({"--config", config, "--optimizer", "adamw", "--print-config"});
  ASSERT_EQ(printed.code, 0) << printed.err;
  EXPECT_NE(printed.out.find("no_weight_decay = [\"*.bias\", \"layers.1.*\"]"), std::string::npos)
      << printed.out;
}

}  // namespace fusebox::trainer
