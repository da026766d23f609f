// Checking user-supplied hyperparameters against a plugin's schema.
#pragma once

#include <map>
#include <string>

#include "fusebox/hyperparams.h"

namespace fusebox {

/// One user-supplied hyperparameter: text from the command line, or a typed value from TOML.
struct UserArg {
  Value value;        ///< typed value (TOML); monostate when `text` is to be parsed
  std::string text;   ///< raw text ("0.9", "(0.9,0.999)", "none", "true") when from the CLI
  std::string where;  ///< origin for messages: "--optimizer-args" or "run.toml:12:3"
};
using UserArgs = std::map<std::string, UserArg>;

/// Validates `args` against `schema` and fills in defaults. Throws Error with one line naming
/// `plugin` and the key: unknown key (with a suggestion), wrong type, out of range, broken rule.
HyperParams validate_hyperparams(const Schema& schema, const std::string& plugin,
                                 const UserArgs& args);

/// Parses command-line text into a value of the spec's type; throws Error on failure.
Value parse_value(const HyperParamSpec& spec, const std::string& text);

/// Parses a decimal number ("1e-3", "inf", "nan"; no hex, no leading space). A magnitude too
/// large for a double gives +-inf, a too small one the nearest double. False if not a number.
bool parse_real(const std::string& text, double& out);

/// Parses a decimal integer; false if it is not one or does not fit in 64 bits.
bool parse_integer(const std::string& text, int64_t& out);

/// Renders a value as it would be written on the command line / in TOML.
std::string format_value(const Value& v);

/// Name of a ParamType ("double", "pair of doubles", ...).
std::string type_name(ParamType t);

}  // namespace fusebox
