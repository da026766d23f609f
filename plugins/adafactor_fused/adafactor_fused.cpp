// Adafactor (Shazeer & Stern 2018) with Hugging Face transformers' semantics: relative step,
// parameter scaling, factored second moment over the last two dims, update clipping, optional
// first moment and decoupled weight decay. Factored CUDA parameters go through the CUDA kernels
// when the build has CUDA LibTorch (plugins/cuda/cuda_dispatch.h); everything else through ATen.
#include <fusebox/sdk.h>

#include "../cuda/cuda_dispatch.h"

namespace {

class Adafactor final : public fusebox::Optimizer {
 public:
  static void declare_schema(fusebox::Schema& s) {
    s.real("lr", std::monostate{}, "external learning rate (only with relative_step=false)")
        .above(0)
        .allow_none();
    s.real_pair("eps", {1e-30, 1e-3}, "(eps1 added to g², eps2 floor of the parameter RMS)")
        .at_least(0);
    s.real("clip_threshold", 1.0, "update RMS above this is scaled down to it").above(0);
    s.real("decay_rate", -0.8, "beta2 at step t is 1 - t^decay_rate").below(0);
    s.real("beta1", std::monostate{}, "first-moment decay (none: no first moment)")
        .at_least(0)
        .below(1)
        .allow_none();
    s.real("weight_decay", 0.0, "decoupled weight decay, scaled by the step size").at_least(0);
    s.flag("scale_parameter", true, "scale the step size by the parameter's RMS");
    s.flag("relative_step", true, "step size min(1e-2, 1/sqrt(t)) instead of lr");
    s.flag("warmup_init", false, "relative step grows as 1e-6·t (needs relative_step)");
    s.flag("stochastic_rounding", false, "round bf16 parameters stochastically on write-back");
    s.rule("lr,relative_step", "an lr exactly when relative_step=false",
           [](const fusebox::HyperParams& h) -> std::string {
             if (h.is_set("lr") && h.flag("relative_step"))
               return "lr cannot be given with relative_step=true (set relative_step=false)";
             if (!h.is_set("lr") && !h.flag("relative_step"))
               return "relative_step=false needs an lr";
             return "";
           });
    // eps2 = 0 only lets a zero parameter stay put; eps1 = 0 divides by a zero row or column
    // of squared gradients, and one such row turns the whole update into NaN.
    s.rule("eps", "eps1 above 0", [](const fusebox::HyperParams& h) -> std::string {
      if (h.real_pair("eps").first <= 0)
        return "eps1 (the first of eps) must be above 0: a zero gradient row would make NaN";
      return "";
    });
    s.rule("warmup_init,relative_step", "warmup_init=true only with relative_step=true",
           [](const fusebox::HyperParams& h) -> std::string {
             if (h.flag("warmup_init") && !h.flag("relative_step"))
               return "warmup_init=true needs relative_step=true";
             return "";
           });
  }

  Adafactor(std::vector<fusebox::ParamGroup> groups, const fusebox::HyperParams& hp)
      : Optimizer(std::move(groups), hp),
        eps1_(hp.real_pair("eps").first),
        eps2_(hp.real_pair("eps").second),
        clip_(hp.real("clip_threshold")),
        decay_rate_(hp.real("decay_rate")),
        beta1_(hp.is_set("beta1") ? hp.real("beta1") : -1.0),
        scale_(hp.flag("scale_parameter")),
        relative_(hp.flag("relative_step")),
        warmup_(hp.flag("warmup_init")),
        stochastic_(hp.flag("stochastic_rounding")) {}

  /// Alpha of the group's first parameter at its last step (its next step's if none yet).
  double effective_lr(size_t g) const override {
    if (group(g).params.empty()) return lr(g);
    const fusebox::ParamState& st = state(g, 0);
    double rho = relative_step_size(std::max<int64_t>(st.step, 1), g);
    if (!scale_) return rho;
    auto it = st.tensors.find("RMS");
    at::Tensor r =
        it != st.tensors.end() ? it->second : fusebox::rms(fusebox::fp32_view(group(g).params[0]));
    return rho * std::max(eps2_, r.item<double>());
  }

 protected:
  void update_param(const at::Tensor& param, fusebox::ParamState& state, size_t group) override {
    const int64_t next = state.step + 1;
    if (fusebox_plugins::cuda::adafactor_factored_step(
            param, state, eps1_, eps2_, clip_, beta2_at(next), relative_step_size(next, group),
            beta1_, weight_decay(group), scale_, stochastic_))
      return;
    at::Tensor p = fusebox::fp32_view(param);
    at::Tensor g = param.grad().to(p.scalar_type());
    const bool factored = p.dim() >= 2;
    if (state.step == 0) {
      if (factored)
        std::tie(state["exp_avg_sq_row"], state["exp_avg_sq_col"]) = fusebox::factored_zeros(p);
      else
        state["exp_avg_sq"] = at::zeros_like(p);
    }
    // Also when beta1 meets state saved without a first moment (a resume that switched it on).
    if (beta1_ >= 0 && !state["exp_avg"].defined()) state["exp_avg"] = at::zeros_like(p);
    const int64_t t = ++state.step;
    at::Tensor rms = state["RMS"] = fusebox::rms(p);
    const double rho = relative_step_size(t, group);
    const double beta2t = beta2_at(t);

    at::Tensor u = g.square().add_(eps1_);
    fusebox::second_moment_update_(u, g, state, factored, beta2t, clip_);
    // alpha = rho * max(eps2, RMS), kept on the device.
    at::Tensor alpha = scale_ ? rms.clamp_min(eps2_).mul_(rho) : at::Tensor();
    if (scale_)
      u.mul_(alpha);
    else
      u.mul_(rho);
    if (beta1_ >= 0) u = state["exp_avg"].mul_(beta1_).add_(u, 1.0 - beta1_);
    if (const double wd = weight_decay(group); wd != 0) {
      if (scale_)
        p.mul_(alpha.mul(-wd).add_(1.0));
      else
        p.mul_(1.0 - wd * rho);
    }
    p.sub_(u);
    fusebox::write_back(param, p, stochastic_, rounding_seed(param));
  }

 private:
  double beta2_at(int64_t t) const { return 1.0 - std::pow(static_cast<double>(t), decay_rate_); }

  double relative_step_size(int64_t t, size_t g) const {
    if (!relative_) return lr(g);
    const double td = static_cast<double>(t);
    return std::min(warmup_ ? 1e-6 * td : 1e-2, 1.0 / std::sqrt(td));
  }

  double eps1_, eps2_, clip_, decay_rate_, beta1_;
  bool scale_, relative_, warmup_, stochastic_;
};

}  // namespace

FUSEBOX_PLUGIN(Adafactor, "adafactor", "1.0.0",
               "Adafactor with Hugging Face semantics (factored second moment, relative step)",
               fusebox::kSupportsStepParam)
