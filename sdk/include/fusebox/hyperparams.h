// fusebox SDK: the hyperparameter schema a plugin declares, and the validated values it receives.
//
// A plugin describes each hyperparameter once (name, type, default, range, help) plus cross-field
// rules; the host validates user input against it before the plugin's factory ever runs, so a
// factory can read values without re-checking them.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "fusebox/error.h"

namespace fusebox {

/// The types a hyperparameter can have.
enum class ParamType { Bool, Int, Double, DoublePair, String, Enum };

/// A hyperparameter value; std::monostate means "none" (allowed only for nullable ones).
using Value =
    std::variant<std::monostate, bool, int64_t, double, std::pair<double, double>, std::string>;

/// One declared hyperparameter. Fluent setters refine it: `.at_least(0).below(1)`.
struct HyperParamSpec {
  std::string name;                                      ///< snake_case key, as users write it
  ParamType type = ParamType::Double;                    ///< value type
  Value default_value;                                   ///< default (monostate: "none")
  std::string help;                                      ///< one-line description
  double lo = -std::numeric_limits<double>::infinity();  ///< lower bound (numbers, each of a pair)
  double hi = std::numeric_limits<double>::infinity();   ///< upper bound
  /// true: value must be > lo instead of >= lo. Unbounded ends start open, so -inf and inf are
  /// refused unless a bound admits them (`.at_most(inf)` for "inf means unlimited").
  bool lo_open = true;
  bool hi_open = true;               ///< true: value must be < hi instead of <= hi
  bool nullable = false;             ///< "none" is a valid value
  std::vector<std::string> choices;  ///< allowed strings of an Enum

  /// Requires value >= v.
  HyperParamSpec& at_least(double v) {
    lo = v, lo_open = false;
    return *this;
  }
  /// Requires value > v.
  HyperParamSpec& above(double v) {
    lo = v, lo_open = true;
    return *this;
  }
  /// Requires value <= v.
  HyperParamSpec& at_most(double v) {
    hi = v, hi_open = false;
    return *this;
  }
  /// Requires value < v.
  HyperParamSpec& below(double v) {
    hi = v, hi_open = true;
    return *this;
  }
  /// Allows "none" as a value.
  HyperParamSpec& allow_none() {
    nullable = true;
    return *this;
  }
};

class HyperParams;

/// A cross-field rule: returns an empty string when satisfied, else what is wrong.
struct Rule {
  std::string keys;                                      ///< the keys it concerns, for messages
  std::function<std::string(const HyperParams&)> check;  ///< "" when satisfied
  std::string help;  ///< what it requires, for --describe-plugin ("" if not given)
};

/// What Schema's declarations return: refines the spec just declared, `.at_least(0).below(1)`.
/// It holds the spec's position, not a reference, so it stays valid when more keys are declared
/// (a `HyperParamSpec&` into the schema's vector would dangle at its next growth).
class SpecRef {
 public:
  SpecRef(std::vector<HyperParamSpec>& specs, size_t index) : specs_(&specs), index_(index) {}
  /// Requires value >= v.
  SpecRef at_least(double v) {
    spec().at_least(v);
    return *this;
  }
  /// Requires value > v.
  SpecRef above(double v) {
    spec().above(v);
    return *this;
  }
  /// Requires value <= v.
  SpecRef at_most(double v) {
    spec().at_most(v);
    return *this;
  }
  /// Requires value < v.
  SpecRef below(double v) {
    spec().below(v);
    return *this;
  }
  /// Allows "none" as a value.
  SpecRef allow_none() {
    spec().allow_none();
    return *this;
  }
  /// The spec itself, valid until the next declaration.
  HyperParamSpec& spec() const { return (*specs_)[index_]; }
  HyperParamSpec* operator->() const { return &spec(); }

 private:
  std::vector<HyperParamSpec>* specs_;
  size_t index_;
};

/// Everything a plugin accepts; built in the plugin's `declare_schema`.
class Schema {
 public:
  /// Declares a boolean.
  SpecRef flag(const std::string& name, bool def, const std::string& help) {
    return add(name, ParamType::Bool, def, help);
  }
  /// Declares an integer.
  SpecRef integer(const std::string& name, int64_t def, const std::string& help) {
    return add(name, ParamType::Int, def, help);
  }
  /// Declares a real number.
  SpecRef real(const std::string& name, double def, const std::string& help) {
    return add(name, ParamType::Double, def, help);
  }
  /// Declares a real number without a default ("none"); chain allow_none().
  SpecRef real(const std::string& name, std::monostate none, const std::string& help) {
    return add(name, ParamType::Double, none, help);
  }
  /// Declares a real number whose default is held in a Value (a double or std::monostate).
  SpecRef real(const std::string& name, Value def, const std::string& help) {
    return add(name, ParamType::Double, std::move(def), help);
  }
  /// Declares a pair of reals, e.g. betas; bounds apply to both elements.
  SpecRef real_pair(const std::string& name, std::pair<double, double> def,
                    const std::string& help) {
    return add(name, ParamType::DoublePair, def, help);
  }
  /// Declares a free string.
  SpecRef text(const std::string& name, const std::string& def, const std::string& help) {
    return add(name, ParamType::String, def, help);
  }
  /// Declares a string restricted to `choices`.
  SpecRef choice(const std::string& name, const std::string& def, std::vector<std::string> choices,
                 const std::string& help) {
    SpecRef s = add(name, ParamType::Enum, def, help);
    s->choices = std::move(choices);
    return s;
  }
  /// Adds a cross-field rule over `keys` (a comma-separated list, used in messages).
  Schema& rule(const std::string& keys, std::function<std::string(const HyperParams&)> check) {
    rules_.push_back({keys, std::move(check), ""});
    return *this;
  }
  /// Adds a cross-field rule with a one-line description of what it requires (shown by the
  /// trainer's --describe-plugin).
  Schema& rule(const std::string& keys, const std::string& help,
               std::function<std::string(const HyperParams&)> check) {
    rules_.push_back({keys, std::move(check), help});
    return *this;
  }
  /// The declared hyperparameters, in declaration order.
  const std::vector<HyperParamSpec>& specs() const { return specs_; }
  /// The cross-field rules.
  const std::vector<Rule>& rules() const { return rules_; }
  /// The spec named `name`, or nullptr.
  const HyperParamSpec* find(const std::string& name) const {
    for (const auto& s : specs_)
      if (s.name == name) return &s;
    return nullptr;
  }

 private:
  SpecRef add(const std::string& name, ParamType type, Value def, const std::string& help) {
    HyperParamSpec s;
    s.name = name, s.type = type, s.default_value = std::move(def), s.help = help;
    specs_.push_back(std::move(s));
    return SpecRef(specs_, specs_.size() - 1);
  }
  std::vector<HyperParamSpec> specs_;
  std::vector<Rule> rules_;
};

/// Validated values, one per declared key (defaults filled in by the host).
class HyperParams {
 public:
  /// Sets a value (the host does this; plugins only read).
  void set(const std::string& name, Value v) { values_[name] = std::move(v); }
  /// True when `name` holds a value other than "none".
  bool is_set(const std::string& name) const {
    auto it = values_.find(name);
    return it != values_.end() && !std::holds_alternative<std::monostate>(it->second);
  }
  /// The raw value of `name`; throws when undeclared.
  const Value& value(const std::string& name) const {
    auto it = values_.find(name);
    if (it == values_.end()) throw Error("hyperparameter '" + name + "' was not declared");
    return it->second;
  }
  /// A boolean value.
  bool flag(const std::string& name) const { return get<bool>(name); }
  /// An integer value.
  int64_t integer(const std::string& name) const { return get<int64_t>(name); }
  /// A real value (integers widen).
  double real(const std::string& name) const {
    const Value& v = value(name);
    if (auto* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
    return get<double>(name);
  }
  /// A pair of reals.
  std::pair<double, double> real_pair(const std::string& name) const {
    return get<std::pair<double, double>>(name);
  }
  /// A string or enum value.
  const std::string& text(const std::string& name) const { return get<std::string>(name); }
  /// All values by key.
  const std::map<std::string, Value>& values() const { return values_; }

 private:
  template <class T>
  const T& get(const std::string& name) const {
    const T* p = std::get_if<T>(&value(name));
    if (!p) throw Error("hyperparameter '" + name + "' is none or of another type");
    return *p;
  }
  std::map<std::string, Value> values_;
};

}  // namespace fusebox
