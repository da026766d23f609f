// D-Adaptation for Adam (Defazio & Mishchenko 2023, the dadaptation package's DAdaptAdam): the
// step size d is estimated from all parameters together, so a step needs every gradient.
#include <fusebox/sdk.h>

#include "../auto_lr/auto_lr_optimizer.h"

namespace {

class DAdaptAdam final : public fusebox_plugins::AutoLrOptimizer {
 public:
  static void declare_schema(fusebox::Schema& s) {
    s.real("lr", 1.0, "multiplier of the estimated step size d (keep 1)").above(0);
    s.real_pair("betas", {0.9, 0.999}, "decay of the first and second moments")
        .at_least(0)
        .below(1);
    s.real("eps", 1e-8, "added to the denominator").at_least(0);
    s.real("weight_decay", 0.0, "weight decay (L2, or decoupled with decouple=true)").at_least(0);
    s.flag("decouple", false, "AdamW-style decoupled weight decay");
    s.flag("use_bias_correction", false, "Adam bias correction folded into the step size");
    s.real("d0", 1e-6, "initial estimate of d").above(0);
    s.real("growth_rate", std::numeric_limits<double>::infinity(),
           "largest factor by which d may grow per step (inf: unlimited)")
        .at_least(1)
        .at_most(std::numeric_limits<double>::infinity());
    s.flag("stochastic_rounding", false, "round bf16 parameters stochastically on write-back");
  }

  DAdaptAdam(std::vector<fusebox::ParamGroup> groups, const fusebox::HyperParams& hp)
      : AutoLrOptimizer(std::move(groups), hp, "dadaptation"),
        beta1_(hp.real_pair("betas").first),
        beta2_(hp.real_pair("betas").second),
        eps_(hp.real("eps")),
        growth_rate_(hp.real("growth_rate")),
        decouple_(hp.flag("decouple")),
        bias_correction_(hp.flag("use_bias_correction")),
        stochastic_(hp.flag("stochastic_rounding")) {
    globals() = {{"d", hp.real("d0")}, {"numerator_weighted", 0.0}, {"d_hat", 0.0}, {"k", 0.0}};
  }

  void step() override {
    at::NoGradGuard no_grad;
    double& d = checked_d();
    double& k = steps_taken();
    const double lr = shared_lr();
    const int64_t step = static_cast<int64_t>(k) + 1;
    const double bc = fusebox::adam_bias_factor(bias_correction_, beta1_, beta2_, step);
    const double dlr = d * lr * bc, sb = std::sqrt(beta2_);

    // Pass 1: moments, s, and the sums for d, accumulated on the device (one host sync).
    at::Tensor num, l1;
    for (size_t gi = 0; gi < num_groups(); ++gi)
      for (size_t i = 0; i < group(gi).params.size(); ++i) {
        const at::Tensor& param = group(gi).params[i];
        if (!param.grad().defined()) continue;
        fusebox::ParamState& st = state(gi, i);
        at::Tensor p = fusebox::fp32_view(param);
        at::Tensor g = param.grad().to(p.scalar_type());
        if (weight_decay(gi) != 0 && !decouple_) g = g.add(p, weight_decay(gi));
        if (st.step == 0)
          for (const char* key : {"s", "exp_avg", "exp_avg_sq"}) st[key] = at::zeros_like(p);
        if (this->lr(gi) == 0) continue;
        at::Tensor &s = st["s"], &v = st["exp_avg_sq"];
        at::Tensor sd = v.sqrt().add_(eps_);
        at::div_out(sd, s, sd);
        at::Tensor term = at::dot(g.reshape(-1), sd.reshape(-1)).to(at::kDouble).mul_(dlr);
        st["exp_avg"].mul_(beta1_).add_(g, dlr * (1 - beta1_));
        v.mul_(beta2_).addcmul_(g, g, 1 - beta2_);
        s.mul_(sb).add_(g, dlr * (1 - sb));
        at::Tensor norm = s.abs().sum().to(at::kDouble);
        num = num.defined() ? num.add_(term.to(num.device())) : term;
        l1 = l1.defined() ? l1.add_(norm.to(l1.device())) : norm;
      }
    if (!num.defined()) return;
    at::Tensor sums = at::stack({num, l1}).cpu();
    const double numerator = sums[0].item<double>(), sk_l1 = sums[1].item<double>();
    if (sk_l1 == 0) return;
    double& num_w = globals()["numerator_weighted"];
    num_w = sb * num_w + (1 - sb) * numerator;
    const double d_hat = num_w / ((1 - sb) * sk_l1);
    globals()["d_hat"] = d_hat;
    d = std::max(d, std::min(d_hat, d * growth_rate_));

    // What this step applies (the early returns above apply nothing).
    globals()["applied_dlr"] = dlr;
    // Pass 2: the Adam step with the moments (which already carry dlr).
    for (size_t gi = 0; gi < num_groups(); ++gi)
      for (size_t i = 0; i < group(gi).params.size(); ++i) {
        const at::Tensor& param = group(gi).params[i];
        if (!param.grad().defined()) continue;
        fusebox::ParamState& st = state(gi, i);
        ++st.step;
        // A group at lr 0 is frozen; the reference still decays it by the shared dlr.
        if (this->lr(gi) == 0) continue;
        at::Tensor p = fusebox::fp32_view(param);
        if (weight_decay(gi) != 0 && decouple_) p.mul_(1 - weight_decay(gi) * dlr);
        p.addcdiv_(st["exp_avg"], st["exp_avg_sq"].sqrt().add_(eps_), -1.0);
        fusebox::write_back(param, p, stochastic_, rounding_seed(param));
      }
    k += 1;
    finish_step();
  }

 private:
  double beta1_, beta2_, eps_, growth_rate_;
  bool decouple_, bias_correction_, stochastic_;
};

}  // namespace

FUSEBOX_PLUGIN(DAdaptAdam, "dadaptation", "1.0.0",
               "D-Adaptation Adam: learning-rate-free Adam (step size estimated as d)",
               fusebox::kAutoLr)
