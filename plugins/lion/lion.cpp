// Lion (Chen et al. 2023, lion-pytorch semantics): the sign of an interpolated momentum, with
// decoupled weight decay.
#include <fusebox/sdk.h>

namespace {

class Lion final : public fusebox::Optimizer {
 public:
  static void declare_schema(fusebox::Schema& s) {
    s.real("lr", 1e-4, "learning rate").above(0);
    s.real_pair("betas", {0.9, 0.99}, "(interpolation for the sign, momentum decay)")
        .at_least(0)
        .below(1);
    s.real("weight_decay", 0.0, "decoupled weight decay: θ ← θ·(1 - lr·wd)").at_least(0);
    s.flag("stochastic_rounding", false, "round bf16 parameters stochastically on write-back");
  }

  Lion(std::vector<fusebox::ParamGroup> groups, const fusebox::HyperParams& hp)
      : Optimizer(std::move(groups), hp),
        beta1_(hp.real_pair("betas").first),
        beta2_(hp.real_pair("betas").second),
        stochastic_(hp.flag("stochastic_rounding")) {}

 protected:
  void update_param(const at::Tensor& param, fusebox::ParamState& state, size_t group) override {
    at::Tensor p = fusebox::fp32_view(param);
    at::Tensor g = param.grad().to(p.scalar_type());
    at::Tensor& m = state["exp_avg"];
    if (state.step == 0) m = at::zeros_like(p);
    ++state.step;
    const double lr = this->lr(group);
    if (const double wd = weight_decay(group); wd != 0) p.mul_(1.0 - lr * wd);
    p.add_(m.mul(beta1_).add_(g, 1.0 - beta1_).sign_(), -lr);
    m.mul_(beta2_).add_(g, 1.0 - beta2_);
    fusebox::write_back(param, p, stochastic_, rounding_seed(param));
  }

 private:
  double beta1_, beta2_;
  bool stochastic_;
};

}  // namespace

FUSEBOX_PLUGIN(Lion, "lion", "1.0.0", "Lion: sign of interpolated momentum (Chen et al. 2023)",
               fusebox::kSupportsStepParam)
