// The trainer's options: one table that drives the command line, TOML keys, --help and
// --print-config, and a layered key/value store that remembers where each value came from.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "fusebox/core/hyperparam_validation.h"

namespace fusebox::trainer {

/// What kind of value an option holds.
enum class Kind {
  Flag,       ///< bool; `--x` means true, `--x=false` false
  Int,        ///< int64
  Real,       ///< double
  Text,       ///< free string
  Choice,     ///< string from a fixed list
  TextList,   ///< repeatable string
  Action,     ///< command-line only, takes no value (--help, --list-plugins, ...)
  ActionArg,  ///< command-line only, takes one value (--config, --describe-plugin, --run)
};

/// A value of an option.
using OptValue = std::variant<bool, int64_t, double, std::string, std::vector<std::string>>;

/// One option: `--kebab-name` on the command line, `snake_name` in TOML.
struct OptionSpec {
  std::string name;  ///< kebab-case
  Kind kind = Kind::Text;
  std::optional<OptValue> def;                            ///< default; empty: unset unless given
  std::string help;                                       ///< one line
  std::string section;                                    ///< heading in --help and --print-config
  std::vector<std::string> choices;                       ///< for Choice
  double min = -std::numeric_limits<double>::infinity();  ///< smallest allowed number
  bool min_open = false;                                  ///< true: must be greater than min
  double max = std::numeric_limits<double>::infinity();   ///< largest allowed number
  /// The default is worked out per machine and job (thread counts): a printed config shows it as
  /// a comment, so feeding the file back does not pin it.
  bool derived_default = false;
  std::string metavar;  ///< value placeholder in --help
};

/// True when `s` is well-formed UTF-8 (no overlongs, surrogates or code points past U+10FFFF).
bool valid_utf8(const std::string& s);

/// The option table, in display order.
const std::vector<OptionSpec>& option_specs();
/// The spec of `name` (kebab-case), or nullptr.
const OptionSpec* find_option(const std::string& name);
/// kebab-case -> snake_case.
std::string snake(const std::string& kebab);
/// snake_case -> kebab-case.
std::string kebab(const std::string& snake_name);
/// True for options that may appear in a config file.
bool is_config_key(const OptionSpec& spec);

/// A value plus its origin: "--seed", "run.toml:4:1" or "" (default).
struct Setting {
  OptValue value;
  std::string where;
};

/// One layer of settings (defaults, config file, a [[runs]] entry, command line).
struct Layer {
  std::map<std::string, Setting> values;  ///< by kebab name
  UserArgs optimizer_args;                ///< [optimizer_args] / --optimizer-args
  /// Puts `other` on top of this layer (lists are replaced, optimizer args merged per key).
  void overlay(const Layer& other);
  /// Removes what `upper` sets, counting a setting given the other way (--optimizer for
  /// --optimizer-plugin, --learning-rate for the optimizer argument lr) as the same setting.
  void remove_overridden(const Layer& upper);
};

/// The default value of every option that has one.
Layer default_layer();

/// "--seed" for command-line/default values, "run.toml:4:1: seed" for config values.
std::string origin_label(const std::string& name, const std::string& where);

/// Checks a value against the spec (choices, minimum); throws Error naming the origin.
void check_value(const OptionSpec& spec, const Setting& s);

/// Parses command-line text into a value of the spec's kind; throws Error naming the option.
OptValue parse_cli_value(const OptionSpec& spec, const std::string& text);

/// Renders a double so that it reads back identically and still looks like a float.
std::string format_real(double v);

/// What the command line asked for.
struct CommandLine {
  Layer layer;  ///< option values
  bool help = false, version = false, list_plugins = false, print_config = false;
  bool list_params = false, check_data = false;
  std::optional<std::string> config;  ///< --config FILE
  std::optional<std::string> describe_plugin;
  std::vector<std::string> runs;  ///< --run NAME (repeatable): only these runs
};

/// Parses argv[1..]; throws Error (one line) on unknown options and bad values.
CommandLine parse_command_line(const std::vector<std::string>& args);

/// The --help text: every option with its default.
std::string help_text();

}  // namespace fusebox::trainer
