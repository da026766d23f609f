// Reading trainer configs from TOML and writing resolved configs back as TOML.
//
// A config file holds option keys at the top level (snake_case names of the command-line
// options), an optional [optimizer_args] table, and optionally an array of [[runs]] tables: each
// run has a `name` and overrides any top-level key (and [runs.optimizer_args] keys).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "options.h"

namespace fusebox::trainer {

/// One [[runs]] entry: its name and the keys it overrides.
struct RunEntry {
  std::string name;
  Layer layer;
  std::string where;  ///< "file:line:column" of the table
};

/// A parsed config file.
struct ConfigFile {
  Layer base;
  std::vector<RunEntry> runs;
};

/// Reads and checks `path`; throws Error "file:line:column: ..." (or naming a missing file).
ConfigFile read_config_file(const std::string& path);
/// Parses TOML text; `source` names it in messages.
ConfigFile parse_config_text(const std::string& text, const std::string& source);

/// Renders `base` (and `runs`) as a config that read_config_file accepts.
std::string write_config(const Layer& base, const std::vector<RunEntry>& runs);

/// The settings of a config write_config rendered without runs, "table.key" (top level: "key")
/// -> the value's text; comments (unset keys) are left out.
std::map<std::string, std::string> written_settings(const std::string& toml);

}  // namespace fusebox::trainer
