#include "describe.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "options.h"

namespace fusebox::trainer {

namespace {

std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::ostringstream o;
  o << v;
  return o.str();
}

std::string range_text(const HyperParamSpec& s) {
  std::string r;
  if (s.type == ParamType::Enum) {
    for (const auto& c : s.choices) r += (r.empty() ? "" : "|") + c;
  } else if (s.type == ParamType::Int || s.type == ParamType::Double ||
             s.type == ParamType::DoublePair) {
    if (std::isinf(s.lo) && std::isinf(s.hi))
      r = "any";
    else
      r = std::string(s.lo_open ? "(" : "[") + number(s.lo) + ", " + number(s.hi) +
          (s.hi_open ? ")" : "]");
    if (s.type == ParamType::DoublePair) r += " each";
  } else {
    r = "-";
  }
  if (s.nullable) r += " or none";
  return r;
}

// A default as users would write it, with the shortest exact form of each number.
std::string value_text(const Value& v) {
  if (auto* d = std::get_if<double>(&v)) return format_real(*d);
  if (auto* p = std::get_if<std::pair<double, double>>(&v))
    return "(" + format_real(p->first) + ", " + format_real(p->second) + ")";
  return format_value(v);
}

}  // namespace

std::string list_plugins_text(PluginRegistry& registry) {
  std::vector<BrokenPlugin> broken;
  auto plugins = registry.list(&broken);
  std::ostringstream o;
  std::string dirs;
  for (const auto& d : registry.search_path()) dirs += (dirs.empty() ? "" : ", ") + d.string();
  o << "plugin search path: " << (dirs.empty() ? "(empty)" : dirs) << "\n";
  if (plugins.empty()) {
    o << "no plugins found\n";
  } else {
    std::vector<std::vector<std::string>> rows = {{"NAME", "VERSION", "CAPABILITIES", "PATH"}};
    for (const auto& p : plugins)
      rows.push_back({p->info().name, p->info().version, p->info().capability_names(),
                      p->info().path.string()});
    o << table(rows, "");
  }
  for (const auto& b : broken) o << "broken: " << b.path.string() << ": " << b.error << "\n";
  return o.str();
}

std::string describe_plugin_text(const LoadedPlugin& plugin) {
  const PluginInfo& i = plugin.info();
  std::ostringstream o;
  o << i.name << " " << i.version << ": " << i.description << "\n"
    << "file: " << i.path.string() << "\n"
    << "capabilities: " << i.capability_names() << "\n"
    << "built against LibTorch " << i.torch_version << ", plugin API " << i.api_major << "."
    << i.api_minor << "\n\n";
  const Schema& s = plugin.schema();
  if (s.specs().empty()) {
    o << "no hyperparameters\n";
  } else {
    o << "hyperparameters (--optimizer-args key=value, or an [optimizer_args] table):\n";
    std::vector<std::vector<std::string>> rows = {{"KEY", "TYPE", "DEFAULT", "RANGE", "HELP"}};
    for (const auto& spec : s.specs())
      rows.push_back({spec.name, type_name(spec.type), value_text(spec.default_value),
                      range_text(spec), spec.help});
    o << table(rows, "  ");
  }
  if (!s.rules().empty()) {
    o << "\nrules (checked together after each value is valid):\n";
    for (const auto& r : s.rules())
      o << "  " << (r.help.empty() ? "a constraint over: " + r.keys : r.keys + ": " + r.help)
        << "\n";
  }
  return o.str();
}

std::string table(const std::vector<std::vector<std::string>>& rows, const std::string& indent) {
  std::vector<size_t> w(rows.front().size(), 0);
  for (const auto& row : rows)
    for (size_t i = 0; i < row.size(); ++i) w[i] = std::max(w[i], row[i].size());
  std::string out;
  for (const auto& row : rows) {
    std::string line = indent;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line += std::string(w[i] - row[i].size() + 2, ' ');
    }
    out += line + "\n";
  }
  return out;
}

}  // namespace fusebox::trainer
