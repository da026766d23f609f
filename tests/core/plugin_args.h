// Plugins for tests: loader options that search only given folders, and hyperparameters that
// exercise more of an algorithm than its defaults do (an lr for plugins that require one).
#pragma once

#include <filesystem>
#include <utility>
#include <vector>

#include "fusebox/core/plugin_registry.h"

namespace fusebox::testing {

/// Loader options that search `dirs` alone (no FUSEBOX_PLUGIN_PATH, no default folder).
inline LoaderOptions only(std::vector<std::filesystem::path> dirs) {
  LoaderOptions o;
  o.plugin_dirs = std::move(dirs);
  o.use_environment = false;
  o.use_default_dir = false;
  return o;
}

inline UserArgs args_for(const LoadedPlugin& p) {
  UserArgs a;
  auto set = [&](const std::string& k, const std::string& v) {
    if (p.schema().find(k)) a[k] = UserArg{std::monostate{}, v, "test"};
  };
  const std::string& name = p.info().name;
  if (name == "sgd") set("momentum", "0.9"), set("weight_decay", "0.01");
  if (name == "adafactor") set("beta1", "0.9");
  if (name == "came" || name == "lion") set("lr", "0.001");
  return a;
}

}  // namespace fusebox::testing
