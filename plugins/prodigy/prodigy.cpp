// Prodigy (Mishchenko & Defazio 2023, prodigyopt semantics): Adam whose step size d is estimated
// from the distance travelled from the initial parameters, over all parameters together.
#include <fusebox/sdk.h>

#include "../auto_lr/auto_lr_optimizer.h"

namespace {

class Prodigy final : public fusebox_plugins::AutoLrOptimizer {
 public:
  static void declare_schema(fusebox::Schema& s) {
    s.real("lr", 1.0, "multiplier of the estimated step size d (keep 1)").above(0);
    s.real_pair("betas", {0.9, 0.999}, "decay of the first and second moments")
        .at_least(0)
        .below(1);
    s.real("beta3", std::monostate{}, "decay of the d estimate's sums (none: sqrt(beta2))")
        .at_least(0)
        .below(1)
        .allow_none();
    s.real("eps", 1e-8, "added to the denominator (scaled by d)").at_least(0);
    s.real("weight_decay", 0.0, "weight decay (decoupled unless decouple=false)").at_least(0);
    s.flag("decouple", true, "AdamW-style decoupled weight decay");
    s.flag("use_bias_correction", false, "Adam bias correction folded into the step size");
    s.flag("safeguard_warmup", false, "leave lr out of the denominator sum s (for warm-up)");
    s.real("d0", 1e-6, "initial estimate of d").above(0);
    s.real("d_coef", 1.0, "multiplier of the estimated d").above(0);
    s.real("growth_rate", std::numeric_limits<double>::infinity(),
           "largest factor by which d may grow per step (inf: unlimited)")
        .at_least(1)
        .at_most(std::numeric_limits<double>::infinity());
    s.integer("slice_p", 1, "estimate d from every slice_p-th element (saves memory)").at_least(1);
    s.flag("stochastic_rounding", false, "round bf16 parameters stochastically on write-back");
  }

  Prodigy(std::vector<fusebox::ParamGroup> groups, const fusebox::HyperParams& hp)
      : AutoLrOptimizer(std::move(groups), hp, "prodigy"),
        beta1_(hp.real_pair("betas").first),
        beta2_(hp.real_pair("betas").second),
        beta3_(hp.is_set("beta3") ? hp.real("beta3") : std::sqrt(beta2_)),
        eps_(hp.real("eps")),
        d0_(hp.real("d0")),
        d_coef_(hp.real("d_coef")),
        growth_rate_(hp.real("growth_rate")),
        slice_(hp.integer("slice_p")),
        decouple_(hp.flag("decouple")),
        bias_correction_(hp.flag("use_bias_correction")),
        safeguard_(hp.flag("safeguard_warmup")),
        stochastic_(hp.flag("stochastic_rounding")) {
    globals() = {{"d", d0_}, {"d_max", d0_}, {"d_hat", 0.0}, {"d_numerator", 0.0}, {"k", 0.0}};
  }

  void step() override {
    at::NoGradGuard no_grad;
    double& d = checked_d();
    double& k = steps_taken();
    check_loaded_slices();
    const double lr = shared_lr();
    const int64_t step = static_cast<int64_t>(k) + 1;
    const double bc = fusebox::adam_bias_factor(bias_correction_, beta1_, beta2_, step);
    const double dlr = d * lr * bc;

    // Pass 1: moments, s, and the sums for d, accumulated on the device (one host sync).
    at::Tensor num, den;
    for (size_t gi = 0; gi < num_groups(); ++gi)
      for (size_t i = 0; i < group(gi).params.size(); ++i) {
        const at::Tensor& param = group(gi).params[i];
        if (!param.grad().defined()) continue;
        fusebox::ParamState& st = state(gi, i);
        at::Tensor p = fusebox::fp32_view(param);
        at::Tensor g = grad_of(param, p, gi);
        at::Tensor ps = sliced(p);
        if (st.step == 0) {
          st["s"] = at::zeros({ps.numel()}, ps.options());
          st["p0"] = ps.clone(at::MemoryFormat::Contiguous);
          st["exp_avg_sq"] = at::zeros_like(p);
        }
        // Also when β1 > 0 meets state saved with β1 = 0 (a resume that switched it on).
        if (beta1_ > 0 && !st["exp_avg"].defined()) st["exp_avg"] = at::zeros_like(p);
        if (this->lr(gi) == 0) continue;
        at::Tensor gs = sliced(g);
        at::Tensor term = at::dot(gs, st["p0"] - ps).to(at::kDouble).mul_((d / d0_) * dlr);
        if (beta1_ > 0) st["exp_avg"].mul_(beta1_).add_(g, d * (1 - beta1_));
        st["exp_avg_sq"].mul_(beta2_).addcmul_(g, g, d * d * (1 - beta2_));
        at::Tensor& s = st["s"];
        s.mul_(beta3_).add_(gs, (d / d0_) * (safeguard_ ? d : dlr));
        at::Tensor norm = s.abs().sum().to(at::kDouble);
        if (!num.defined()) num = at::full({}, beta3_ * globals()["d_numerator"], term.options());
        num.add_(term.to(num.device()));
        den = den.defined() ? den.add_(norm.to(den.device())) : norm;
      }
    if (!num.defined()) return;
    at::Tensor sums = at::stack({num, den}).cpu();
    const double numerator = sums[0].item<double>(), denominator = sums[1].item<double>();
    if (denominator == 0) return;
    const double d_hat = d_coef_ * numerator / denominator;
    double& d_max = globals()["d_max"];
    if (d == d0_) d = std::max(d, d_hat);
    d_max = std::max(d_max, d_hat);
    d = std::min(d_max, d * growth_rate_);
    globals()["d_hat"] = d_hat;
    globals()["d_numerator"] = numerator;

    // What this step applies (the early returns above apply nothing).
    globals()["applied_dlr"] = dlr;
    // Pass 2: the Adam step with the new d in the denominator and the old dlr as step size.
    for (size_t gi = 0; gi < num_groups(); ++gi)
      for (size_t i = 0; i < group(gi).params.size(); ++i) {
        const at::Tensor& param = group(gi).params[i];
        if (!param.grad().defined()) continue;
        fusebox::ParamState& st = state(gi, i);
        ++st.step;
        // A group at lr 0 is frozen: its moments were never fed (pass 1), and the shared dlr
        // would still move it (β1 = 0 divides its gradient by d·eps) or decay it.
        if (this->lr(gi) == 0) continue;
        at::Tensor p = fusebox::fp32_view(param);
        at::Tensor denom = st["exp_avg_sq"].sqrt().add_(d * eps_);
        if (beta1_ == 0) {
          at::Tensor g = grad_of(param, p, gi);  // before the decoupled decay changes p
          if (weight_decay(gi) != 0 && decouple_) p.mul_(1 - weight_decay(gi) * dlr);
          p.addcdiv_(g, denom, -dlr * d);
        } else {
          if (weight_decay(gi) != 0 && decouple_) p.mul_(1 - weight_decay(gi) * dlr);
          p.addcdiv_(st["exp_avg"], denom, -dlr);
        }
        fusebox::write_back(param, p, stochastic_, rounding_seed(param));
      }
    k += 1;
    finish_step();
  }

 private:
  // The gradient in p's dtype, with coupled (L2) weight decay when asked.
  at::Tensor grad_of(const at::Tensor& param, const at::Tensor& p, size_t gi) const {
    at::Tensor g = param.grad().to(p.scalar_type());
    const double wd = weight_decay(gi);
    return wd != 0 && !decouple_ ? g.add(p, wd) : g;
  }
  // State saved with another slice_p holds another number of samples (s, p0): refused, naming
  // the parameter, before any state changes (p0, the starting point, cannot be sampled again).
  void check_loaded_slices() const {
    for (size_t gi = 0; gi < num_groups(); ++gi)
      for (size_t i = 0; i < group(gi).params.size(); ++i) {
        const fusebox::ParamState& st = state(gi, i);
        if (st.step == 0) continue;
        const int64_t n = group(gi).params[i].numel(), samples = (n + slice_ - 1) / slice_;
        for (const auto& [key, need] :
             {std::pair<const char*, int64_t>{"s", samples}, {"p0", samples}, {"exp_avg_sq", n}}) {
          const auto it = st.tensors.find(key);
          const int64_t have =
              it == st.tensors.end() || !it->second.defined() ? -1 : it->second.numel();
          if (have != need)
            throw fusebox::Error(
                "prodigy: the state '" + std::string(key) + "' of parameter '" +
                group(gi).names[i] + "' holds " +
                (have < 0 ? std::string("nothing") : std::to_string(have) + " values") + ", " +
                std::to_string(need) + " expected with slice_p=" + std::to_string(slice_) +
                ": resume with the slice_p the state was saved with");
        }
      }
  }
  // Every slice_p-th element of x, flattened.
  at::Tensor sliced(const at::Tensor& x) const {
    return x.reshape(-1).slice(0, 0, x.numel(), slice_);
  }

  double beta1_, beta2_, beta3_, eps_, d0_, d_coef_, growth_rate_;
  int64_t slice_;
  bool decouple_, bias_correction_, safeguard_, stochastic_;
};

}  // namespace

FUSEBOX_PLUGIN(Prodigy, "prodigy", "1.0.0",
               "Prodigy: learning-rate-free Adam estimating d from the distance travelled",
               fusebox::kAutoLr)
