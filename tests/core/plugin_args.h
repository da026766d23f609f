// Hyperparameters for tests: ones that exercise more of an algorithm than its defaults do, and
// an lr for plugins that require one.
#pragma once

#include "fusebox/core/plugin_registry.h"

namespace fusebox::testing {

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
