// Adam and AdamW share everything but where weight decay enters (torch.optim semantics):
// Adam adds wd·θ to the gradient (L2), AdamW shrinks θ by (1 - lr·wd) before the moments.
// CUDA parameters go through one fused kernel when the build has CUDA LibTorch
// (plugins/cuda/cuda_dispatch.h); everything else through the ATen ops below.
#pragma once

#include <fusebox/sdk.h>

#include "../cuda/cuda_dispatch.h"

namespace fusebox_plugins {

template <bool Decoupled>
class AdamFamily final : public fusebox::Optimizer {
 public:
  static void declare_schema(fusebox::Schema& s) {
    s.real("lr", 1e-3, "learning rate").above(0);
    s.real_pair("betas", {0.9, 0.999}, "decay of the first and second moments")
        .at_least(0)
        .below(1);
    s.real("eps", 1e-8, "added to the denominator").at_least(0);
    if (Decoupled)
      s.real("weight_decay", 1e-2, "decoupled weight decay: θ ← θ·(1 - lr·wd) before the moments")
          .at_least(0);
    else
      s.real("weight_decay", 0.0, "L2 penalty added to the gradient").at_least(0);
    s.flag("amsgrad", false, "use the running maximum of the second moment (AMSGrad)");
    s.flag("stochastic_rounding", false, "round bf16 parameters stochastically on write-back");
  }

  AdamFamily(std::vector<fusebox::ParamGroup> groups, const fusebox::HyperParams& hp)
      : Optimizer(std::move(groups), hp),
        beta1_(hp.real_pair("betas").first),
        beta2_(hp.real_pair("betas").second),
        eps_(hp.real("eps")),
        amsgrad_(hp.flag("amsgrad")),
        stochastic_(hp.flag("stochastic_rounding")) {}

 protected:
  void update_param(const at::Tensor& param, fusebox::ParamState& state, size_t group) override {
    if (cuda::adam_step(param, state, this->lr(group), beta1_, beta2_, eps_, weight_decay(group),
                        Decoupled, amsgrad_, stochastic_))
      return;
    at::Tensor p = fusebox::fp32_view(param);
    at::Tensor g = param.grad().to(p.scalar_type());
    if (state.step == 0) {
      state["exp_avg"] = at::zeros_like(p);
      state["exp_avg_sq"] = at::zeros_like(p);
      if (amsgrad_) state["max_exp_avg_sq"] = at::zeros_like(p);
    } else if (amsgrad_ && !state.tensors.count("max_exp_avg_sq")) {
      // amsgrad switched on when resuming: the maximum so far starts at the current average.
      state["max_exp_avg_sq"] = state["exp_avg_sq"].clone();
    }
    ++state.step;
    const double lr = this->lr(group), wd = weight_decay(group);
    if (wd != 0) {
      if (Decoupled)
        p.mul_(1.0 - lr * wd);
      else
        g = g.add(p, wd);
    }
    fusebox::adam_step_(p, g, state["exp_avg"], state["exp_avg_sq"],
                        amsgrad_ ? state["max_exp_avg_sq"] : at::Tensor(), state.step, lr, beta1_,
                        beta2_, eps_);
    fusebox::write_back(param, p, stochastic_, rounding_seed(param));
  }

 private:
  double beta1_, beta2_, eps_;
  bool amsgrad_, stochastic_;
};

}  // namespace fusebox_plugins
