// Every plugin in the plugin folder passes the conformance kit.
#include <gtest/gtest.h>

#include <fusebox/testing/conformance.h>

namespace {

// Required hyperparameters, and values that exercise more of an algorithm than its defaults.
std::vector<std::string> args_for(const std::string& file) {
  if (file == "came") return {"lr=1e-3"};
  if (file == "sgd") return {"momentum=0.9", "weight_decay=0.01"};
  if (file == "adafactor_fused") return {"beta1=0.9"};
  if (file == "adamw") return {"amsgrad=true"};
  return {};
}

std::vector<fusebox::conformance::Target> every_plugin() {
  return fusebox::conformance::plugins_in(FUSEBOX_PLUGIN_DIR, args_for);
}

}  // namespace

FUSEBOX_CONFORMANCE_TESTS_FOR(BuiltinPlugins, every_plugin());

// The folder really holds the plugins, and every file in it loads: a file the registry refuses
// would otherwise drop out of the suite above unnoticed.
TEST(BuiltinPluginFolder, EveryFileLoads) {
  auto targets = every_plugin();
  ASSERT_FALSE(targets.empty()) << "no plugins in " << FUSEBOX_PLUGIN_DIR;
  bool has_sgd = false;
  for (const auto& t : targets) {
    EXPECT_NO_THROW(fusebox::conformance::load(t)) << t.path;
    has_sgd = has_sgd || std::filesystem::path(t.path).filename() == "sgd.so";
  }
  EXPECT_TRUE(has_sgd);
}
