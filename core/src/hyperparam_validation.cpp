#include "fusebox/core/hyperparam_validation.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "fusebox/core/messages.h"
#include "fusebox/core/suggest.h"

namespace fusebox {

bool parse_real(const std::string& t, double& out) {
  // Decimal only, as in TOML (strtod would also take "0x1p3"); too large a magnitude is +-inf, for
  // the range check to refuse by value, and too small a one is the nearest double (0 or subnormal).
  if (t.empty() || std::isspace(static_cast<unsigned char>(t.front())) ||
      t.find_first_of("xX") != std::string::npos)
    return false;
  char* end = nullptr;
  errno = 0;
  out = std::strtod(t.c_str(), &end);
  return end == t.c_str() + t.size();
}

bool parse_integer(const std::string& t, int64_t& out) {
  if (t.empty() || std::isspace(static_cast<unsigned char>(t.front()))) return false;
  char* end = nullptr;
  errno = 0;
  out = std::strtoll(t.c_str(), &end, 10);
  return end == t.c_str() + t.size() && errno != ERANGE;
}

namespace {

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

bool parse_double(const std::string& text, double& out) { return parse_real(trim(text), out); }

bool parse_int(const std::string& text, int64_t& out) { return parse_integer(trim(text), out); }

bool is_none_text(const std::string& t) {
  std::string s = trim(t);
  return s == "none" || s == "None" || s == "null";
}

std::string range_text(const HyperParamSpec& s) {
  std::ostringstream o;
  o << (s.lo_open ? "(" : "[") << s.lo << ", " << s.hi << (s.hi_open ? ")" : "]");
  return o.str();
}

bool in_range(const HyperParamSpec& s, double v) {
  if (std::isnan(v)) return false;
  if (s.lo_open ? !(v > s.lo) : !(v >= s.lo)) return false;
  if (s.hi_open ? !(v < s.hi) : !(v <= s.hi)) return false;
  return true;
}

// Brings a typed value to the spec's type (ints widen to doubles); empty on mismatch.
bool coerce(const HyperParamSpec& spec, const Value& in, Value& out) {
  if (std::holds_alternative<std::monostate>(in)) {
    out = in;
    return spec.nullable;
  }
  switch (spec.type) {
    case ParamType::Bool:
      if (!std::holds_alternative<bool>(in)) return false;
      out = in;
      return true;
    case ParamType::Int:
      if (!std::holds_alternative<int64_t>(in)) return false;
      out = in;
      return true;
    case ParamType::Double:
      if (auto* i = std::get_if<int64_t>(&in)) return out = static_cast<double>(*i), true;
      if (!std::holds_alternative<double>(in)) return false;
      out = in;
      return true;
    case ParamType::DoublePair:
      if (!std::holds_alternative<std::pair<double, double>>(in)) return false;
      out = in;
      return true;
    case ParamType::String:
    case ParamType::Enum:
      if (!std::holds_alternative<std::string>(in)) return false;
      out = in;
      return true;
  }
  return false;
}

}  // namespace

std::string type_name(ParamType t) {
  switch (t) {
    case ParamType::Bool:
      return "bool";
    case ParamType::Int:
      return "integer";
    case ParamType::Double:
      return "double";
    case ParamType::DoublePair:
      return "pair of doubles";
    case ParamType::String:
      return "string";
    case ParamType::Enum:
      return "enum";
  }
  return "?";
}

// The shortest decimal that reads back as exactly `d` (1e-30, not 1.0000000000000001e-30).
static std::string shortest(double d) {
  for (int digits = 1; digits <= 17; ++digits) {
    std::ostringstream o;
    o.precision(digits);
    o << d;
    if (std::strtod(o.str().c_str(), nullptr) == d) return o.str();
  }
  std::ostringstream o;
  o.precision(17);
  o << d;
  return o.str();
}

std::string format_value(const Value& v) {
  if (std::holds_alternative<std::monostate>(v)) return "none";
  if (auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (auto* d = std::get_if<double>(&v)) return shortest(*d);
  if (auto* p = std::get_if<std::pair<double, double>>(&v))
    return "(" + shortest(p->first) + ", " + shortest(p->second) + ")";
  return std::get<std::string>(v);
}

Value parse_value(const HyperParamSpec& spec, const std::string& text) {
  const std::string t = trim(text);
  auto bad = [&](const std::string& expected) { return Error("'" + t + "' is not " + expected); };
  if (is_none_text(t)) {
    if (!spec.nullable) throw Error("none is not allowed");
    return std::monostate{};
  }
  switch (spec.type) {
    case ParamType::Bool:
      if (t == "true" || t == "True" || t == "1") return true;
      if (t == "false" || t == "False" || t == "0") return false;
      throw bad("a bool (true/false)");
    case ParamType::Int: {
      int64_t i;
      if (!parse_int(t, i)) throw bad("an integer");
      return i;
    }
    case ParamType::Double: {
      double d;
      if (!parse_double(t, d)) throw bad("a number");
      return d;
    }
    case ParamType::DoublePair: {
      std::string inner = t;
      if (inner.size() >= 2 && ((inner.front() == '(' && inner.back() == ')') ||
                                (inner.front() == '[' && inner.back() == ']')))
        inner = inner.substr(1, inner.size() - 2);
      size_t comma = inner.find(',');
      double a, b;
      if (comma == std::string::npos || !parse_double(inner.substr(0, comma), a) ||
          !parse_double(inner.substr(comma + 1), b))
        throw bad("a pair of numbers like (0.9,0.999)");
      return std::make_pair(a, b);
    }
    case ParamType::String:
    case ParamType::Enum:
      return t;
  }
  throw bad("valid");
}

HyperParams validate_hyperparams(const Schema& schema, const std::string& plugin,
                                 const UserArgs& args) {
  std::vector<std::string> keys;
  for (const auto& s : schema.specs()) keys.push_back(s.name);
  HyperParams out;
  for (const auto& s : schema.specs()) out.set(s.name, s.default_value);

  for (const auto& [key, arg] : args) {
    const std::string where = arg.where.empty() ? "" : arg.where + ": ";
    const HyperParamSpec* spec = schema.find(key);
    if (!spec)
      throw Error(where + plugin + ": unknown hyperparameter '" + key + "'" +
                  did_you_mean(key, keys) + "; see trainer --describe-plugin " + plugin);
    const std::string prefix = where + plugin + ": hyperparameter '" + key + "': ";
    Value v;
    if (std::holds_alternative<std::monostate>(arg.value) && !arg.text.empty()) {
      try {
        v = parse_value(*spec, arg.text);
      } catch (const Error& e) {
        throw Error(prefix + e.what() + " (expected " + type_name(spec->type) + ")");
      }
    } else if (!coerce(*spec, arg.value, v)) {
      std::string got = format_value(arg.value);
      if (const double* d = std::get_if<double>(&arg.value))
        if (spec->type == ParamType::Int && std::isfinite(*d) && *d == std::floor(*d))
          // TOML's 2.0: say it is a float; "2" alone would look like an integer.
          got += std::string(got.find_first_of(".e") == std::string::npos ? ".0" : "") +
                 ", a float" +
                 (std::fabs(*d) < 1e15 ? " (write it without the decimal point)" : "");
      throw Error(prefix + "expected " + type_name(spec->type) +
                  (spec->nullable ? " or none" : "") + ", got " + got);
    }
    if (auto* d = std::get_if<double>(&v)) {
      if (!in_range(*spec, *d))
        throw Error(prefix + format_value(v) + " is outside " + range_text(*spec));
    } else if (auto* i = std::get_if<int64_t>(&v)) {
      if (!in_range(*spec, static_cast<double>(*i)))
        throw Error(prefix + format_value(v) + " is outside " + range_text(*spec));
    } else if (auto* p = std::get_if<std::pair<double, double>>(&v)) {
      if (!in_range(*spec, p->first) || !in_range(*spec, p->second))
        throw Error(prefix + format_value(v) + ": each value must be in " + range_text(*spec));
    } else if (auto* str = std::get_if<std::string>(&v); str && spec->type == ParamType::Enum) {
      bool ok = false;
      for (const auto& c : spec->choices) ok = ok || c == *str;
      if (!ok) {
        std::string list;
        for (const auto& c : spec->choices) list += (list.empty() ? "" : ", ") + c;
        throw Error(prefix + "'" + *str + "' is not one of " + list +
                    did_you_mean(*str, spec->choices));
      }
    }
    out.set(key, v);
  }
  for (const auto& rule : schema.rules()) {
    std::string problem;
    try {
      problem = rule.check(out);
    } catch (const std::exception& e) {
      // A rule reports a problem by returning it; one that throws is a bug in the plugin.
      throw Error(plugin + ": the plugin's rule over (" + rule.keys +
                  ") threw instead of returning a message: " + first_line(e.what()) +
                  " (a bug in the plugin; report it to its author)");
    } catch (...) {
      throw Error(plugin + ": the plugin's rule over (" + rule.keys +
                  ") threw something that is not a std::exception (a bug in the plugin; report "
                  "it to its author)");
    }
    if (!problem.empty())
      throw Error(plugin + ": invalid hyperparameters (" + rule.keys + "): " + problem);
  }
  return out;
}

}  // namespace fusebox
