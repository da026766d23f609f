// libFuzzer target: any text given as a trainer config must give a fusebox::Error or a resolved
// config, never a crash; optimizer arguments that parse are validated against a real plugin
// schema (Adafactor's, the richest one: pairs, none, cross-field rules).
#include <cstdint>
#include <string>

#include "config.h"
#include "fusebox/core/hyperparam_validation.h"
#include "fusebox/core/plugin_registry.h"
#include "toml_io.h"

namespace {
const fusebox::Schema& schema() {
  static fusebox::PluginRegistry* registry = [] {
    fusebox::LoaderOptions o;
    o.plugin_dirs = {FUSEBOX_PLUGIN_DIR};
    o.use_environment = o.use_default_dir = false;
    return new fusebox::PluginRegistry(o);
  }();
  static std::shared_ptr<fusebox::LoadedPlugin> plugin = registry->load_file("adafactor_fused.so");
  return plugin->schema();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fusebox::trainer;
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    ConfigFile file = parse_config_text(text, "fuzz.toml");
    write_config(file.base, file.runs);
    Layer merged = default_layer();
    merged.overlay(file.base);
    resolve_config(merged, "");
    fusebox::validate_hyperparams(schema(), "adafactor", merged.optimizer_args);
  } catch (const fusebox::Error&) {
  }
  // The same bytes as key=value command-line arguments.
  fusebox::UserArgs args;
  const size_t eq = text.find('=');
  if (eq != std::string::npos)
    args[text.substr(0, eq)] = fusebox::UserArg{std::monostate{}, text.substr(eq + 1), "fuzz"};
  try {
    fusebox::validate_hyperparams(schema(), "adafactor", args);
  } catch (const fusebox::Error&) {
  }
  return 0;
}
