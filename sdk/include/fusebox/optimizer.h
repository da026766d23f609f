// fusebox SDK: the optimizer interface every plugin implements, in the spirit of torch::optim.
//
// An optimizer owns parameter groups (tensors + names + a learning rate) and per-parameter state.
// A per-parameter algorithm overrides only `update_param`; the base then provides both `step()`
// and `step_param()` through that one function, so the two are identical by construction.
// An algorithm that needs all gradients at once (auto-LR) overrides `step()` instead.
// State is saved and loaded keyed by parameter name, so it survives regrouping.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fusebox/error.h"
#include "fusebox/hyperparams.h"

namespace fusebox {

/// Parameters optimized together with one learning rate and one weight decay (as torch::optim's
/// param groups: biases and norms commonly get weight decay 0, embeddings a smaller lr).
struct ParamGroup {
  std::vector<at::Tensor> params;  ///< leaf tensors with requires_grad
  std::vector<std::string> names;  ///< one unique name per param (empty: "g<i>.p<j>" are made up)
  double lr = std::numeric_limits<double>::quiet_NaN();  ///< NaN: use the "lr" hyperparameter
  /// NaN: use the "weight_decay" hyperparameter (0 for a plugin without one).
  double weight_decay = std::numeric_limits<double>::quiet_NaN();
};

/// Per-parameter state: a step count and named tensors (moments, factored statistics, ...).
struct ParamState {
  int64_t step = 0;                           ///< updates applied to this parameter so far
  std::map<std::string, at::Tensor> tensors;  ///< named state tensors
  /// The state tensor `key` (undefined until assigned).
  at::Tensor& operator[](const std::string& key) { return tensors[key]; }
};

/// A flat, name-keyed snapshot of optimizer state: "<param>/<key>" and "@optimizer/<key>".
using StateDict = std::map<std::string, at::Tensor>;

/// The interface a plugin's optimizer implements.
class FUSEBOX_VISIBLE Optimizer {
 public:
  /// Takes the groups and validated hyperparameters (a group's NaN lr becomes hyperparameter lr,
  /// its NaN weight_decay hyperparameter weight_decay).
  Optimizer(std::vector<ParamGroup> groups, HyperParams hyperparams)
      : groups_(std::move(groups)), hp_(std::move(hyperparams)) {
    std::unordered_map<std::string, Slot> by_name;
    for (size_t g = 0; g < groups_.size(); ++g) {
      ParamGroup& group = groups_[g];
      if (std::isnan(group.lr)) group.lr = hp_.is_set("lr") ? hp_.real("lr") : 0.0;
      if (std::isnan(group.weight_decay))
        group.weight_decay = numeric_or_zero_(hp_, "weight_decay");
      else if (!(group.weight_decay >= 0) || !std::isfinite(group.weight_decay))
        throw Error("parameter group " + std::to_string(g) + " has weight decay " +
                    std::to_string(group.weight_decay) + ": a group's own must be finite and >= 0");
      if (group.names.empty())
        for (size_t i = 0; i < group.params.size(); ++i)
          group.names.push_back("g" + std::to_string(g) + ".p" + std::to_string(i));
      if (group.names.size() != group.params.size())
        throw Error("parameter group " + std::to_string(g) + " has " +
                    std::to_string(group.params.size()) + " tensors but " +
                    std::to_string(group.names.size()) + " names");
      states_.emplace_back(group.params.size());
      for (size_t i = 0; i < group.params.size(); ++i) {
        if (!slots_.emplace(group.params[i].unsafeGetTensorImpl(), Slot{g, i}).second)
          throw Error("parameter '" + group.names[i] + "' appears twice in the optimizer");
        // State dicts are keyed by name: two parameters of one name would share (and lose) state.
        const auto [it, fresh] = by_name.emplace(group.names[i], Slot{g, i});
        if (!fresh)
          throw Error("parameter name '" + group.names[i] + "' is given to two parameters (group " +
                      std::to_string(it->second.group) + " #" + std::to_string(it->second.index) +
                      " and group " + std::to_string(g) + " #" + std::to_string(i) +
                      "): optimizer state and checkpoints are keyed by name, so each parameter "
                      "needs its own");
      }
    }
  }
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// Updates every parameter that has a gradient, then runs finish_step(). Overrides must
  /// disable grad mode themselves (at::NoGradGuard).
  virtual void step() {
    at::NoGradGuard no_grad;
    for (size_t g = 0; g < groups_.size(); ++g)
      for (size_t i = 0; i < groups_[g].params.size(); ++i)
        if (groups_[g].params[i].grad().defined()) updated(g, i);
    finish_step();
  }

  /// Updates one parameter from its gradient (needs the supports_step_param capability).
  void step_param(const at::Tensor& param) {
    Slot s = locate(param);
    if (!param.grad().defined()) return;
    at::NoGradGuard no_grad;
    updated(s.group, s.index);
  }

  /// Runs after the last parameter of a step (for algorithms with a phase after all updates).
  virtual void finish_step() {}

  /// Clears gradients: frees them (set_to_none) or zeroes them in place.
  void zero_grad(bool set_to_none = true) {
    for (auto& group : groups_)
      for (auto& p : group.params) {
        if (!p.grad().defined()) continue;
        if (set_to_none) {
          p.mutable_grad().reset();
        } else {
          p.mutable_grad().detach_();
          p.mutable_grad().zero_();
        }
      }
  }

  /// Number of parameter groups.
  size_t num_groups() const { return groups_.size(); }
  /// Group `g` (parameters, names, lr).
  const ParamGroup& group(size_t g) const { return groups_.at(g); }
  /// The learning rate of group `g`, as a scheduler sets it.
  double lr(size_t g) const { return groups_.at(g).lr; }
  /// Sets the learning rate of group `g` (schedulers call this).
  void set_lr(size_t g, double lr) { groups_.at(g).lr = lr; }
  /// The weight decay of group `g` (the group's own, else the "weight_decay" hyperparameter):
  /// plugins read this rather than the hyperparameter, so that groups can differ.
  double weight_decay(size_t g) const { return groups_.at(g).weight_decay; }
  /// The step size actually applied in group `g` (Adafactor's alpha, auto-LR's d*lr).
  virtual double effective_lr(size_t g) const { return lr(g); }
  /// The validated hyperparameters this optimizer was built with.
  const HyperParams& hyperparams() const { return hp_; }
  /// True when `param` belongs to this optimizer.
  bool owns(const at::Tensor& param) const {
    return slots_.count(param.unsafeGetTensorImpl()) != 0;
  }

  /// Snapshot of all state, keyed by parameter name; tensors alias the live state.
  StateDict state_dict() const {
    StateDict out;
    for (size_t g = 0; g < groups_.size(); ++g)
      for (size_t i = 0; i < groups_[g].params.size(); ++i) {
        const ParamState& st = states_[g][i];
        if (st.step == 0 && st.tensors.empty()) continue;
        const std::string& name = groups_[g].names[i];
        out[name + "/step"] = scalar_tensor_(static_cast<double>(st.step));
        out[name + "/@param"] = param_signature_(groups_[g].params[i]);
        for (const auto& kv : st.tensors) {
          check_state_key_(name, kv.first);
          if (kv.second.defined()) out[name + "/" + kv.first] = kv.second;
        }
      }
    for (const auto& kv : globals_) out["@optimizer/" + kv.first] = scalar_tensor_(kv.second);
    return out;
  }

  /// Restores the entries of `dict` that belong to this optimizer's parameters (others are
  /// ignored, so a dict saved with other grouping loads group by group); a parameter without
  /// entries starts afresh. State tensors are copied onto each parameter's device. State saved for
  /// a parameter of another shape or float width (another model's state), a bad step count, a
  /// global scalar that is not finite or a malformed entry throws Error naming the entry, and the
  /// optimizer keeps the state it had.
  void load_state_dict(const StateDict& dict) {
    std::unordered_map<std::string, Slot> by_name;  // a local: the layout stays as plugins know it
    for (size_t g = 0; g < groups_.size(); ++g)
      for (size_t i = 0; i < groups_[g].names.size(); ++i)
        by_name.emplace(groups_[g].names[i], Slot{g, i});
    // Built aside and swapped in at the end, so that a throw (a bad entry, or a copy that fails
    // for lack of device memory) leaves the optimizer as it was.
    std::vector<std::vector<ParamState>> states;
    for (const auto& group : groups_) states.emplace_back(group.params.size());
    std::map<std::string, double> globals;
    const std::string gp = "@optimizer/";
    for (const auto& [key, value] : dict) {
      if (key.rfind(gp, 0) == 0) {
        const double v = scalar_value_(value, key);
        if (!std::isfinite(v))
          throw Error("optimizer state '" + key + "' is " + std::to_string(v) +
                      ": saved scalars are finite (a corrupt state dict, or one saved after the "
                      "run diverged); load an earlier one");
        globals[key.substr(gp.size())] = v;
        continue;
      }
      const size_t slash = key.rfind('/');  // state keys hold no '/'; parameter names may
      if (slash == std::string::npos) continue;
      const auto owner = by_name.find(key.substr(0, slash));
      if (owner == by_name.end()) continue;
      const std::string sub = key.substr(slash + 1);
      const at::Tensor& param = groups_[owner->second.group].params[owner->second.index];
      ParamState& st = states[owner->second.group][owner->second.index];
      if (sub == "step") {
        st.step = step_count_(key, value);
      } else if (sub == "@param") {
        check_signature_(key, value, param);
      } else if (sub.empty() || sub[0] == '@' || !value.defined()) {
        // '@' keys are fusebox's own and only "@param" exists; a state dict never holds an
        // empty key or an undefined tensor (state_dict() leaves those out).
        throw Error("optimizer state '" + key + "' is not a state entry this version writes (" +
                    (value.defined() ? "malformed key" : "no tensor") +
                    "): a corrupt state dict, or one written by a newer fusebox");
      } else {
        st.tensors[sub] = copy_to_(value, param);
      }
    }
    states_ = std::move(states);
    globals_ = std::move(globals);
  }

 protected:
  /// The per-parameter algorithm: update `param` in place from `param.grad()`, using `state` and
  /// group `group`'s lr. Called with grad mode off. Per-parameter plugins override this.
  virtual void update_param(const at::Tensor& param, ParamState& state, size_t group) {
    (void)param, (void)state, (void)group;
    throw Error(
        "this optimizer does not override update_param, so it cannot update one parameter at a "
        "time: a plugin that declares supports_step_param must override it (or drop the "
        "capability and override step())");
  }

  /// State of parameter `i` in group `g`.
  ParamState& state(size_t g, size_t i) { return states_.at(g).at(i); }
  /// State of parameter `i` in group `g`, read-only (for const queries such as effective_lr).
  const ParamState& state(size_t g, size_t i) const { return states_.at(g).at(i); }
  /// Global scalar state saved with the optimizer (e.g. auto-LR's d); keep empty if unused.
  std::map<std::string, double>& globals() { return globals_; }
  /// Global scalar state, read-only.
  const std::map<std::string, double>& globals() const { return globals_; }
  /// Mutable access to groups, for algorithms overriding step().
  std::vector<ParamGroup>& groups() { return groups_; }

  /// A seed for the randomness of `param`'s current update (stochastic rounding: pass it to
  /// write_back). It depends only on the run's seed (at::manual_seed), the parameter's name and
  /// its step count, never on the order in which parameters are updated, so the normal loop, the
  /// fused backward pass, any grouping and a resumed run draw the same numbers.
  uint64_t rounding_seed(const at::Tensor& param) const {
    const Slot s = locate(param);
    const uint64_t run_seed = at::detail::getDefaultCPUGenerator().current_seed();
    uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of the name: the same in every process
    for (unsigned char c : groups_[s.group].names[s.index]) h = (h ^ c) * 0x100000001b3ull;
    return mix64_(mix64_(run_seed ^ h) + static_cast<uint64_t>(states_[s.group][s.index].step));
  }

 private:
  struct Slot {
    size_t group, index;
  };
  // update_param on parameter i of group g; a state tensor under a key a state dict cannot hold
  // ("step", "@...", "a/b") is refused at the first step, not when a checkpoint is written.
  void updated(size_t g, size_t i) {
    ParamState& st = states_[g][i];
    update_param(groups_[g].params[i], st, g);
    for (const auto& kv : st.tensors) check_state_key_(groups_[g].names[i], kv.first);
  }
  // "step" is the step count's key, "@..." the SDK's own, and '/' separates name and key.
  static void check_state_key_(const std::string& name, const std::string& key) {
    if (key == "step" || key.empty() || key[0] == '@' || key.find('/') != std::string::npos)
      throw Error("optimizer state of parameter '" + name + "': the tensor key '" + key +
                  "' is reserved or malformed ('step' is the step count, ParamState::step, "
                  "saved as <param>/step; keys starting with '@' are fusebox's own and '/' "
                  "separates parameter and key); give the tensor another name");
  }
  // "<param>/@param": an empty tensor of the parameter's dtype and shape [*param.sizes(), 0], so
  // that loading can tell another model's state from this one's without holding any data.
  static at::Tensor param_signature_(const at::Tensor& param) {
    std::vector<int64_t> sizes = param.sizes().vec();
    sizes.push_back(0);
    return at::empty(sizes, at::TensorOptions().dtype(param.scalar_type()));
  }
  static void check_signature_(const std::string& key, const at::Tensor& sig,
                               const at::Tensor& param) {
    const std::string name = key.substr(0, key.size() - 7);  // less "/@param"
    if (!sig.defined())
      throw Error("optimizer state '" + key + "' holds no tensor (a corrupt state dict?)");
    const auto saved = sig.dim() > 0 ? sig.sizes().slice(0, sig.dim() - 1) : sig.sizes();
    if (sig.dim() == 0 || saved != param.sizes())
      throw Error("optimizer state of parameter '" + name + "' was saved for shape " +
                  c10::str(saved) + ", this parameter has " + c10::str(param.sizes()) +
                  ": it is another model's state; load state saved from these parameters");
    // float32 <-> bf16/fp16 is a change of storage (the state stays float32); float64 state
    // meeting float32 parameters (or integer ones) is another run's.
    const at::ScalarType from = sig.scalar_type(), to = param.scalar_type();
    if (from != to && (from == at::kDouble || to == at::kDouble || !c10::isFloatingType(from) ||
                       !c10::isFloatingType(to)))
      throw Error("optimizer state of parameter '" + name + "' was saved for a " +
                  c10::toString(from) + " parameter, this one is " + c10::toString(to) +
                  ": load state saved with parameters of the same float width");
  }
  static int64_t step_count_(const std::string& key, const at::Tensor& t) {
    const double v = scalar_value_(t, key);
    if (!(v >= 0 && v <= 9e15 && v == std::floor(v)))
      throw Error("optimizer state '" + key + "' is " + std::to_string(v) +
                  ": a step count is a whole number >= 0 (a corrupt or foreign state dict?)");
    return static_cast<int64_t>(v);
  }
  Slot locate(const at::Tensor& param) const {
    auto it = slots_.find(param.unsafeGetTensorImpl());
    if (it == slots_.end()) throw Error("step_param: tensor is not a parameter of this optimizer");
    return it->second;
  }
  // A real or integer hyperparameter's value; 0 when unset, undeclared or of another type.
  static double numeric_or_zero_(const HyperParams& hp, const std::string& key) {
    if (!hp.is_set(key)) return 0.0;
    const Value& v = hp.value(key);
    if (const auto* d = std::get_if<double>(&v)) return *d;
    if (const auto* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
    return 0.0;
  }
  static uint64_t mix64_(uint64_t x) {  // splitmix64's finaliser: nearby inputs, unrelated outputs
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }
  static at::Tensor scalar_tensor_(double v);
  static double scalar_value_(const at::Tensor& t, const std::string& key);
  static at::Tensor copy_to_(const at::Tensor& t, const at::Tensor& like);

  std::vector<ParamGroup> groups_;
  HyperParams hp_;
  std::vector<std::vector<ParamState>> states_;
  std::unordered_map<const void*, Slot> slots_;
  std::map<std::string, double> globals_;
};

}  // namespace fusebox

inline at::Tensor fusebox::Optimizer::scalar_tensor_(double v) {
  return at::scalar_tensor(v, at::TensorOptions().dtype(at::kDouble));
}
inline double fusebox::Optimizer::scalar_value_(const at::Tensor& t, const std::string& key) {
  if (!t.defined() || t.numel() != 1)
    throw fusebox::Error("optimizer state '" + key + "' holds " +
                         (t.defined() ? std::to_string(t.numel()) + " values" : "no tensor") +
                         ", not one number (a corrupt or foreign state dict?)");
  return t.to(at::kCPU, at::kDouble).item<double>();
}
inline at::Tensor fusebox::Optimizer::copy_to_(const at::Tensor& t, const at::Tensor& like) {
  return t.to(like.device(), /*non_blocking=*/false, /*copy=*/true);
}
