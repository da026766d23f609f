#include "toml_io.h"

#include <toml++/toml.h>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include "config.h"
#include "fusebox/core/suggest.h"
#include "fusebox/error.h"

namespace fusebox::trainer {

namespace {

std::string where_of(const toml::node& n, const std::string& source) {
  const auto& b = n.source().begin;
  return source + ":" + std::to_string(b.line) + ":" + std::to_string(b.column);
}

std::string toml_type(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a float";
    case toml::node_type::boolean:
      return "a boolean";
    default:
      return "a date/time";
  }
}

std::vector<std::string> config_keys(bool in_run) {
  std::vector<std::string> keys;
  for (const auto& s : option_specs())
    if (is_config_key(s)) keys.push_back(snake(s.name));
  keys.push_back("optimizer_args");
  keys.push_back(in_run ? "name" : "runs");
  return keys;
}

OptValue read_value(const OptionSpec& spec, const toml::node& n, const std::string& label) {
  auto wrong = [&](const std::string& expected) {
    return Error(label + ": expected " + expected + ", got " + toml_type(n));
  };
  switch (spec.kind) {
    case Kind::Flag:
      if (auto v = n.value_exact<bool>()) return *v;
      throw wrong("true or false");
    case Kind::Int:
      if (auto v = n.value_exact<int64_t>()) return *v;
      throw wrong("an integer");
    case Kind::Real:
      if (auto v = n.value_exact<double>()) return *v;
      if (auto v = n.value_exact<int64_t>()) return static_cast<double>(*v);
      throw wrong("a number");
    case Kind::TextList: {
      std::vector<std::string> out;
      if (auto v = n.value_exact<std::string>()) return std::vector<std::string>{*v};
      const toml::array* arr = n.as_array();
      if (!arr) throw wrong("an array of strings");
      for (const auto& e : *arr) {
        auto v = e.value_exact<std::string>();
        if (!v) throw wrong("an array of strings");
        out.push_back(*v);
      }
      return out;
    }
    default:
      if (auto v = n.value_exact<std::string>()) return *v;
      throw wrong("a string");
  }
}

UserArgs read_optimizer_args(const toml::node& n, const std::string& source,
                             const std::string& table_name) {
  const toml::table* t = n.as_table();
  if (!t)
    throw Error(where_of(n, source) + ": " + table_name + ": expected a table, got " +
                toml_type(n));
  UserArgs out;
  for (const auto& [key, value] : *t) {
    const std::string k(key.str());
    const std::string where = where_of(value, source);
    UserArg a;
    a.where = where;
    if (auto v = value.value_exact<bool>())
      a.value = *v;
    else if (auto i = value.value_exact<int64_t>())
      a.value = *i;
    else if (auto d = value.value_exact<double>())
      a.value = *d;
    else if (auto s = value.value_exact<std::string>()) {
      a.text = *s;  // parsed by the schema's type: enums, strings, "none", "(0.9, 0.99)"
      if (a.text.empty()) a.value = std::string();
    } else if (const toml::array* arr = value.as_array()) {
      if (arr->size() != 2 || !(*arr)[0].is_number() || !(*arr)[1].is_number())
        throw Error(where + ": " + table_name + "." + k + ": an array must hold two numbers");
      auto num = [](const toml::node& e) {
        if (auto i = e.value_exact<int64_t>()) return static_cast<double>(*i);
        return *e.value_exact<double>();
      };
      a.value = std::make_pair(num((*arr)[0]), num((*arr)[1]));
    } else {
      throw Error(where + ": " + table_name + "." + k + ": unsupported value (" + toml_type(value) +
                  ")");
    }
    out[k] = a;
  }
  return out;
}

Layer read_layer(const toml::table& t, const std::string& source, bool in_run,
                 const std::string& prefix) {
  Layer layer;
  const std::vector<std::string> keys = config_keys(in_run);
  for (const auto& [key, value] : t) {
    const std::string k(key.str());
    const std::string where = where_of(value, source);
    if (k == "optimizer_args") {
      layer.optimizer_args = read_optimizer_args(value, source, prefix + "optimizer_args");
      continue;
    }
    if (k == "runs" && !in_run) continue;
    if (k == "name" && in_run) continue;
    const OptionSpec* spec = k.find('-') == std::string::npos ? find_option(kebab(k)) : nullptr;
    if (!spec || !is_config_key(*spec)) {
      std::string hint = did_you_mean(k, keys);
      if (hint.empty() && spec) hint = " (it is a command-line action)";
      throw Error(where + ": unknown key '" + prefix + k + "'" + hint);
    }
    Setting s{read_value(*spec, value, where + ": " + prefix + k), where};
    check_value(*spec, s);
    layer.values[spec->name] = s;
  }
  return layer;
}

std::string quote(const std::string& s) {
  // TOML files are UTF-8 (the command line is checked when parsed; this guards the rest).
  if (!valid_utf8(s))
    throw Error("'" + s + "' is not valid UTF-8 and cannot be written to a TOML config");
  std::string o = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        o += "\\\"";
        break;
      case '\\':
        o += "\\\\";
        break;
      case '\n':
        o += "\\n";
        break;
      case '\t':
        o += "\\t";
        break;
      case '\r':
        o += "\\r";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          o += buf;
        } else {
          o += static_cast<char>(c);
        }
    }
  }
  return o + "\"";
}

std::string toml_value(const OptValue& v) {
  if (auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (auto* d = std::get_if<double>(&v)) return format_real(*d);
  if (auto* s = std::get_if<std::string>(&v)) return quote(*s);
  std::string o = "[";
  for (const auto& s : std::get<std::vector<std::string>>(v))
    o += (o.size() > 1 ? ", " : "") + quote(s);
  return o + "]";
}

std::string toml_arg(const UserArg& a) {
  const Value& v = a.value;
  if (std::holds_alternative<std::monostate>(v)) return quote(a.text);
  if (auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (auto* d = std::get_if<double>(&v)) return format_real(*d);
  if (auto* p = std::get_if<std::pair<double, double>>(&v))
    return "[" + format_real(p->first) + ", " + format_real(p->second) + "]";
  return quote(std::get<std::string>(v));
}

void write_keys(std::ostringstream& o, const Layer& layer, bool comments) {
  std::string section;
  for (const auto& s : option_specs()) {
    if (!is_config_key(s)) continue;
    auto it = layer.values.find(s.name);
    if (comments && s.section != section) {
      section = s.section;
      o << "\n# " << section << "\n";
    }
    if (it != layer.values.end() && s.derived_default && it->second.where.empty())
      o << "# " << snake(s.name) << " = " << toml_value(it->second.value)
        << "  (default worked out per machine and job; uncomment to fix it)\n";
    else if (it != layer.values.end())
      o << snake(s.name) << " = " << toml_value(it->second.value) << "\n";
    else if (comments)
      o << "# " << snake(s.name) << " is unset\n";
  }
}

bool is_bare_key(const std::string& k) {
  if (k.empty()) return false;
  for (char c : k)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  return true;
}

void write_args(std::ostringstream& o, const UserArgs& args, const std::string& header) {
  if (args.empty()) return;
  o << "\n[" << header << "]\n";
  for (const auto& [k, a] : args)
    o << (is_bare_key(k) ? k : quote(k)) << " = " << toml_arg(a) << "\n";
}

}  // namespace

ConfigFile parse_config_text(const std::string& text, const std::string& source) {
  toml::table root;
  try {
    root = toml::parse(std::string_view(text), std::string_view(source));
  } catch (const toml::parse_error& e) {
    const auto& b = e.source().begin;
    throw Error(source + ":" + std::to_string(b.line) + ":" + std::to_string(b.column) + ": " +
                std::string(e.description()));
  }
  ConfigFile cf;
  cf.base = read_layer(root, source, false, "");
  if (const toml::node* runs = root.get("runs")) {
    const toml::array* arr = runs->as_array();
    if (!arr || !arr->is_array_of_tables())
      throw Error(where_of(*runs, source) + ": runs: expected an array of tables ([[runs]])");
    std::set<std::string> names;
    for (size_t i = 0; i < arr->size(); ++i) {
      const toml::table& t = *(*arr)[i].as_table();
      RunEntry r;
      r.where = where_of(t, source);
      r.name = "run" + std::to_string(i + 1);
      if (const toml::node* n = t.get("name")) {
        auto v = n->value_exact<std::string>();
        if (!v || v->empty())
          throw Error(where_of(*n, source) + ": runs.name: expected a non-empty string");
        // The name becomes a folder under output_dir and a suffix of save_model: one plain
        // path component, never one that leaves the folder.
        if (*v == "." || *v == "..")
          throw Error(where_of(*n, source) + ": runs.name: '" + *v +
                      "' cannot name a run: it names a folder under output_dir, and '" + *v +
                      "' is " + (*v == "." ? "output_dir itself" : "the folder above it") +
                      "; choose another name");
        if (v->find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                 "0123456789._-") != std::string::npos)
          throw Error(where_of(*n, source) + ": runs.name: '" + *v +
                      "' may use only letters, digits, '.', '_' and '-' (it names a folder)");
        r.name = *v;
      }
      if (!names.insert(r.name).second)
        throw Error(r.where + ": two runs are named '" + r.name + "'");
      r.layer = read_layer(t, source, true, "runs.");
      cf.runs.push_back(std::move(r));
    }
  }
  return cf;
}

ConfigFile read_config_file(const std::string& path) {
  check_readable_file("", path, "config file");
  std::error_code ec;
  constexpr std::uintmax_t kMaxConfigBytes = 16u << 20;
  if (const std::uintmax_t size = std::filesystem::file_size(path, ec);
      !ec && size > kMaxConfigBytes)
    throw Error("config file " + path + " is " + std::to_string(size >> 20) +
                " MiB; a config is a small TOML file (at most 16 MiB): is it the right file?");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("config file " + path + " cannot be read (permission denied?)");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw Error("config file " + path + " cannot be read");
  return parse_config_text(text, path);
}

std::string write_config(const Layer& base, const std::vector<RunEntry>& runs) {
  std::ostringstream o;
  o << "# trainer configuration, fully resolved (trainer --print-config)\n";
  write_keys(o, base, true);
  write_args(o, base.optimizer_args, "optimizer_args");
  for (const auto& r : runs) {
    o << "\n[[runs]]\nname = " << quote(r.name) << "\n";
    write_keys(o, r.layer, false);
    write_args(o, r.layer.optimizer_args, "runs.optimizer_args");
  }
  return o.str();
}

std::map<std::string, std::string> written_settings(const std::string& toml) {
  std::map<std::string, std::string> out;
  std::istringstream in(toml);
  std::string table;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    if (line[0] == '[') {
      table = line.substr(1, line.find(']') - 1) + ".";
      continue;
    }
    const size_t eq = line.find(" = ");
    if (eq != std::string::npos) out[table + line.substr(0, eq)] = line.substr(eq + 3);
  }
  return out;
}

}  // namespace fusebox::trainer
