// The hook machinery behind fused backward and optimizer groups.
#include <ATen/ATen.h>

#include "step_mode_common.h"

namespace fusebox::detail {

HookedStep::HookedStep(StepOptions options) : options_(std::move(options)) {}

void HookedStep::attach(const std::vector<at::Tensor>& params,
                        const std::vector<std::string>& names) {
  params_ = params;
  names_ = names;
  fired_.assign(params.size(), false);
  warned_.assign(params.size(), false);
  for (size_t i = 0; i < params.size(); ++i)
    hooks_.push_back(std::make_unique<compat::GradReadyHook>(params[i], [this, i] { ready(i); }));
}

void HookedStep::ready(size_t i) {
  const at::Tensor& param = params_[i];
  if (error_) {  // an earlier hook failed: update nothing more, free memory
    param.mutable_grad().reset();
    return;
  }
  try {
    if (fired_[i])
      throw Error("parameter '" + names_[i] +
                  "' received a second gradient within one backward pass (retain_graph, double "
                  "backward or reentrant checkpointing?); fused stepping updates each parameter "
                  "once per iteration");
    fired_[i] = true;
    if (!param.grad().defined()) return;
    if (options_.track_grad_bytes) peak_bytes_ = std::max(peak_bytes_, live_grad_bytes(params_));
    // One reduction serves the non-finite check, clipping and the statistics.
    at::Tensor norm;
    if (options_.check_finite || options_.max_grad_norm > 0 || options_.track_grad_norm)
      norm = param.grad().norm();
    if (options_.check_finite && !norm_says_finite(param, norm))
      throw NonFiniteError("non-finite gradient in parameter '" + names_[i] +
                           "' during the fused backward pass; it was not updated (parameters "
                           "updated earlier in this pass hold finite values)");
    if (options_.max_grad_norm > 0) clip_by_norm_(param, norm, options_.max_grad_norm);
    if (norm.defined()) add_sq(sum_sq_, norm);
    on_gradient(i);
  } catch (...) {
    error_ = std::current_exception();
    param.mutable_grad().reset();
    throw;
  }
}

void HookedStep::backward(const at::Tensor& loss) {
  error_ = nullptr;
  auto fail = [&]() {
    // The iteration is abandoned: free every gradient and forget what fired.
    for (auto& p : params_) p.mutable_grad().reset();
    fired_.assign(params_.size(), false);
    sum_sq_ = at::Tensor();
    stepped_ = 0;
  };
  try {
    loss.backward();
  } catch (...) {
    std::exception_ptr original = error_ ? error_ : std::current_exception();
    error_ = nullptr;
    fail();
    std::rethrow_exception(original);  // the plugin's own exception, not autograd's wrapper
  }
}

StepStats HookedStep::finish_iteration() {
  StepStats stats;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (fired_[i]) {
      ++stats.params_stepped;
    } else if (!warned_[i]) {
      warned_[i] = true;
      warner(options_)("parameter '" + names_[i] +
                       "' received no gradient in this iteration and was not updated (reported "
                       "once)");
    }
  }
  stats.grad_norm = finish_norm(sum_sq_);
  if (options_.track_grad_bytes) stats.peak_grad_bytes = peak_bytes_;
  fired_.assign(params_.size(), false);
  sum_sq_ = at::Tensor();
  peak_bytes_ = 0;
  return stats;
}

}  // namespace fusebox::detail
