// Heavy-ball momentum with decoupled weight decay: v <- mu * v + g;
// theta <- theta * (1 - lr * wd) - lr * v.
// It updates one parameter at a time, so it declares supports_step_param and runs in the fused
// backward pass and in optimizer groups.
#include <fusebox/sdk.h>

namespace {

class Momentum final : public fusebox::Optimizer {
 public:
  static void declare_schema(fusebox::Schema& s) {
    s.real("lr", 1e-2, "learning rate").above(0);
    s.real("momentum", 0.9, "momentum factor mu").at_least(0).below(1);
    s.real("weight_decay", 0.0, "decoupled weight decay: theta <- theta * (1 - lr * wd)")
        .at_least(0);
    s.flag("stochastic_rounding", false, "round bf16 parameters stochastically on write-back");
  }

  Momentum(std::vector<fusebox::ParamGroup> groups, const fusebox::HyperParams& hp)
      : Optimizer(std::move(groups), hp),
        momentum_(hp.real("momentum")),
        stochastic_(hp.flag("stochastic_rounding")) {}

 protected:
  void update_param(const at::Tensor& param, fusebox::ParamState& state, size_t group) override {
    at::Tensor p = fusebox::fp32_view(param);  // bf16/fp16 parameters are updated in fp32
    at::Tensor& velocity = state["velocity"];
    if (!velocity.defined()) velocity = at::zeros_like(p);
    velocity.mul_(momentum_).add_(param.grad().to(p.scalar_type()));
    // A group's own weight decay (e.g. 0 for biases), else the hyperparameter's.
    if (const double wd = weight_decay(group); wd != 0) p.mul_(1.0 - lr(group) * wd);
    p.add_(velocity, -lr(group));
    ++state.step;
    // The seed makes the rounding noise independent of the order of updates (fused, groups).
    fusebox::write_back(param, p, stochastic_, rounding_seed(param));
  }

 private:
  double momentum_;
  bool stochastic_;
};

}  // namespace

FUSEBOX_PLUGIN(Momentum, "momentum", "1.0.0", "Heavy-ball momentum (SDK example)",
               fusebox::kSupportsStepParam)
