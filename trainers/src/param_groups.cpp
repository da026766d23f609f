#include "param_groups.h"

#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "fusebox/core/hyperparam_validation.h"
#include "fusebox/error.h"
#include "options.h"

namespace fusebox::trainer {

LrScaleRule parse_lr_scale(const std::string& entry, const std::string& label) {
  // The last '=': a glob may hold one ("[=]" is a character class), a number never does.
  const size_t eq = entry.rfind('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == entry.size())
    throw Error(label + ": '" + entry + "' is not GLOB=FACTOR (e.g. 'embed.*=0.1')");
  LrScaleRule rule;
  rule.glob = entry.substr(0, eq);
  const std::string text = entry.substr(eq + 1);
  if (!parse_real(text, rule.factor) || !std::isfinite(rule.factor) || rule.factor < 0)
    throw Error(label + ": '" + entry + "': the factor '" + text +
                "' must be a finite number >= 0 (0 keeps the parameters where they are)");
  return rule;
}

bool glob_matches(const std::string& glob, const std::string& name) {
  return fnmatch(glob.c_str(), name.c_str(), 0) == 0;
}

namespace {

// Up to `n` of the model's parameter names, for a glob that matches none of them.
std::string some_names(const std::vector<std::pair<std::string, at::Tensor>>& params, size_t n) {
  std::string out;
  for (size_t i = 0; i < params.size() && i < n; ++i) out += (i ? ", " : "") + params[i].first;
  if (params.size() > n) out += ", ... (" + std::to_string(params.size()) + " in all)";
  return out;
}

}  // namespace

GroupedParams make_param_groups(const std::vector<std::pair<std::string, at::Tensor>>& params,
                                const GroupRules& rules, std::optional<double> base_lr,
                                std::optional<double> base_weight_decay) {
  GroupedParams out;
  if (rules.empty()) {
    ParamGroup g;
    for (const auto& [name, t] : params) g.names.push_back(name), g.params.push_back(t);
    out.groups.push_back(std::move(g));
    return out;
  }
  auto unmatched = [&](const std::string& label, const std::string& glob) {
    return Error(label + ": '" + glob + "' matches no parameter of this model; its names are " +
                 some_names(params, 6) + " (globs: * ? [...], and * matches dots too)");
  };
  for (const LrScaleRule& r : rules.lr_scale) {
    bool any = false;
    for (const auto& p : params) any = any || glob_matches(r.glob, p.first);
    if (!any) throw unmatched(rules.lr_scale_label, r.glob);
  }
  auto check_globs = [&](const std::vector<std::string>& globs, const std::string& label) {
    for (const std::string& glob : globs) {
      bool any = false;
      for (const auto& p : params) any = any || glob_matches(glob, p.first);
      if (!any) throw unmatched(label, glob);
    }
  };
  check_globs(rules.no_weight_decay, rules.no_weight_decay_label);
  check_globs(rules.freeze, rules.freeze_label);
  // A group per (factor, decay) pair, in the order their first parameters come.
  struct Key {
    double factor;
    bool decay;
    bool operator<(const Key& o) const {
      return factor != o.factor ? factor < o.factor : decay < o.decay;
    }
  };
  std::map<Key, size_t> index;
  std::vector<Key> keys;
  std::vector<int64_t> values;
  int64_t frozen_values = 0;
  for (const auto& [name, t] : params) {
    const std::string& n = name;  // C++17 lambdas cannot capture a structured binding
    if (std::any_of(rules.freeze.begin(), rules.freeze.end(),
                    [&n](const std::string& glob) { return glob_matches(glob, n); })) {
      out.frozen.emplace_back(name, t);
      frozen_values += t.numel();
      continue;
    }
    Key key{1.0, true};
    for (const LrScaleRule& r : rules.lr_scale)
      if (glob_matches(r.glob, name)) {
        key.factor = r.factor;
        break;
      }
    for (const std::string& glob : rules.no_weight_decay)
      if (glob_matches(glob, name)) key.decay = false;
    auto [it, fresh] = index.emplace(key, out.groups.size());
    if (fresh) {
      if (key.factor != 1 && !base_lr)
        throw Error(rules.lr_scale_label +
                    ": scales the learning rate, but the plugin runs without one (its lr is "
                    "none with these hyperparameters); give --learning-rate or lr in "
                    "--optimizer-args");
      ParamGroup g;
      if (key.factor != 1) g.lr = *base_lr * key.factor;
      if (!key.decay) g.weight_decay = 0.0;
      out.groups.push_back(std::move(g));
      keys.push_back(key);
      values.push_back(0);
    }
    out.groups[it->second].names.push_back(name);
    out.groups[it->second].params.push_back(t);
    values[it->second] += t.numel();
  }
  if (out.groups.empty())
    throw Error(rules.freeze_label +
                ": freezes every parameter of this model, so nothing would "
                "train; freeze fewer (--list-params shows the names)");
  std::string parts;
  for (size_t g = 0; g < out.groups.size(); ++g) {
    const Key& k = keys[g];
    std::string lr = "lr ×" + format_real(k.factor);
    if (base_lr) lr += " (" + format_real(*base_lr * k.factor) + ")";
    const std::string wd = !k.decay            ? "weight decay 0"
                           : base_weight_decay ? "weight decay " + format_real(*base_weight_decay)
                                               : "no weight decay";
    parts += (g ? "; " : "") + lr + ", " + wd + ": " + std::to_string(out.groups[g].params.size()) +
             " tensors, " + std::to_string(values[g]) + " values";
  }
  out.summary = "param groups: " + std::to_string(out.groups.size()) + " (" + parts + ")";
  if (!out.frozen.empty())
    out.summary += "; frozen: " + std::to_string(out.frozen.size()) + " tensors, " +
                   std::to_string(frozen_values) + " values (no gradients, no optimizer state)";
  return out;
}

std::vector<std::pair<size_t, size_t>> lr_sources(
    const std::vector<ParamGroup>& groups,
    const std::vector<std::shared_ptr<Optimizer>>& optimizers) {
  std::vector<std::pair<size_t, size_t>> out;
  for (const ParamGroup& group : groups) {
    if (group.params.empty()) throw Error("internal: an empty parameter group");
    const at::Tensor& first = group.params.front();
    const auto holder = std::find_if(optimizers.begin(), optimizers.end(),
                                     [&](const auto& o) { return o->owns(first); });
    if (holder == optimizers.end())
      throw Error("internal: a parameter group is held by no optimizer");
    const Optimizer& opt = **holder;
    size_t j = 0;
    while (std::none_of(opt.group(j).params.begin(), opt.group(j).params.end(),
                        [&](const at::Tensor& p) { return p.is_same(first); }))
      ++j;  // owns() found it, so one of the groups holds it
    out.emplace_back(static_cast<size_t>(holder - optimizers.begin()), j);
  }
  return out;
}

}  // namespace fusebox::trainer
