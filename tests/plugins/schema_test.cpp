// Each plugin's hyperparameter schema: names, capabilities, defaults that validate, and invalid
// values rejected by the core's validation with one line naming the plugin and the key.
#include "plugin_test_support.h"

namespace {

struct Expected {
  const char* file;
  const char* name;
  uint64_t capabilities;
};

TEST(Schema, PluginsLoadWithTheirNamesAndCapabilities) {
  const Expected all[] = {{"sgd.so", "sgd", fusebox::kSupportsStepParam},
                          {"adafactor_fused.so", "adafactor", fusebox::kSupportsStepParam},
                          {"adam.so", "adam", fusebox::kSupportsStepParam},
                          {"adamw.so", "adamw", fusebox::kSupportsStepParam},
                          {"lion.so", "lion", fusebox::kSupportsStepParam},
                          {"came.so", "came", fusebox::kSupportsStepParam},
                          {"dadaptation.so", "dadaptation", fusebox::kAutoLr},
                          {"prodigy.so", "prodigy", fusebox::kAutoLr}};
  for (const auto& e : all) {
    auto p = fbt::plugin(e.file);
    EXPECT_EQ(p->info().name, e.name);
    EXPECT_EQ(p->info().capabilities, e.capabilities) << e.file;
    for (const auto& spec : p->schema().specs()) EXPECT_FALSE(spec.help.empty()) << spec.name;
    if (std::string(e.file) != "came.so") {
      EXPECT_NO_THROW(p->validate({})) << e.file;
    }
  }
}

struct Invalid {
  const char* file;
  fbt::Args args;
  const char* key;  // named in the message
};

TEST(Schema, RejectsInvalidValuesWithOneLine) {
  const Invalid cases[] = {
      // Adafactor: ranges and its three cross-field rules.
      {"adafactor_fused.so", {{"clip_threshold", "0"}}, "clip_threshold"},
      {"adafactor_fused.so", {{"beta1", "1.0"}}, "beta1"},
      {"adafactor_fused.so", {{"decay_rate", "0.5"}}, "decay_rate"},
      {"adafactor_fused.so", {{"eps", "(-1,1e-3)"}}, "eps"},
      {"adafactor_fused.so", {{"eps", "(0,1e-3)"}}, "eps1"},  // NaN at a zero gradient row
      {"adafactor_fused.so", {{"lr", "0.01"}}, "relative_step"},
      {"adafactor_fused.so", {{"relative_step", "false"}}, "relative_step"},
      {"adafactor_fused.so",
       {{"lr", "0.01"}, {"relative_step", "false"}, {"warmup_init", "true"}},
       "warmup_init"},
      {"adafactor_fused.so", {{"scale_parameter", "maybe"}}, "scale_parameter"},
      // Adam / AdamW.
      {"adam.so", {{"betas", "(0.9,1.0)"}}, "betas"},
      {"adam.so", {{"lr", "-1"}}, "lr"},
      {"adam.so", {{"weight_decay", "-0.1"}}, "weight_decay"},
      {"adamw.so", {{"betas", "(-0.1,0.999)"}}, "betas"},
      {"adamw.so", {{"eps", "-1e-8"}}, "eps"},
      {"adamw.so", {{"amsgard", "true"}}, "amsgard"},
      // Lion.
      {"lion.so", {{"betas", "(1,0.99)"}}, "betas"},
      {"lion.so", {{"lr", "0"}}, "lr"},
      // CAME.
      {"came.so", {}, "lr"},
      {"came.so", {{"lr", "0.01"}, {"beta3", "1"}}, "beta3"},
      {"came.so", {{"lr", "0.01"}, {"clip_threshold", "-1"}}, "clip_threshold"},
      {"came.so", {{"lr", "0.01"}, {"eps", "(0,1e-16)"}}, "eps"},
      {"came.so", {{"lr", "0.01"}, {"eps", "(1e-30,0)"}}, "eps"},
      // SGD.
      {"sgd.so", {{"nesterov", "true"}}, "nesterov"},
      {"sgd.so", {{"momentum", "1"}}, "momentum"},
      {"sgd.so", {{"stochastic_rounding", "2"}}, "stochastic_rounding"},
      // D-Adaptation.
      {"dadaptation.so", {{"d0", "0"}}, "d0"},
      {"dadaptation.so", {{"growth_rate", "0.5"}}, "growth_rate"},
      {"dadaptation.so", {{"betas", "(0.9,1.5)"}}, "betas"},
      // Prodigy.
      {"prodigy.so", {{"slice_p", "0"}}, "slice_p"},
      {"prodigy.so", {{"slice_p", "1.5"}}, "slice_p"},
      {"prodigy.so", {{"d_coef", "0"}}, "d_coef"},
      {"prodigy.so", {{"beta3", "1"}}, "beta3"},
  };
  for (const auto& c : cases) {
    auto p = fbt::plugin(c.file);
    SCOPED_TRACE(fbt::label(c.file, c.args));
    std::string msg;
    try {
      p->validate(fbt::user_args(c.args));
      ADD_FAILURE() << "accepted";
      continue;
    } catch (const fusebox::Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find(p->info().name), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.key), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST(Schema, AcceptsTheValidNeighboursOfTheRules) {
  const std::pair<const char*, fbt::Args> ok[] = {
      {"adafactor_fused.so", {{"lr", "0.01"}, {"relative_step", "false"}}},
      {"adafactor_fused.so", {{"warmup_init", "true"}}},
      {"adafactor_fused.so", {{"beta1", "0"}, {"eps", "(1e-30,0)"}}},
      {"came.so", {{"lr", "1e-4"}}},
      {"sgd.so", {{"nesterov", "true"}, {"momentum", "0.9"}}},
      {"prodigy.so", {{"slice_p", "11"}, {"beta3", "none"}}},
      {"dadaptation.so", {{"growth_rate", "1"}}},
  };
  for (const auto& [file, args] : ok)
    EXPECT_NO_THROW(fbt::plugin(file)->validate(fbt::user_args(args))) << fbt::label(file, args);
}

}  // namespace
