// --list-plugins and --describe-plugin output.
#pragma once

#include <string>
#include <vector>

#include "fusebox/core/plugin_registry.h"

namespace fusebox::trainer {

/// One line per loadable plugin (name, version, capabilities, path), then the broken files.
std::string list_plugins_text(PluginRegistry& registry);

/// Rows as aligned columns (two spaces apart), each line starting with `indent`.
std::string table(const std::vector<std::vector<std::string>>& rows, const std::string& indent);

/// A plugin's description and its schema: each key's type, default, range and help, and rules.
std::string describe_plugin_text(const LoadedPlugin& plugin);

}  // namespace fusebox::trainer
