// CAME (Luo et al. 2023, came-pytorch semantics): Adafactor's factored second moment with a
// constant beta2, a first moment of the clipped update and, for factored parameters, a
// confidence-guided factored scale on that moment.
#include <fusebox/sdk.h>

namespace {

class Came final : public fusebox::Optimizer {
 public:
  static void declare_schema(fusebox::Schema& s) {
    s.real("lr", std::monostate{}, "learning rate (required)").above(0).allow_none();
    // Both are divided by (through rsqrt): at 0, a zero gradient or a zero instability is NaN.
    s.real_pair("eps", {1e-30, 1e-16}, "(added to g², added to the instability)").above(0);
    s.real("clip_threshold", 1.0, "update RMS above this is scaled down to it").above(0);
    s.real_pair("betas", {0.9, 0.999}, "(first moment, second moment) decay").at_least(0).below(1);
    s.real("beta3", 0.9999, "decay of the instability statistics").at_least(0).below(1);
    s.real("weight_decay", 0.0, "decoupled weight decay: θ ← θ·(1 - lr·wd)").at_least(0);
    s.flag("stochastic_rounding", false, "round bf16 parameters stochastically on write-back");
    s.rule("lr", "an lr (its default is none)", [](const fusebox::HyperParams& h) -> std::string {
      return h.is_set("lr") ? "" : "came needs an lr (e.g. lr=1e-4)";
    });
  }

  Came(std::vector<fusebox::ParamGroup> groups, const fusebox::HyperParams& hp)
      : Optimizer(std::move(groups), hp),
        eps1_(hp.real_pair("eps").first),
        eps2_(hp.real_pair("eps").second),
        clip_(hp.real("clip_threshold")),
        beta1_(hp.real_pair("betas").first),
        beta2_(hp.real_pair("betas").second),
        beta3_(hp.real("beta3")),
        stochastic_(hp.flag("stochastic_rounding")) {}

 protected:
  void update_param(const at::Tensor& param, fusebox::ParamState& state, size_t group) override {
    at::Tensor p = fusebox::fp32_view(param);
    at::Tensor g = param.grad().to(p.scalar_type());
    const bool factored = p.dim() >= 2;
    if (state.step == 0) {
      state["exp_avg"] = at::zeros_like(p);
      if (factored) {
        std::tie(state["exp_avg_sq_row"], state["exp_avg_sq_col"]) = fusebox::factored_zeros(p);
        std::tie(state["exp_avg_res_row"], state["exp_avg_res_col"]) = fusebox::factored_zeros(p);
      } else {
        state["exp_avg_sq"] = at::zeros_like(p);
      }
    }
    ++state.step;
    at::Tensor u = g.square().add_(eps1_);
    fusebox::second_moment_update_(u, g, state, factored, beta2_, clip_);
    at::Tensor& m = state["exp_avg"];
    m.mul_(beta1_).add_(u, 1.0 - beta1_);
    if (factored) {
      // Instability (u - m)² + eps2, reusing u's storage, then its factored scale times m.
      u.sub_(m).square_().add_(eps2_);
      fusebox::factored_ema_(state["exp_avg_res_row"], state["exp_avg_res_col"], u, beta3_);
      fusebox::factored_rsqrt_out(u, state["exp_avg_res_row"], state["exp_avg_res_col"]);
      u.mul_(m);
    } else {
      u = m;
    }
    const double lr = this->lr(group);
    if (const double wd = weight_decay(group); wd != 0) p.mul_(1.0 - wd * lr);
    p.sub_(u, lr);
    fusebox::write_back(param, p, stochastic_, rounding_seed(param));
  }

 private:
  double eps1_, eps2_, clip_, beta1_, beta2_, beta3_;
  bool stochastic_;
};

}  // namespace

FUSEBOX_PLUGIN(Came, "came", "1.0.0", "CAME: confidence-guided factored adaptive moments",
               fusebox::kSupportsStepParam)
