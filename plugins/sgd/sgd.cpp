// SGD with momentum, dampening, Nesterov and L2 weight decay (torch.optim.SGD semantics).
#include <fusebox/sdk.h>

namespace {

class Sgd final : public fusebox::Optimizer {
 public:
  static void declare_schema(fusebox::Schema& s) {
    s.real("lr", 1e-3, "learning rate").above(0);
    s.real("momentum", 0.0, "momentum factor").at_least(0).below(1);
    s.real("dampening", 0.0, "dampening of the momentum").at_least(0).at_most(1);
    s.real("weight_decay", 0.0, "L2 penalty added to the gradient").at_least(0);
    s.flag("nesterov", false, "Nesterov momentum (needs momentum > 0 and dampening = 0)");
    s.rule("nesterov,momentum,dampening", "nesterov=true needs momentum > 0 and dampening = 0",
           [](const fusebox::HyperParams& h) -> std::string {
             if (h.flag("nesterov") && (h.real("momentum") <= 0 || h.real("dampening") != 0))
               return "nesterov needs momentum > 0 and dampening = 0";
             return "";
           });
    s.flag("stochastic_rounding", false, "round bf16 parameters stochastically on write-back");
  }

  Sgd(std::vector<fusebox::ParamGroup> groups, const fusebox::HyperParams& hp)
      : Optimizer(std::move(groups), hp),
        momentum_(hp.real("momentum")),
        dampening_(hp.real("dampening")),
        nesterov_(hp.flag("nesterov")),
        stochastic_(hp.flag("stochastic_rounding")) {}

 protected:
  void update_param(const at::Tensor& param, fusebox::ParamState& state, size_t group) override {
    at::Tensor p = fusebox::fp32_view(param);
    at::Tensor grad = param.grad().to(p.scalar_type());
    if (const double wd = weight_decay(group); wd != 0) grad = grad.add(p, wd);
    if (momentum_ != 0) {
      at::Tensor& buf = state["momentum_buffer"];
      if (!buf.defined())
        buf = grad.clone().detach();
      else
        buf.mul_(momentum_).add_(grad, 1 - dampening_);
      grad = nesterov_ ? grad.add(buf, momentum_) : buf;
    }
    ++state.step;
    p.add_(grad, -lr(group));
    fusebox::write_back(param, p, stochastic_, rounding_seed(param));
  }

 private:
  double momentum_, dampening_;
  bool nesterov_, stochastic_;
};

}  // namespace

FUSEBOX_PLUGIN(Sgd, "sgd", "1.0.0", "SGD with momentum, dampening, Nesterov and weight decay",
               fusebox::kSupportsStepParam)
