// Options, TOML configs, precedence, errors and --print-config.
#include <gtest/gtest.h>

#include "../error_of.h"
#include "config.h"
#include "fusebox/core/distributed.h"
#include "fusebox/core/zip_archive.h"
#include "fusebox/error.h"
#include "options.h"
#include "toml_io.h"
#include "trainer_test_util.h"

namespace fusebox::trainer {
namespace {

using fusebox::testing::error_of;
using testing::count_lines;
using testing::join;
using testing::plugin_args;
using testing::run_trainer;
using testing::TempDir;

// Resolves a config text plus command line as the program does (single run).
TrainConfig resolve(const std::string& toml, const std::vector<std::string>& cli) {
  ConfigFile f = parse_config_text(toml, "run.toml");
  Layer l = default_layer();
  l.overlay(f.base);
  l.overlay(parse_command_line(cli).layer);
  return resolve_config(l, "");
}

TEST(TrainerConfig, CommandLineOverridesConfigWhichOverridesDefaults) {
  const std::string toml = "optimizer = \"sgd\"\nseed = 7\ntrain_batch_size = 3\n";
  TrainConfig c = resolve(toml, {"--seed", "9"});
  EXPECT_EQ(c.seed, 9);               // command line wins
  EXPECT_EQ(c.train_batch_size, 3);   // config wins over the default
  EXPECT_EQ(c.max_train_steps, 100);  // default
  EXPECT_EQ(*c.optimizer, "sgd");
  EXPECT_FALSE(c.learning_rate.has_value());  // unset: the plugin's own default applies
  c = resolve(toml, {"--learning-rate=0.25", "--fused-backward-pass"});
  EXPECT_DOUBLE_EQ(*c.learning_rate, 0.25);
  EXPECT_TRUE(c.fused_backward_pass);
  EXPECT_EQ(c.mode(), "fused");
  c = resolve("optimizer = \"sgd\"\nfused_backward_pass = true\n", {"--fused-backward-pass=false"});
  EXPECT_FALSE(c.fused_backward_pass);
}

// The learning rate can be given two ways (--learning-rate, the optimizer argument lr): a layer
// giving it either way replaces the layer below; given both ways in one layer it is an error.
TEST(TrainerConfig, TheLearningRateGivenEitherWayOverridesTheLayerBelow) {
  TrainConfig c =
      resolve("optimizer = \"sgd\"\nlearning_rate = 0.1\n", {"--optimizer-args", "lr=0.2"});
  EXPECT_FALSE(c.learning_rate.has_value());
  ASSERT_EQ(c.optimizer_args.count("lr"), 1u);
  EXPECT_EQ(c.optimizer_args.at("lr").text, "0.2");
  c = resolve("optimizer = \"sgd\"\n[optimizer_args]\nlr = 0.1\nmomentum = 0.5\n",
              {"--learning-rate", "0.3"});
  EXPECT_DOUBLE_EQ(*c.learning_rate, 0.3);
  EXPECT_EQ(c.optimizer_args.count("lr"), 0u);
  EXPECT_EQ(c.optimizer_args.count("momentum"), 1u);  // the other arguments stay
  // A [[runs]] entry is a layer too.
  ConfigFile f = parse_config_text(
      "optimizer = \"sgd\"\nlearning_rate = 0.1\n[[runs]]\nname = \"a\"\n"
      "[runs.optimizer_args]\nlr = 0.4\n",
      "run.toml");
  Layer l = default_layer();
  l.overlay(f.base);
  l.overlay(f.runs.at(0).layer);
  c = resolve_config(l, "a");
  EXPECT_FALSE(c.learning_rate.has_value());
  EXPECT_DOUBLE_EQ(std::get<double>(c.optimizer_args.at("lr").value), 0.4);
  // Both ways in one file is still ambiguous.
  const std::string m = error_of([] {
    resolve("optimizer = \"sgd\"\nlearning_rate = 0.1\n[optimizer_args]\nlr = 0.2\n", {});
  });
  EXPECT_NE(m.find("run.toml:2:17: learning_rate: the learning rate is also given as optimizer "
                   "argument lr (run.toml:4:6); give it once"),
            std::string::npos)
      << m;
}

TEST(TrainerConfig, OptimizerArgsMergePerKeyCommandLineWinning) {
  const std::string toml =
      "optimizer = \"sgd\"\n[optimizer_args]\nmomentum = 0.5\nnesterov = true\nbetas = [0.9, "
      "0.99]\n";
  TrainConfig c = resolve(toml, {"--optimizer-args", "momentum=0.75", "dampening=0"});
  ASSERT_EQ(c.optimizer_args.size(), 4u);
  EXPECT_EQ(c.optimizer_args.at("momentum").text, "0.75");
  EXPECT_EQ(c.optimizer_args.at("momentum").where, "--optimizer-args");
  EXPECT_EQ(std::get<bool>(c.optimizer_args.at("nesterov").value), true);
  EXPECT_EQ(c.optimizer_args.at("nesterov").where, "run.toml:4:12");
  auto pair = std::get<std::pair<double, double>>(c.optimizer_args.at("betas").value);
  EXPECT_DOUBLE_EQ(pair.second, 0.99);
}

TEST(TrainerConfig, UnknownTomlKeyNamesPlaceAndSuggestion) {
  std::string m = error_of([] { resolve("optimizer = \"sgd\"\nlerning_rate = 0.1\n", {}); });
  EXPECT_NE(m.find("run.toml:2:16"), std::string::npos) << m;
  EXPECT_NE(m.find("unknown key 'lerning_rate'"), std::string::npos) << m;
  EXPECT_NE(m.find("did you mean 'learning_rate'"), std::string::npos) << m;
  m = error_of([] { resolve("[[runs]]\nname = \"a\"\nsed = 1\n", {}); });
  EXPECT_NE(m.find("run.toml:3:7: unknown key 'runs.sed'"), std::string::npos) << m;
  // Command-line actions are not config keys.
  m = error_of([] { resolve("help = true\n", {}); });
  EXPECT_NE(m.find("unknown key 'help'"), std::string::npos) << m;
}

TEST(TrainerConfig, WrongTypeAndBadValuesNamePlaceAndKey) {
  std::string m = error_of([] { resolve("optimizer = \"sgd\"\ntrain_batch_size = \"8\"\n", {}); });
  EXPECT_EQ(m, "run.toml:2:20: train_batch_size: expected an integer, got a string");
  m = error_of([] { resolve("optimizer = \"sgd\"\ntrain_batch_size = 0\n", {}); });
  EXPECT_EQ(m, "run.toml:2:20: train_batch_size: must be at least 1, got 0");
  m = error_of([] { resolve("optimizer = \"sgd\"\nmixed_precision = \"bf61\"\n", {}); });
  EXPECT_NE(m.find("run.toml:2:19: mixed_precision: 'bf61' is not one of no, fp16, bf16"),
            std::string::npos)
      << m;
  m = error_of([] { resolve("optimizer = \"sgd\"\nfused_backward_pass = 1\n", {}); });
  EXPECT_NE(m.find("fused_backward_pass: expected true or false, got an integer"),
            std::string::npos)
      << m;
  m = error_of([] { resolve("optimizer = \"sgd\"\nseed = [1\n", {}); });
  EXPECT_EQ(m.rfind("run.toml:2:", 0), 0u) << m;  // a syntax error with its position
  m = error_of([] { resolve("", {"--optimizer", "sgd", "--train-batch-size", "eight"}); });
  EXPECT_EQ(m, "--train-batch-size: 'eight' is not an integer");
  m = error_of([] { resolve("", {"--optimizer", "sgd", "--max-grad-norm", "-1"}); });
  EXPECT_EQ(m, "--max-grad-norm: must be at least 0.0, got -1.0");
  m = error_of([] { resolve("", {"--optimizer", "sgd", "--dataset", "txt:foo"}); });
  EXPECT_NE(m.find("--dataset: 'txt:foo' is not synthetic, none, text:PATH or tensors:PATH"),
            std::string::npos)
      << m;
  m = error_of([] { resolve("", {"--optimizer", "sgd", "--model-script", "/no/such.pt"}); });
  EXPECT_EQ(m, "--model-script: file /no/such.pt does not exist");
  m = error_of([] {
    resolve("", {"--optimizer", "sgd", "--model", "transformer", "--dataset", "text:/no/such.txt"});
  });
  EXPECT_EQ(m, "--dataset: text file /no/such.txt does not exist");
  m = error_of([] { resolve("", {}); });
  EXPECT_NE(m.find("no optimizer"), std::string::npos) << m;
  m = error_of([] {
    resolve("", {"--optimizer", "sgd", "--learning-rate", "0.1", "--optimizer-args", "lr=0.2"});
  });
  EXPECT_NE(m.find("give it once"), std::string::npos) << m;
}

TEST(TrainerConfig, UnknownCommandLineOptionSuggestsNearest) {
  std::string m = error_of([] { parse_command_line({"--lerning-rate", "0.1"}); });
  EXPECT_EQ(
      m, "unknown option '--lerning-rate' (did you mean '--learning-rate'?); see trainer --help");
  m = error_of([] { parse_command_line({"--optimizer-args", "momentum"}); });
  EXPECT_EQ(m, "--optimizer-args: 'momentum' is not key=value");
  m = error_of([] { parse_command_line({"--optimizer-args", "momentum=0.5", "momentum=0.9"}); });
  EXPECT_EQ(m, "--optimizer-args: 'momentum' is given twice (0.5 and 0.9); give it once");
  m = error_of([] {
    parse_command_line({"--optimizer-args", "lr=1", "--optimizer-args", "momentum=0", "lr=2"});
  });
  EXPECT_EQ(m, "--optimizer-args: 'lr' is given twice (1 and 2); give it once");
  m = error_of([] { parse_command_line({"stray"}); });
  EXPECT_NE(m.find("unexpected argument 'stray'"), std::string::npos) << m;
  // No abbreviations: a prefix of an option is not that option.
  m = error_of([] { parse_command_line({"--max-train", "3"}); });
  EXPECT_NE(m.find("unknown option '--max-train'"), std::string::npos) << m;
}

TEST(TrainerConfig, ForbiddenCombinationsAreErrors) {
  std::string m = error_of([] {
    resolve("optimizer = \"sgd\"\nfused_backward_pass = true\nfused_optimizer_groups = 4\n", {});
  });
  EXPECT_EQ(m,
            "run.toml:3:26: fused_optimizer_groups: cannot be combined with "
            "--fused-backward-pass; choose one of the two modes");
  m = error_of([] {
    resolve("",
            {"--optimizer", "sgd", "--fused-backward-pass", "--gradient-accumulation-steps", "2"});
  });
  EXPECT_NE(m.find("--gradient-accumulation-steps: 2 cannot be used with --fused-backward-pass"),
            std::string::npos)
      << m;
  m = error_of([] {
    resolve("", {"--optimizer", "sgd", "--fused-optimizer-groups", "3",
                 "--gradient-accumulation-steps", "4"});
  });
  EXPECT_NE(m.find("--gradient-accumulation-steps: 4 cannot be used with --fused-optimizer-groups"),
            std::string::npos)
      << m;
  m = error_of([] { resolve("", {"--optimizer", "sgd", "--fused-optimizer-groups", "-1"}); });
  EXPECT_EQ(m, "--fused-optimizer-groups: must be at least 0, got -1");
  // 0 switches groups off (a config's, from the command line).
  EXPECT_EQ(resolve("optimizer = \"sgd\"\nfused_optimizer_groups = 4\n",
                    {"--fused-optimizer-groups", "0", "--fused-backward-pass"})
                .mode(),
            "fused");
  m = error_of([] { resolve("", {"--optimizer", "sgd", "--full-bf16", "--dtype", "float64"}); });
  EXPECT_NE(m.find("--full-bf16: cannot be combined with --dtype float64"), std::string::npos);
  // Accumulation alone, and groups alone, are fine.
  EXPECT_EQ(resolve("", {"--optimizer", "sgd", "--gradient-accumulation-steps", "4"}).mode(),
            "normal");
  EXPECT_EQ(resolve("", {"--optimizer", "sgd", "--fused-optimizer-groups", "1"}).mode(), "groups");
}

TEST(TrainerConfig, RunsTablesOverrideTheTopLevel) {
  ConfigFile f = parse_config_text(
      "optimizer = \"sgd\"\nseed = 1\n[[runs]]\nname = \"a\"\n[[runs]]\nname = \"b\"\nseed = 2\n"
      "[runs.optimizer_args]\nmomentum = 0.5\n",
      "multi.toml");
  ASSERT_EQ(f.runs.size(), 2u);
  EXPECT_EQ(f.runs[0].name, "a");
  EXPECT_EQ(f.runs[1].name, "b");
  EXPECT_EQ(std::get<int64_t>(f.runs[1].layer.values.at("seed").value), 2);
  EXPECT_EQ(f.runs[1].layer.optimizer_args.count("momentum"), 1u);
  std::string m = error_of(
      [] { parse_config_text("[[runs]]\nname = \"a\"\n[[runs]]\nname = \"a\"\n", "multi.toml"); });
  EXPECT_NE(m.find("two runs are named 'a'"), std::string::npos) << m;
}

TEST(TrainerProgram, MissingConfigFileIsNamed) {
  auto r = run_trainer({"--config", "/no/such/run.toml"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err, "trainer: error: config file /no/such/run.toml does not exist\n");
}

TEST(TrainerProgram, HelpListsEveryOptionWithDefault) {
  auto r = run_trainer({"--help"});
  EXPECT_EQ(r.code, 0);
  for (const auto& s : option_specs()) {
    EXPECT_NE(r.out.find("--" + s.name), std::string::npos) << s.name;
  }
  EXPECT_NE(r.out.find("--max-train-steps N"), std::string::npos);
  EXPECT_NE(r.out.find("[default: 100]"), std::string::npos);
  EXPECT_NE(r.out.find("[default: constant]"), std::string::npos);
  const std::string version = run_trainer({"--version"}).out;
  EXPECT_NE(version.find("trainer (fusebox)"), std::string::npos);
  // What the build can do, as the library says it.
  EXPECT_NE(
      version.find(std::string("data parallel (Gloo) ") + (distributed_available() ? "yes" : "no") +
                   ", np.savez_compressed (zlib) " + (zlib_available() ? "yes" : "no")),
      std::string::npos)
      << version;
}

TEST(TrainerProgram, FusedNeedsStepParamCapability) {
  auto r = run_trainer(join(plugin_args("tp_no_step_param.so"), {"--fused-backward-pass"}));
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err,
            "trainer: error: tp_no_step_param.so does not support --fused-backward-pass: it does "
            "not declare supports_step_param\n");
  // By name, too; the groups mode works with it.
  r = run_trainer({"--plugin-dir", FUSEBOX_TEST_PLUGIN_DIR, "--optimizer", "lion_custom",
                   "--fused-backward-pass"});
  EXPECT_EQ(r.err,
            "trainer: error: tp_no_step_param.so does not support --fused-backward-pass: it does "
            "not declare supports_step_param\n");
}

TEST(TrainerProgram, GroupsRefuseAutoLrPlugins) {
  auto r = run_trainer(join(plugin_args("tp_auto_lr.so"), {"--fused-optimizer-groups", "2"}));
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err,
            "trainer: error: --fused-optimizer-groups cannot be used with fake_auto_lr: auto-LR "
            "optimizers (such as D-Adaptation and Prodigy) estimate one step size from all "
            "parameters\n");
}

TEST(TrainerProgram, HyperparametersAreValidatedAgainstTheSchema) {
  auto r = run_trainer(join(plugin_args("sgd.so"), {"--optimizer-args", "momentun=0.9"}));
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(count_lines(r.err), 1);
  EXPECT_NE(r.err.find("unknown hyperparameter 'momentun'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("did you mean 'momentum'"), std::string::npos) << r.err;
  r = run_trainer(join(plugin_args("sgd.so"), {"--learning-rate", "-1"}));
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_NE(r.err.find("--learning-rate"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("'lr'"), std::string::npos) << r.err;
  TempDir dir;
  const std::string cfg = dir.write("c.toml", "[optimizer_args]\nmomentum = \"fast\"\n");
  r = run_trainer(join(plugin_args("sgd.so"), {"--config", cfg}));
  EXPECT_NE(r.err.find(cfg + ":2:12"), std::string::npos) << r.err;
  r = run_trainer(join(plugin_args("sgd.so"), {"--optimizer-args", "nesterov=true", "momentum=0"}));
  EXPECT_NE(r.err.find("nesterov needs momentum > 0"), std::string::npos) << r.err;
}

TEST(TrainerProgram, ListAndDescribePlugins) {
  auto r = run_trainer({"--plugin-dir", FUSEBOX_PLUGIN_DIR, "--list-plugins"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("sgd"), std::string::npos);
  EXPECT_NE(r.out.find("supports_step_param"), std::string::npos);
  EXPECT_NE(r.out.find(std::string(FUSEBOX_PLUGIN_DIR) + "/sgd.so"), std::string::npos) << r.out;
  r = run_trainer({"--plugin-dir", FUSEBOX_TEST_PLUGIN_DIR, "--list-plugins"});
  EXPECT_NE(r.out.find("broken: "), std::string::npos) << r.out;  // e.g. tp_no_entry.so
  r = run_trainer({"--plugin-dir", FUSEBOX_PLUGIN_DIR, "--describe-plugin", "sgd"});
  EXPECT_EQ(r.code, 0) << r.err;
  for (const char* s :
       {"momentum", "nesterov", "double", "bool", "(0, inf)", "[0, 1)", "learning rate",
        "nesterov,momentum,dampening: nesterov=true needs momentum > 0 and "
        "dampening = 0"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  r = run_trainer({"--plugin-dir", FUSEBOX_PLUGIN_DIR, "--describe-plugin", "sgf"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
}

TEST(TrainerProgram, PrintConfigRoundTrips) {
  TempDir dir;
  auto first = run_trainer(
      join(plugin_args("sgd.so"), {"--print-config", "--learning-rate", "0.1", "--seed", "3",
                                   "--optimizer-args", "momentum=0.9", "nesterov=true", "--model",
                                   "transformer", "--output-dir", "out dir/\"q\""}));
  ASSERT_EQ(first.code, 0) << first.err;
  EXPECT_NE(first.out.find("momentum = 0.9\n"), std::string::npos) << first.out;  // typed
  EXPECT_NE(first.out.find("nesterov = true\n"), std::string::npos) << first.out;
  EXPECT_NE(first.out.find("learning_rate = 0.1\n"), std::string::npos) << first.out;
  const std::string path = dir.write("printed.toml", first.out);
  auto second = run_trainer({"--config", path, "--print-config"});
  ASSERT_EQ(second.code, 0) << second.err;
  EXPECT_EQ(first.out, second.out);

  // With [[runs]]: the command line folds into the top level, runs keep their own keys.
  const std::string multi = dir.write(
      "multi.toml", "optimizer_plugin = \"sgd.so\"\nplugin_dir = [\"" FUSEBOX_PLUGIN_DIR
                    "\"]\n"
                    "[[runs]]\nname = \"a\"\nseed = 5\n[[runs]]\nname = \"b\"\nmax_grad_norm = 1\n"
                    "[runs.optimizer_args]\nmomentum = 0.5\n");
  first = run_trainer({"--config", multi, "--print-config", "--seed", "8"});
  ASSERT_EQ(first.code, 0) << first.err;
  EXPECT_EQ(first.out.find("seed = 5"), std::string::npos) << first.out;
  EXPECT_NE(first.out.find("[runs.optimizer_args]\nmomentum = 0.5"), std::string::npos);
  const std::string path2 = dir.write("printed2.toml", first.out);
  second = run_trainer({"--config", path2, "--print-config"});
  ASSERT_EQ(second.code, 0) << second.err;
  EXPECT_EQ(first.out, second.out);

  // A run choosing its plugin by name, the command line by file: the printed config keeps the
  // command line's choice for that run too (as training would), not the run's.
  const std::string pick =
      dir.write("pick.toml", "optimizer_plugin = \"sgd.so\"\nplugin_dir = [\"" FUSEBOX_PLUGIN_DIR
                             "\"]\n[[runs]]\nname = \"x\"\noptimizer = \"adam\"\n");
  first = run_trainer({"--config", pick, "--print-config", "--optimizer-plugin", "lion.so"});
  ASSERT_EQ(first.code, 0) << first.err;
  EXPECT_EQ(first.out.find("adam"), std::string::npos) << first.out;
  EXPECT_NE(first.out.find("optimizer_plugin = \"lion.so\""), std::string::npos) << first.out;
}

}  // namespace
}  // namespace fusebox::trainer
