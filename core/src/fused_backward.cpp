// Fused backward pass: each parameter is stepped the moment its gradient exists, then freed.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "step_mode_common.h"

namespace fusebox {

namespace {

class FusedBackward final : public detail::HookedStep {
 public:
  FusedBackward(std::shared_ptr<Optimizer> optimizer, StepOptions options)
      : HookedStep(std::move(options)), optimizers_{std::move(optimizer)} {
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    const Optimizer& opt = *optimizers_[0];
    for (size_t g = 0; g < opt.num_groups(); ++g)
      for (size_t i = 0; i < opt.group(g).params.size(); ++i) {
        params.push_back(opt.group(g).params[i]);
        names.push_back(opt.group(g).names[i]);
      }
    attach(params, names);
  }

  StepStats step() override {
    StepStats stats = finish_iteration();
    at::NoGradGuard no_grad;
    optimizers_[0]->finish_step();
    sharding_.broadcast(params_);
    return stats;
  }

  const std::vector<std::shared_ptr<Optimizer>>& optimizers() const override { return optimizers_; }
  std::string name() const override { return "fused"; }

 protected:
  void on_gradient(size_t i) override {
    if (sharding_.owns(i)) optimizers_[0]->step_param(params_[i]);
    params_[i].mutable_grad().reset();  // the point of it all: this gradient is gone now
  }

 private:
  std::vector<std::shared_ptr<Optimizer>> optimizers_;
};

}  // namespace

std::unique_ptr<StepMode> make_fused_backward(std::shared_ptr<Optimizer> optimizer,
                                              StepOptions options) {
  if (!optimizer) throw Error("make_fused_backward: no optimizer");
  detail::check_capabilities(*optimizer, "fused", options);
  if (options.non_finite == NonFinitePolicy::Skip)
    throw Error(
        "the fused backward pass cannot skip a step on non-finite gradients: parameters "
        "are already updated when a later gradient turns out non-finite; use the stop "
        "policy");
  if (detail::dynamic_scaling(options))
    throw Error(
        "the fused backward pass cannot use a dynamic loss scale: it skips an iteration whose "
        "gradients overflowed, after seeing all of them, when the fused pass has already applied "
        "the earlier ones; use a fixed scale (an overflow is then a non-finite gradient)");
  return std::make_unique<FusedBackward>(std::move(optimizer), std::move(options));
}

}  // namespace fusebox
