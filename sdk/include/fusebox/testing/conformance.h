// fusebox conformance kit: GoogleTest checks that a plugin keeps the promises it declares.
//
//   #include <fusebox/testing/conformance.h>
//   FUSEBOX_CONFORMANCE_TESTS(Momentum, "/path/to/momentum.so", "lr=0.01", "momentum=0.9")
//
// links Fusebox::conformance and GTest::gtest_main. The trailing "key=value" hyperparameters are
// optional: pass the required ones (e.g. an lr whose default is none) and any that make the
// plugin exercise more of its algorithm. FUSEBOX_CONFORMANCE_TESTS_FOR(Suite, targets) runs the
// same checks over a std::vector<Target>, e.g. fusebox::conformance::plugins_in(dir).
//
// What is checked (a check whose capability is not declared is skipped, not passed):
//   Descriptor           name, version and description set; API and capability bits known
//   SchemaDefaults       the arguments validate; each default, passed explicitly, is accepted;
//                        the optimizer builds from the defaults
//   RejectsInvalid       an unknown key; for each numeric key with a finite bound, a value just
//                        outside it; an enum value not among the choices; none where not nullable
//   StepEqualsStepParam  supports_step_param: step() equals step_param() over all parameters
//                        followed by finish_step(), bit for bit
//   FusedEqualsNormal    supports_step_param: the fused backward pass equals the normal loop
//   GroupsEqualNormal    not auto_lr (groups wrap every other plugin): optimizer groups (N = 1,
//                        2, 3, all; by size and by count) equal one instance over the normal
//                        loop, bit for bit
//   StateRoundTrip       state_dict -> fresh instance -> load_state_dict -> continue equals an
//                        uninterrupted run, bit for bit; keys are "<param>/..." or "@optimizer/..."
//   StateAcrossRegroup   not auto_lr: a state saved by one instance loads into groups
//   Deterministic        two runs from the same start are bit-identical
//   StochasticRoundingIsOrderFree
//                        supports_step_param and a stochastic_rounding key: bf16 parameters
//                        rounded stochastically are the same whatever the update order
//   EffectiveLr          effective_lr() is finite and not negative after steps (auto_lr: > 0)
//   FollowsGroupLr       an lr hyperparameter: the group lr a scheduler sets is the one applied
//                        (built with lr and with lr/2, the same set_lr schedule gives the same run)
//   FollowsGroupWeightDecay
//                        a real weight_decay hyperparameter: a group's own weight decay
//                        (ParamGroup::weight_decay) is the one applied, not the hyperparameter
//   Dtypes               float64, float32, bfloat16 and float16 parameters step without error,
//                        keep their dtype and stay finite (step(), and step_param() if declared)
//   NoGradientNoUpdate   step() leaves a parameter without a gradient untouched
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "fusebox/core/hyperparam_validation.h"
#include "fusebox/core/plugin_registry.h"
#include "fusebox/core/step_mode.h"
#include "fusebox/plugin.h"

namespace fusebox::conformance {

/// One plugin under test.
struct Target {
  std::string path;               ///< the plugin's shared library
  std::vector<std::string> args;  ///< hyperparameters as "key=value" (command-line syntax)
  std::string label;              ///< test-name suffix; empty: the file name without ".so"
  bool allow_insecure = false;    ///< load even if group/others can write the file or folder
};

/// How GoogleTest prints a target: the path and the arguments.
inline void PrintTo(const Target& t, std::ostream* os) {
  *os << t.path;
  for (const std::string& a : t.args) *os << " " << a;
}

/// A target for the plugin at `path` with hyperparameters `args` ("key=value" each).
inline Target plugin(std::string path, std::vector<std::string> args = {}) {
  Target t;
  t.path = std::move(path);
  t.args = std::move(args);
  return t;
}

/// Every "*.so" file in `dir`, sorted; `args_for(file stem)` gives each one's hyperparameters.
inline std::vector<Target> plugins_in(
    const std::string& dir,
    const std::function<std::vector<std::string>(const std::string&)>& args_for = {}) {
  std::vector<Target> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (e.is_regular_file() && e.path().extension() == ".so") {
      std::string stem = e.path().stem().string();
      out.push_back(
          plugin(e.path().string(), args_for ? args_for(stem) : std::vector<std::string>{}));
    }
  std::sort(out.begin(), out.end(),
            [](const Target& a, const Target& b) { return a.path < b.path; });
  return out;
}

/// The GoogleTest name of a target: its label (or file stem) with other characters as '_'.
inline std::string test_name(const ::testing::TestParamInfo<Target>& info) {
  std::string s = info.param.label.empty() ? std::filesystem::path(info.param.path).stem().string()
                                           : info.param.label;
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s.empty() ? "plugin" + std::to_string(info.index) : s;
}

/// Loads the plugin of `t` through the registry (each file once per process).
inline std::shared_ptr<LoadedPlugin> load(const Target& t) {
  static std::map<std::string, std::shared_ptr<LoadedPlugin>> cache;
  auto it = cache.find(t.path);
  if (it != cache.end()) return it->second;
  LoaderOptions o;
  o.use_environment = false;
  o.use_default_dir = false;
  o.allow_insecure = t.allow_insecure;
  PluginRegistry registry(o);
  std::string spec = t.path.find('/') == std::string::npos ? "./" + t.path : t.path;
  return cache[t.path] = registry.load_file(spec);
}

/// The target's "key=value" arguments as the host's validator takes them.
inline UserArgs user_args(const Target& t) {
  UserArgs out;
  for (const std::string& a : t.args) {
    size_t eq = a.find('=');
    if (eq == std::string::npos || eq == 0)
      throw Error("conformance argument '" + a + "' is not key=value");
    out[a.substr(0, eq)] = UserArg{std::monostate{}, a.substr(eq + 1), "conformance arguments"};
  }
  return out;
}

namespace detail {

/// A small model in plain ATen ops: matrices, vectors, a 3-d tensor and a 0-d scalar, so that
/// factored, per-row and scalar code paths all run.
struct Model {
  std::vector<std::string> names{"fc1.weight", "fc1.bias", "fc2.weight",
                                 "fc2.bias",   "mix",      "scale"};
  std::vector<at::Tensor> params;

  explicit Model(at::ScalarType dtype = at::kDouble, uint64_t seed = 0) {
    at::manual_seed(seed);
    auto o = at::TensorOptions().dtype(at::kDouble);
    params = {at::randn({6, 8}, o) * 0.4,    at::randn({8}, o) * 0.1,
              at::randn({8, 3}, o) * 0.4,    at::randn({3}, o) * 0.1,
              at::randn({2, 3, 4}, o) * 0.3, at::scalar_tensor(1.25, o)};
    for (auto& p : params) p = p.to(dtype).detach().requires_grad_(true);
  }

  /// A deep copy: same values, separate leaves.
  Model clone() const {
    Model c = *this;
    for (auto& p : c.params) p = p.detach().clone().requires_grad_(true);
    return c;
  }

  /// One group of every parameter, named; NaN lr: the plugin's "lr" hyperparameter applies.
  std::vector<ParamGroup> groups() const {
    ParamGroup g;
    g.params = params;
    g.names = names;
    return {g};
  }

  /// A regression loss on batch `step` of a fixed input stream (float64 models only).
  at::Tensor loss(int64_t step) const {
    auto o = at::TensorOptions().dtype(params[0].scalar_type());
    const double f = 0.37 + 0.11 * static_cast<double>(step);
    at::Tensor x = at::sin(at::arange(4 * 6, o).reshape({4, 6}) * f);
    at::Tensor target = at::cos(at::arange(4 * 3, o).reshape({4, 3}) * (f + 0.5));
    at::Tensor h = at::tanh(at::matmul(x, params[0]) + params[1]);
    at::Tensor y = at::matmul(h, params[2]) + params[3];
    at::Tensor z = at::matmul(y.unsqueeze(0), params[4]);  // [2, 4, 4]
    return (y * params[5] - target).pow(2).mean() + 0.1 * z.pow(2).mean();
  }

  /// Detached copies of the current values.
  std::vector<at::Tensor> values() const {
    std::vector<at::Tensor> v;
    for (const auto& p : params) v.push_back(p.detach().clone());
    return v;
  }
};

/// One step of `opt` over `m` from seeded random gradients of `dtype` (step `s` of a fixed
/// stream): step(), or step_param() on every parameter in backward order then finish_step().
inline void random_step(Optimizer& opt, Model& m, int64_t s, at::ScalarType dtype, bool per_param) {
  at::manual_seed(100 + static_cast<uint64_t>(s));
  for (auto& param : m.params)
    param.mutable_grad() =
        (at::randn(param.sizes(), at::TensorOptions().dtype(at::kDouble)) * 0.5).to(dtype);
  if (per_param) {
    for (size_t i = m.params.size(); i-- > 0;) opt.step_param(m.params[i]);
    at::NoGradGuard no_grad;
    opt.finish_step();
  } else {
    opt.step();
  }
}

/// Hyperparameters from the target's arguments; a failure here is reported by SchemaDefaults.
inline HyperParams hyperparams(const LoadedPlugin& p, const Target& t) {
  return p.validate(user_args(t));
}

/// Steps a fresh optimizer over `model` in `mode` ("normal" or "fused") for steps [from, to).
inline void train(const LoadedPlugin& p, const HyperParams& hp, Model& model,
                  const std::string& mode, int64_t from, int64_t to,
                  const StateDict* load = nullptr) {
  StepOptions o;
  o.warn = [](const std::string&) {};
  std::shared_ptr<Optimizer> opt = p.create(model.groups(), hp);
  if (load) opt->load_state_dict(*load);
  std::unique_ptr<StepMode> m =
      mode == "fused" ? make_fused_backward(opt, o) : make_normal_step(opt, o);
  for (int64_t s = from; s < to; ++s) {
    m->backward(model.loss(s));
    m->step();
  }
}

/// Optimizer groups over `model`, each instance loading `load` when given.
inline void train_groups(const LoadedPlugin& p, const HyperParams& hp, Model& model, int64_t n,
                         SplitPolicy policy, int64_t from, int64_t to,
                         const StateDict* load = nullptr) {
  StepOptions o;
  o.warn = [](const std::string&) {};
  std::unique_ptr<StepMode> m = make_optimizer_groups(
      model.groups(), n, policy,
      [&](std::vector<ParamGroup> g) {
        std::shared_ptr<Optimizer> opt = p.create(std::move(g), hp);
        if (load) opt->load_state_dict(*load);
        return opt;
      },
      o);
  for (int64_t s = from; s < to; ++s) {
    m->backward(model.loss(s));
    m->step();
  }
}

/// A deep copy of a state dict (state_dict() aliases the live state).
inline StateDict deep_copy(const StateDict& d) {
  StateDict out;
  for (const auto& kv : d) out[kv.first] = kv.second.clone();
  return out;
}

/// Expects bit-identical parameter values, naming the first parameters that differ.
inline void expect_identical(const Model& expected, const Model& actual, const std::string& what) {
  ASSERT_EQ(expected.params.size(), actual.params.size());
  for (size_t i = 0; i < expected.params.size(); ++i) {
    const at::Tensor a = expected.params[i].detach(), b = actual.params[i].detach();
    EXPECT_TRUE(at::equal(a, b))
        << what << ": parameter '" << expected.names[i] << "' differs by up to "
        << (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  }
}

/// Expects that training moved the parameters (else equality would prove nothing).
inline void expect_moved(const Model& before, const Model& after) {
  bool moved = false;
  for (size_t i = 0; i < before.params.size(); ++i)
    moved = moved || !at::equal(before.params[i].detach(), after.params[i].detach());
  EXPECT_TRUE(moved) << "the parameters did not change in training; pass hyperparameters that "
                        "make the plugin move them";
}

/// True when every element of `t` is finite.
inline bool all_finite(const at::Tensor& t) {
  return at::isfinite(t.detach().to(at::kDouble)).all().item<bool>();
}

constexpr int64_t kSteps = 4;

}  // namespace detail

// ---- the checks, one per test ----

/// The descriptor is filled in and speaks this kit's API.
inline void check_descriptor(const Target& t) {
  std::shared_ptr<LoadedPlugin> p = load(t);
  const PluginInfo& i = p->info();
  EXPECT_FALSE(i.name.empty());
  EXPECT_FALSE(i.version.empty());
  EXPECT_FALSE(i.description.empty());
  EXPECT_EQ(i.api_major, static_cast<unsigned>(FUSEBOX_API_MAJOR));
  EXPECT_LE(i.api_minor, static_cast<unsigned>(FUSEBOX_API_MINOR));
  EXPECT_EQ(i.capabilities & ~uint64_t{kSupportsStepParam | kAutoLr}, 0u)
      << "capability bits unknown to API " << FUSEBOX_API_MAJOR << "." << FUSEBOX_API_MINOR;
}

/// The arguments validate, every default is a valid value of its key, and the optimizer builds.
inline void check_schema_defaults(const Target& t) {
  std::shared_ptr<LoadedPlugin> p = load(t);
  const UserArgs base = user_args(t);
  HyperParams hp;
  ASSERT_NO_THROW(hp = p->validate(base))
      << "the arguments must validate; pass required hyperparameters (those whose default is "
         "none) to the conformance macro as \"key=value\"";
  std::map<std::string, int> seen;
  for (const HyperParamSpec& s : p->schema().specs()) {
    EXPECT_EQ(++seen[s.name], 1) << "hyperparameter '" << s.name << "' is declared twice";
    EXPECT_FALSE(s.name.empty());
    EXPECT_FALSE(s.help.empty()) << "hyperparameter '" << s.name << "' has no help text";
    if (base.count(s.name)) continue;  // the caller's value replaces the default
    UserArgs a = base;
    a[s.name] = UserArg{s.default_value, "", "default"};
    EXPECT_NO_THROW(p->validate(a))
        << "the default of '" << s.name << "' (" << format_value(s.default_value)
        << ") is not a valid value of its own schema (out of range, not a choice, or none "
           "without allow_none())";
  }
  detail::Model m;
  std::shared_ptr<Optimizer> opt;
  EXPECT_NO_THROW(opt = p->create(m.groups(), hp));
  if (opt) {
    EXPECT_EQ(opt->num_groups(), 1u);
  }
}

namespace detail {

/// Trains `model` for steps [0, k) with one instance in the normal loop and returns a deep copy
/// of its state; the instance is gone afterwards, so only the state carries over.
inline StateDict state_after(const LoadedPlugin& p, const HyperParams& hp, Model& model,
                             int64_t k) {
  std::shared_ptr<Optimizer> first = p.create(model.groups(), hp);
  StepOptions o;
  o.warn = [](const std::string&) {};
  auto mode = make_normal_step(first, o);
  for (int64_t s = 0; s < k; ++s) {
    mode->backward(model.loss(s));
    mode->step();
  }
  return deep_copy(first->state_dict());
}

/// Expects `key` = `bad` (on top of the target's arguments) to be refused naming the key.
inline void expect_rejected(const LoadedPlugin& p, UserArgs args, const std::string& key,
                            const Value& bad, const std::string& why) {
  args[key] = UserArg{bad, "", "conformance"};
  try {
    p.validate(args);
    ADD_FAILURE() << key << " = " << format_value(bad) << " was accepted (" << why << ")";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'" + key + "'"), std::string::npos)
        << "the message does not name '" << key << "': " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << key << " = " << format_value(bad) << " threw something other than "
                  << "fusebox::Error: " << e.what();
  }
}

/// Values just outside the finite bounds of a numeric spec, each with a description.
inline std::vector<std::pair<double, std::string>> outside(const HyperParamSpec& s) {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::pair<double, std::string>> out;
  const bool integer = s.type == ParamType::Int;
  if (std::isfinite(s.lo)) {
    double v = s.lo_open ? s.lo : std::nextafter(s.lo, -inf);
    if (integer) v = s.lo_open ? std::floor(s.lo) : std::ceil(s.lo) - 1;
    out.emplace_back(
        v, std::string("below the lower bound ") + (s.lo_open ? "(" : "[") + format_value(s.lo));
  }
  if (std::isfinite(s.hi)) {
    double v = s.hi_open ? s.hi : std::nextafter(s.hi, inf);
    if (integer) v = s.hi_open ? std::ceil(s.hi) : std::floor(s.hi) + 1;
    out.emplace_back(
        v, std::string("above the upper bound ") + format_value(s.hi) + (s.hi_open ? ")" : "]"));
  }
  return out;
}

/// A valid element for one side of a pair: the default's.
inline double pair_element(const HyperParamSpec& s, bool first) {
  if (auto* d = std::get_if<std::pair<double, double>>(&s.default_value))
    return first ? d->first : d->second;
  return 0.5 * ((std::isfinite(s.lo) ? s.lo : 0) + (std::isfinite(s.hi) ? s.hi : 1));
}

}  // namespace detail

/// Invalid hyperparameters are refused with a message naming the key.
inline void check_rejects_invalid(const Target& t) {
  std::shared_ptr<LoadedPlugin> p = load(t);
  const UserArgs base = user_args(t);
  ASSERT_NO_THROW(p->validate(base)) << "the conformance arguments themselves must validate";
  detail::expect_rejected(*p, base, "conformance_no_such_key", 1.0, "unknown key");
  for (const HyperParamSpec& s : p->schema().specs()) {
    SCOPED_TRACE("hyperparameter '" + s.name + "'");
    switch (s.type) {
      case ParamType::Int:
        for (const auto& [v, why] : detail::outside(s))
          if (std::fabs(v) < 9e18)
            detail::expect_rejected(*p, base, s.name, static_cast<int64_t>(v), why);
        break;
      case ParamType::Double:
        for (const auto& [v, why] : detail::outside(s))
          detail::expect_rejected(*p, base, s.name, v, why);
        break;
      case ParamType::DoublePair:
        for (const auto& [v, why] : detail::outside(s)) {
          detail::expect_rejected(*p, base, s.name,
                                  std::make_pair(v, detail::pair_element(s, false)),
                                  "first element " + why);
          detail::expect_rejected(*p, base, s.name,
                                  std::make_pair(detail::pair_element(s, true), v),
                                  "second element " + why);
        }
        break;
      case ParamType::Enum:
        detail::expect_rejected(*p, base, s.name, std::string("conformance-no-such-choice"),
                                "not one of the choices");
        break;
      case ParamType::Bool:
      case ParamType::String:
        break;
    }
    if (!s.nullable) detail::expect_rejected(*p, base, s.name, std::monostate{}, "none");
  }
}

/// supports_step_param: step() equals step_param() on every parameter, then finish_step().
inline void check_step_equals_step_param(const Target& t) {
  std::shared_ptr<LoadedPlugin> p = load(t);
  if (!p->has(kSupportsStepParam)) GTEST_SKIP() << "no supports_step_param";
  HyperParams hp = detail::hyperparams(*p, t);
  detail::Model init, a = init.clone(), b = init.clone();
  std::shared_ptr<Optimizer> oa = p->create(a.groups(), hp), ob = p->create(b.groups(), hp);
  for (int64_t s = 0; s < detail::kSteps; ++s) {
    a.loss(s).backward();
    oa->step();
    oa->zero_grad();
    b.loss(s).backward();
    for (size_t i = b.params.size(); i-- > 0;) ob->step_param(b.params[i]);  // backward order
    {
      at::NoGradGuard no_grad;
      ob->finish_step();
    }
    ob->zero_grad();
    detail::expect_identical(a, b, "after step " + std::to_string(s));
  }
  detail::expect_moved(init, a);
}

/// supports_step_param with a `stochastic_rounding` key: bf16 parameters rounded stochastically
/// come out the same whatever order they are updated in (the noise must be seeded per parameter,
/// e.g. write_back(param, work, stochastic, rounding_seed(param))), and differ from rounding to
/// nearest.
inline void check_stochastic_rounding_is_order_free(const Target& t) {
  std::shared_ptr<LoadedPlugin> p = load(t);
  if (!p->has(kSupportsStepParam)) GTEST_SKIP() << "no supports_step_param";
  if (!p->schema().find("stochastic_rounding")) GTEST_SKIP() << "no stochastic_rounding key";
  auto run = [&](bool stochastic, bool backward_order) {
    UserArgs args = user_args(t);
    args["stochastic_rounding"] =
        UserArg{std::monostate{}, stochastic ? "true" : "false", "conformance"};
    const HyperParams hp = p->validate(args);
    detail::Model m(at::kBFloat16);
    std::shared_ptr<Optimizer> opt = p->create(m.groups(), hp);
    for (int64_t s = 0; s < detail::kSteps; ++s) {
      detail::random_step(*opt, m, s, at::kBFloat16, backward_order);
      opt->zero_grad();
    }
    return m;
  };
  const detail::Model forward = run(true, false);
  detail::expect_identical(forward, run(true, true),
                           "stochastic rounding, step() vs step_param() in backward order");
  const detail::Model nearest = run(false, false);
  bool differs = false;
  for (size_t i = 0; i < forward.params.size(); ++i)
    differs = differs || !at::equal(forward.params[i], nearest.params[i]);
  EXPECT_TRUE(differs) << "stochastic_rounding=true gave the same bf16 values as false";
}

/// supports_step_param: the fused backward pass equals the normal loop, bit for bit.
inline void check_fused_equals_normal(const Target& t) {
  std::shared_ptr<LoadedPlugin> p = load(t);
  if (!p->has(kSupportsStepParam)) GTEST_SKIP() << "no supports_step_param";
  HyperParams hp = detail::hyperparams(*p, t);
  detail::Model init, normal = init.clone(), fused = init.clone();
  detail::train(*p, hp, normal, "normal", 0, detail::kSteps);
  detail::train(*p, hp, fused, "fused", 0, detail::kSteps);
  detail::expect_moved(init, normal);
  detail::expect_identical(normal, fused, "fused backward pass");
}

/// Not auto_lr (groups wrap every other plugin): optimizer groups equal one instance over the
/// normal loop, bit for bit.
inline void check_groups_equal_normal(const Target& t) {
  std::shared_ptr<LoadedPlugin> p = load(t);
  if (p->has(kAutoLr)) GTEST_SKIP() << "auto_lr: optimizer groups refuse it";
  HyperParams hp = detail::hyperparams(*p, t);
  detail::Model init, normal = init.clone();
  detail::train(*p, hp, normal, "normal", 0, detail::kSteps);
  detail::expect_moved(init, normal);
  const int64_t all = static_cast<int64_t>(init.params.size());
  for (int64_t n : {int64_t{1}, int64_t{2}, int64_t{3}, all})
    for (SplitPolicy policy : {SplitPolicy::Size, SplitPolicy::Count}) {
      detail::Model grouped = init.clone();
      detail::train_groups(*p, hp, grouped, n, policy, 0, detail::kSteps);
      detail::expect_identical(
          normal, grouped,
          "optimizer groups N=" + std::to_string(n) +
              (policy == SplitPolicy::Size ? " split by size" : " split by count"));
    }
}

/// state_dict -> fresh instance -> load_state_dict -> continue equals an uninterrupted run.
inline void check_state_round_trip(const Target& t) {
  std::shared_ptr<LoadedPlugin> p = load(t);
  HyperParams hp = detail::hyperparams(*p, t);
  const int64_t k = detail::kSteps;
  detail::Model init, whole = init.clone(), resumed = init.clone();
  detail::train(*p, hp, whole, "normal", 0, 2 * k);
  detail::expect_moved(init, whole);

  const StateDict saved = detail::state_after(*p, hp, resumed, k);
  for (const auto& kv : saved) {
    bool known = kv.first.rfind("@optimizer/", 0) == 0;
    for (const auto& n : init.names) known = known || kv.first.rfind(n + "/", 0) == 0;
    EXPECT_TRUE(known) << "state key '" << kv.first
                       << "' is neither '<param name>/<key>' nor '@optimizer/<key>'";
    EXPECT_TRUE(kv.second.defined()) << kv.first;
  }
  detail::train(*p, hp, resumed, "normal", k, 2 * k, &saved);
  detail::expect_identical(whole, resumed,
                           "resumed from state_dict after " + std::to_string(k) + " steps");
}

/// Not auto_lr: a state saved by one instance loads, by name, into optimizer groups.
inline void check_state_across_regroup(const Target& t) {
  std::shared_ptr<LoadedPlugin> p = load(t);
  if (p->has(kAutoLr)) GTEST_SKIP() << "auto_lr: optimizer groups refuse it";
  HyperParams hp = detail::hyperparams(*p, t);
  const int64_t k = detail::kSteps;
  detail::Model init, whole = init.clone(), resumed = init.clone();
  detail::train(*p, hp, whole, "normal", 0, 2 * k);
  const StateDict saved = detail::state_after(*p, hp, resumed, k);
  detail::train_groups(*p, hp, resumed, 3, SplitPolicy::Count, k, 2 * k, &saved);
  detail::expect_identical(whole, resumed, "one instance's state loaded into 3 optimizer groups");
}

/// Two runs from the same start give bit-identical parameters and state.
inline void check_deterministic(const Target& t) {
  std::shared_ptr<LoadedPlugin> p = load(t);
  HyperParams hp = detail::hyperparams(*p, t);
  detail::Model init, a = init.clone(), b = init.clone();
  detail::train(*p, hp, a, "normal", 0, detail::kSteps);
  detail::train(*p, hp, b, "normal", 0, detail::kSteps);
  detail::expect_moved(init, a);
  detail::expect_identical(a, b, "a second identical run");
}

/// effective_lr() is a usable number after some steps; auto-LR plugins report a positive one.
inline void check_effective_lr(const Target& t) {
  std::shared_ptr<LoadedPlugin> p = load(t);
  HyperParams hp = detail::hyperparams(*p, t);
  detail::Model m;
  std::shared_ptr<Optimizer> opt = p->create(m.groups(), hp);
  StepOptions o;
  o.warn = [](const std::string&) {};
  auto mode = make_normal_step(opt, o);
  for (int64_t s = 0; s < detail::kSteps; ++s) {
    mode->backward(m.loss(s));
    mode->step();
    for (size_t g = 0; g < opt->num_groups(); ++g) {
      const double lr = opt->effective_lr(g);
      EXPECT_TRUE(std::isfinite(lr)) << "effective_lr(" << g << ") = " << lr;
      EXPECT_GE(lr, 0.0) << "effective_lr(" << g << ")";
      if (p->has(kAutoLr)) {
        EXPECT_GT(lr, 0.0) << "auto_lr: effective_lr(" << g << ")";
      }
    }
  }
}

/// The lr a scheduler sets on a group (set_lr before each step) is the one applied: an instance
/// built with lr=L and one built with lr=L/2 step alike under the same schedule of group lrs.
/// A plugin that copies hyperparameter lr in its constructor ignores every schedule.
inline void check_follows_group_lr(const Target& t) {
  std::shared_ptr<LoadedPlugin> p = load(t);
  const HyperParamSpec* spec = p->schema().find("lr");
  if (!spec || spec->type != ParamType::Double) GTEST_SKIP() << "no real lr hyperparameter";
  const HyperParams hp = detail::hyperparams(*p, t);
  if (!hp.is_set("lr")) GTEST_SKIP() << "lr is none with these hyperparameters";
  const double lr = hp.real("lr");
  UserArgs half_args = user_args(t);
  char text[64];
  std::snprintf(text, sizeof text, "%.17g", lr / 2);
  half_args["lr"] = UserArg{std::monostate{}, text, "conformance"};
  const HyperParams half = p->validate(half_args);
  auto run = [&](const HyperParams& built_with) {
    detail::Model m;
    std::shared_ptr<Optimizer> opt = p->create(m.groups(), built_with);
    for (int64_t s = 0; s < detail::kSteps; ++s) {
      for (size_t g = 0; g < opt->num_groups(); ++g) opt->set_lr(g, s % 2 ? lr : lr / 2);
      m.loss(s).backward();
      opt->step();
      opt->zero_grad();
    }
    return m;
  };
  detail::expect_identical(run(hp), run(half),
                           "built with lr and with lr/2, then given the same group lrs: the "
                           "plugin must read lr(group) at each step, not hyperparameter lr");
}

/// A group's own weight decay is the one applied: built with weight_decay=W and the first group
/// at 0 steps exactly like built with weight_decay=0 and the second group at W. A plugin that
/// copies hyperparameter weight_decay in its constructor decays every group alike and fails.
inline void check_follows_group_weight_decay(const Target& t) {
  std::shared_ptr<LoadedPlugin> p = load(t);
  const HyperParamSpec* spec = p->schema().find("weight_decay");
  if (!spec || spec->type != ParamType::Double) GTEST_SKIP() << "no real weight_decay";
  const HyperParams given = detail::hyperparams(*p, t);
  const double w = given.is_set("weight_decay") && given.real("weight_decay") > 0
                       ? given.real("weight_decay")
                       : 0.05;
  auto with_decay = [&](double wd) {
    UserArgs args = user_args(t);
    char text[64];
    std::snprintf(text, sizeof text, "%.17g", wd);
    args["weight_decay"] = UserArg{std::monostate{}, text, "conformance"};
    return p->validate(args);
  };
  // Two groups: fc1.* and the rest, each with its own weight decay (NaN: the hyperparameter's).
  auto run = [&](const HyperParams& hp, double first, double second) {
    detail::Model m;
    std::vector<ParamGroup> groups(2);
    for (size_t i = 0; i < m.params.size(); ++i) {
      ParamGroup& g = groups[i < 2 ? 0 : 1];
      g.params.push_back(m.params[i]);
      g.names.push_back(m.names[i]);
    }
    groups[0].weight_decay = first;
    groups[1].weight_decay = second;
    std::shared_ptr<Optimizer> opt = p->create(groups, hp);
    EXPECT_EQ(opt->weight_decay(0), std::isnan(first) ? hp.real("weight_decay") : first);
    for (int64_t s = 0; s < detail::kSteps; ++s) {
      m.loss(s).backward();
      opt->step();
      opt->zero_grad();
    }
    return m;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  detail::expect_identical(run(with_decay(w), 0.0, nan), run(with_decay(0.0), nan, w),
                           "built with weight_decay=W and a group at 0, then with weight_decay=0 "
                           "and the other group at W: the plugin must read weight_decay(group), "
                           "not hyperparameter weight_decay");
}

/// Every floating dtype steps without error, keeps its dtype and stays finite.
inline void check_dtypes(const Target& t) {
  std::shared_ptr<LoadedPlugin> p = load(t);
  HyperParams hp = detail::hyperparams(*p, t);
  for (at::ScalarType dtype : {at::kDouble, at::kFloat, at::kBFloat16, at::kHalf}) {
    for (bool per_param : {false, true}) {
      if (per_param && !p->has(kSupportsStepParam)) continue;
      SCOPED_TRACE(std::string(c10::toString(dtype)) + (per_param ? " step_param" : " step"));
      detail::Model m(dtype);
      std::shared_ptr<Optimizer> opt;
      ASSERT_NO_THROW(opt = p->create(m.groups(), hp));
      for (int64_t s = 0; s < detail::kSteps; ++s) {
        try {
          detail::random_step(*opt, m, s, dtype, per_param);
        } catch (const std::exception& e) {
          FAIL() << "step " << s << " threw: " << e.what();
        }
        opt->zero_grad();
      }
      for (size_t i = 0; i < m.params.size(); ++i) {
        EXPECT_EQ(m.params[i].scalar_type(), dtype) << m.names[i];
        EXPECT_TRUE(detail::all_finite(m.params[i]))
            << "parameter '" << m.names[i] << "' is not finite";
      }
    }
  }
}

/// step() leaves a parameter that has no gradient untouched.
inline void check_no_gradient_no_update(const Target& t) {
  std::shared_ptr<LoadedPlugin> p = load(t);
  HyperParams hp = detail::hyperparams(*p, t);
  detail::Model m;
  at::Tensor idle = at::randn({3, 5}, at::TensorOptions().dtype(at::kDouble)).requires_grad_(true);
  const at::Tensor before = idle.detach().clone();
  std::vector<ParamGroup> groups = m.groups();
  groups[0].params.push_back(idle);
  groups[0].names.push_back("idle");
  std::shared_ptr<Optimizer> opt = p->create(groups, hp);
  for (int64_t s = 0; s < detail::kSteps; ++s) {
    m.loss(s).backward();
    opt->step();
    opt->zero_grad();
  }
  EXPECT_TRUE(at::equal(idle.detach(), before)) << "a parameter without a gradient was changed";
}

/// The fixture of the generated suites.
class Fixture : public ::testing::TestWithParam<Target> {};

}  // namespace fusebox::conformance

/// Instantiates the conformance tests as suite `Suite` over `targets` (a std::vector<Target>).
#define FUSEBOX_CONFORMANCE_TESTS_FOR(Suite, targets)                                           \
  class Suite : public ::fusebox::conformance::Fixture {};                                      \
  TEST_P(Suite, Descriptor) { ::fusebox::conformance::check_descriptor(GetParam()); }           \
  TEST_P(Suite, SchemaDefaults) { ::fusebox::conformance::check_schema_defaults(GetParam()); }  \
  TEST_P(Suite, RejectsInvalid) { ::fusebox::conformance::check_rejects_invalid(GetParam()); }  \
  TEST_P(Suite, StepEqualsStepParam) {                                                          \
    ::fusebox::conformance::check_step_equals_step_param(GetParam());                           \
  }                                                                                             \
  TEST_P(Suite, StochasticRoundingIsOrderFree) {                                                \
    ::fusebox::conformance::check_stochastic_rounding_is_order_free(GetParam());                \
  }                                                                                             \
  TEST_P(Suite, FusedEqualsNormal) {                                                            \
    ::fusebox::conformance::check_fused_equals_normal(GetParam());                              \
  }                                                                                             \
  TEST_P(Suite, GroupsEqualNormal) {                                                            \
    ::fusebox::conformance::check_groups_equal_normal(GetParam());                              \
  }                                                                                             \
  TEST_P(Suite, StateRoundTrip) { ::fusebox::conformance::check_state_round_trip(GetParam()); } \
  TEST_P(Suite, StateAcrossRegroup) {                                                           \
    ::fusebox::conformance::check_state_across_regroup(GetParam());                             \
  }                                                                                             \
  TEST_P(Suite, Deterministic) { ::fusebox::conformance::check_deterministic(GetParam()); }     \
  TEST_P(Suite, EffectiveLr) { ::fusebox::conformance::check_effective_lr(GetParam()); }        \
  TEST_P(Suite, FollowsGroupLr) { ::fusebox::conformance::check_follows_group_lr(GetParam()); } \
  TEST_P(Suite, FollowsGroupWeightDecay) {                                                      \
    ::fusebox::conformance::check_follows_group_weight_decay(GetParam());                       \
  }                                                                                             \
  TEST_P(Suite, Dtypes) { ::fusebox::conformance::check_dtypes(GetParam()); }                   \
  TEST_P(Suite, NoGradientNoUpdate) {                                                           \
    ::fusebox::conformance::check_no_gradient_no_update(GetParam());                            \
  }                                                                                             \
  INSTANTIATE_TEST_SUITE_P(Plugin, Suite, ::testing::ValuesIn(targets),                         \
                           ::fusebox::conformance::test_name)

/// Instantiates the conformance tests as suite `Suite` for the plugin at `path`; further
/// arguments are its hyperparameters as "key=value" strings.
#define FUSEBOX_CONFORMANCE_TESTS(Suite, path, ...)                                  \
  FUSEBOX_CONFORMANCE_TESTS_FOR(Suite, (std::vector<::fusebox::conformance::Target>{ \
                                           ::fusebox::conformance::plugin(path, {__VA_ARGS__})}))
