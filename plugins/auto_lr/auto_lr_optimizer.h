// What D-Adaptation and Prodigy share beside their algorithms: one step size d for all parameters,
// kept with the step count k as global state, checked before it is used, and reported as the
// effective lr.
#pragma once

#include <fusebox/sdk.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace fusebox_plugins {

class AutoLrOptimizer : public fusebox::Optimizer {
 public:
  /// The step size the last step applied (d before that step raised it, times lr and the bias
  /// correction); before any step, the first step's d0 * lr.
  double effective_lr(size_t g) const override {
    if (lr(g) == 0) return 0.0;
    // A global, so that it is saved: right after a resume it still names the last step's.
    const auto applied = globals().find("applied_dlr");
    if (applied != globals().end() && applied->second >= 0) return applied->second;
    const auto d = globals().find("d");
    return d == globals().end() ? 0.0 : d->second * lr(g);
  }

 protected:
  AutoLrOptimizer(std::vector<fusebox::ParamGroup> groups, const fusebox::HyperParams& hp,
                  std::string plugin)
      : Optimizer(std::move(groups), hp), plugin_(std::move(plugin)) {}

  /// The estimate d; loaded state is checked where it is first used (a cast of a bad k is
  /// undefined), so a step starts with this.
  double& checked_d() {
    double& d = globals()["d"];
    const double k = globals()["k"];
    if (!(d > 0) || !(k >= 0 && k <= 9e15 && k == std::floor(k)))
      throw fusebox::Error(plugin_ + ": its state holds d = " + std::to_string(d) +
                           " and k = " + std::to_string(k) +
                           " (d is above 0, k a whole step count): a corrupt or foreign state "
                           "dict; load one this plugin saved");
    return d;
  }
  /// Steps taken so far (k); after checked_d() a whole number.
  double& steps_taken() { return globals()["k"]; }
  /// The one lr all groups with a non-zero lr share.
  double shared_lr() const { return fusebox::shared_lr(*this, plugin_); }

 private:
  std::string plugin_;
};

}  // namespace fusebox_plugins
