// Internals shared by the step modes: per-gradient hooks with clipping, finiteness checks,
// once-per-iteration bookkeeping and error capture.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fusebox/core/step_mode.h"
#include "torch_compat.h"

namespace fusebox::detail {

/// The warning sink of `o` (stderr when unset).
std::function<void(const std::string&)> warner(const StepOptions& o);
/// True when `param.grad()` holds only finite values (one host sync).
bool grad_is_finite(const at::Tensor& param);
/// The same answer from the gradient's norm, already computed: a norm is finite exactly when
/// every value is, unless the sum of squares overflows, which only fp16 can do for sane
/// gradients (so fp16 is checked value by value). One host sync.
bool norm_says_finite(const at::Tensor& param, const at::Tensor& norm);
/// Scales `param.grad()` so its norm (given) is at most `max_norm` (clip_grad_norm_'s rule).
void clip_by_norm_(const at::Tensor& param, const at::Tensor& norm, double max_norm);
/// Bytes of all defined gradients of `params`.
int64_t live_grad_bytes(const std::vector<at::Tensor>& params);
/// sqrt of an accumulated sum of squares, or -1 when nothing was accumulated.
double finish_norm(const at::Tensor& sum_sq);
/// sum_sq += norm^2 (in double, on the norm's device).
void add_sq(at::Tensor& sum_sq, const at::Tensor& norm);

/// A mode that reacts to each gradient as soon as it is accumulated (fused and groups).
class HookedStep : public StepMode {
 public:
  void backward(const at::Tensor& loss) override;

 protected:
  explicit HookedStep(StepOptions options);
  /// Installs one hook per parameter; `names` label messages.
  void attach(const std::vector<at::Tensor>& params, const std::vector<std::string>& names);
  /// Called from the hook once `i`'s gradient is accumulated, checked and clipped.
  virtual void on_gradient(size_t i) = 0;
  /// End-of-iteration bookkeeping: warns (once each) about parameters that got no gradient,
  /// resets the per-iteration flags and returns the statistics gathered by the hooks.
  StepStats finish_iteration();
  /// True if parameter `i` received its gradient in this iteration.
  bool fired(size_t i) const { return fired_[i]; }

  StepOptions options_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;

 private:
  void ready(size_t i);
  std::vector<std::unique_ptr<compat::GradReadyHook>> hooks_;
  std::vector<bool> fired_, warned_;
  std::exception_ptr error_;
  at::Tensor sum_sq_;
  int64_t stepped_ = 0, peak_bytes_ = 0;
};

}  // namespace fusebox::detail
