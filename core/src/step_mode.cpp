// Normal stepping and the pieces shared by all modes (clipping, finiteness, statistics).
#include "fusebox/core/step_mode.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>

#include "fusebox/core/loss_scaler.h"

#include "fusebox/core/plugin_registry.h"
#include "step_mode_common.h"

namespace fusebox {

StepMode::~StepMode() = default;

void StepMode::backward(const at::Tensor& loss) { loss.backward(); }

at::Tensor clip_grad_norm_one(const at::Tensor& param, double max_norm) {
  at::Tensor norm = detail::grad_norm(param.grad());
  detail::clip_by_norm_(param, norm, max_norm);
  return norm;
}

namespace detail {

at::Tensor scaled_loss(const at::Tensor& loss, const StepOptions& o) {
  if (!o.loss_scaler || o.loss_scaler->scale() == 1) return loss;
  return loss * o.loss_scaler->scale();
}

double unscale_factor(const StepOptions& o) {
  if (!o.loss_scaler || o.loss_scaler->scale() == 1) return 0;
  return 1.0 / o.loss_scaler->scale();
}

bool dynamic_scaling(const StepOptions& o) { return o.loss_scaler && o.loss_scaler->dynamic(); }

std::string scale_hint(const StepOptions& o) {
  if (!o.loss_scaler || o.loss_scaler->scale() == 1) return "";
  char buf[96];
  std::snprintf(buf, sizeof buf, " (the loss was scaled by %g; a smaller scale may avoid it)",
                o.loss_scaler->scale());
  return buf;
}

std::function<void(const std::string&)> warner(const StepOptions& o) {
  if (o.warn) return o.warn;
  // One write per line: processes of a data-parallel job share stderr.
  return [](const std::string& m) { std::cerr << ("fusebox: warning: " + m + "\n") << std::flush; };
}

namespace {

// The L2 norm of a half host tensor, summed in double a slice at a time. LibTorch 1.13's own norm
// of a half tensor sums in half on the CPU (a million N(0, 1) values give 0.18x the true norm),
// and a float copy of the whole gradient would cost twice its size.
at::Tensor half_host_norm(const at::Tensor& grad) {
  const at::Tensor flat = grad.reshape({-1});
  constexpr int64_t kSlice = int64_t{1} << 16;
  double sum_sq = 0;
  for (int64_t s = 0; s < flat.numel(); s += kSlice) {
    const at::Tensor x = flat.narrow(0, s, std::min(kSlice, flat.numel() - s)).to(at::kDouble);
    sum_sq += at::dot(x, x).item<double>();
  }
  return at::scalar_tensor(std::sqrt(sum_sq), at::TensorOptions(at::kFloat));
}

}  // namespace

at::Tensor grad_norm(const at::Tensor& grad) {
  const at::ScalarType t = grad.scalar_type();
  if (grad.is_cpu() && grad.is_contiguous() && (t == at::kFloat || t == at::kDouble)) {
    const at::Tensor flat = grad.view({-1});
    return at::dot(flat, flat).sqrt_();
  }
  if (t == at::kHalf && grad.is_cpu()) return half_host_norm(grad);
  // On a GPU half and bfloat16 reductions sum in float; a float result keeps a half norm from
  // overflowing above 65504 (which would zero the gradient when clipping) and a bfloat16 one
  // from rounding to 8 bits. On the CPU the bfloat16 norm sums in float too: its result is only
  // widened (a float-result reduction would copy the whole gradient to float first).
  if (t == at::kHalf || t == at::kBFloat16)
    return grad.is_cpu() ? grad.norm().to(at::kFloat) : grad.norm(at::Scalar(2), at::kFloat);
  return grad.norm();
}

bool grad_is_finite(const at::Tensor& param) {
  return at::isfinite(param.grad()).all().item<bool>();
}

bool norm_says_finite(const at::Tensor& param, const at::Tensor& norm) {
  return norm_says_finite(param, norm.item<double>());
}

bool norm_says_finite(const at::Tensor& param, double norm) {
  if (std::isfinite(norm)) return true;
  // The sum of squares can overflow although every value is finite (fp16 easily; fp32 above
  // a norm of about 1.8e19).
  return grad_is_finite(param);
}

void clip_by_norm_(const at::Tensor& param, const at::Tensor& norm, double max_norm) {
  if (norm.is_cpu()) return clip_by_norm_(param, norm.item<double>(), max_norm);
  // torch.nn.utils.clip_grad_norm_'s rule: coef = max_norm / (norm + 1e-6), clamped to 1.
  at::Tensor coef = (max_norm / (norm + 1e-6)).clamp_max_(1.0);
  param.grad().mul_(coef);
}

void clip_by_norm_(const at::Tensor& param, double norm, double max_norm) {
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) param.grad().mul_(coef);
}

int64_t live_grad_bytes(const std::vector<at::Tensor>& params) {
  int64_t total = 0;
  for (const auto& p : params)
    if (p.grad().defined()) total += p.grad().numel() * p.grad().element_size();
  return total;
}

void check_capabilities(const Optimizer& optimizer, const std::string& mode,
                        const StepOptions& options) {
  const std::optional<PluginInfo> plugin = plugin_of(optimizer);
  if (!plugin) return;
  const std::string who = "plugin '" + plugin->name + "' (" + plugin->path.string() + ")";
  if (mode == "fused" && !(plugin->capabilities & kSupportsStepParam))
    throw Error(who +
                " cannot step in the fused backward pass: it does not declare "
                "supports_step_param (use the normal mode or optimizer groups)");
  const char* needs_one_step_size = nullptr;
  if (mode == "groups") needs_one_step_size = "optimizer groups";
  if (options.shard_optimizer_state && options.comm)
    needs_one_step_size = "sharded optimizer state";
  if (needs_one_step_size && (plugin->capabilities & kAutoLr))
    throw Error(std::string(needs_one_step_size) + " cannot be used with " + who +
                ": auto-LR optimizers (such as D-Adaptation and Prodigy) estimate one step size "
                "from all parameters");
}

at::Tensor stacked_norms(const std::vector<at::Tensor>& norms) {
  std::vector<at::Tensor> as_double;
  as_double.reserve(norms.size());
  for (const auto& n : norms) as_double.push_back(n.to(norms.front().device(), at::kDouble));
  return at::stack(as_double);
}

}  // namespace detail

namespace {

class NormalStep final : public StepMode {
 public:
  NormalStep(std::shared_ptr<Optimizer> optimizer, StepOptions options)
      : options_(std::move(options)),
        optimizers_{std::move(optimizer)},
        reducer_(options_.comm, options_.bucket_bytes) {
    for (size_t g = 0; g < optimizers_[0]->num_groups(); ++g)
      for (size_t i = 0; i < optimizers_[0]->group(g).params.size(); ++i) {
        params_.push_back(optimizers_[0]->group(g).params[i]);
        names_.push_back(optimizers_[0]->group(g).names[i]);
      }
    sharding_ = detail::StateSharding(options_, params_);
    // Data parallel: each gradient is final the moment it is accumulated; its bucket is launched
    // once complete, so averaging overlaps the rest of backward. Frozen parameters (no
    // requires_grad) are left alone, as in one process.
    reducer_.plan(params_);
    for (size_t i = 0; i < params_.size(); ++i)
      if (reducer_.averaged(i))
        hooks_.push_back(
            std::make_unique<compat::GradReadyHook>(params_[i], [this, i] { arrived(i); }));
  }

  void backward(const at::Tensor& loss) override {
    if (!reducer_.active()) return detail::scaled_loss(loss, options_).backward();
    // With gradient accumulation every micro-batch is averaged: avg(avg(g1) + g2) equals
    // avg(g1) + avg(g2) because avg(g1) is the same on every rank.
    error_ = nullptr;
    try {
      detail::scaled_loss(loss, options_).backward();
      reducer_.launch_rest();  // with zeros for what this rank did not produce
      reducer_.completed(/*wait=*/true);
    } catch (...) {
      std::exception_ptr original = error_ ? error_ : std::current_exception();
      error_ = nullptr;
      reducer_.abandon();
      for (auto& p : params_) p.mutable_grad().reset();
      std::rethrow_exception(original);  // the hook's own exception, not autograd's wrapper
    }
  }

  StepStats step() override {
    try {
      return step_and_free();
    } catch (...) {
      // Whatever threw (the plugin's step(), a warning callback, clipping out of memory), a
      // caller that goes on must not add the next iteration's gradients to these.
      for (auto& p : params_) p.mutable_grad().reset();
      throw;
    }
  }

  const std::vector<std::shared_ptr<Optimizer>>& optimizers() const override { return optimizers_; }
  std::string name() const override { return "normal"; }

 private:
  StepStats step_and_free() {
    at::NoGradGuard no_grad;
    StepStats stats;
    Optimizer& opt = *optimizers_[0];
    if (options_.track_grad_bytes) stats.peak_grad_bytes = detail::live_grad_bytes(params_);
    LossScaler* scaler = options_.loss_scaler.get();
    if (scaler) stats.loss_scale = scaler->scale();
    const double unscale = detail::unscale_factor(options_);
    // A dynamic scale must see every gradient: an overflow anywhere skips the whole iteration.
    const bool check = options_.check_finite || detail::dynamic_scaling(options_);
    // One norm per gradient serves the non-finite check, clipping and the statistics.
    std::vector<size_t> with_grad;
    std::vector<at::Tensor> norms;
    const bool want_norms = check || options_.max_grad_norm > 0 || options_.track_grad_norm;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].grad().defined()) continue;
      with_grad.push_back(i);
      if (unscale != 0) params_[i].grad().mul_(unscale);
      if (want_norms) norms.push_back(detail::grad_norm(params_[i].grad()));
    }
    if (norms.empty()) {
      update(opt);
      if (scaler) scaler->update(false);
      stats.params_stepped = static_cast<int64_t>(with_grad.size());
      return stats;
    }
    at::Tensor all = detail::stacked_norms(norms);
    at::Tensor total = all.norm();
    // A non-finite value always makes its norm non-finite: one sync for the common case; the
    // per-tensor look (which also clears fp16 norms that merely overflowed) only on suspicion.
    if (check && !at::isfinite(all).all().item<bool>()) {
      for (size_t k = 0; k < with_grad.size(); ++k) {
        const size_t i = with_grad[k];
        if (detail::norm_says_finite(params_[i], norms[k])) continue;
        if (detail::dynamic_scaling(options_)) {
          // An overflow of the scaled gradients: skip the iteration and lower the scale.
          opt.zero_grad(true);
          stats.skipped = stats.overflow = true;
          if (!scaler->update(true)) {
            char buf[160];
            std::snprintf(buf, sizeof buf,
                          "' is not finite at any loss scale: it overflowed at scale %g, and a "
                          "lower one would be below the minimum %g",
                          scaler->scale(), scaler->options().min_scale);
            throw NonFiniteError("the gradient of parameter '" + names_[i] + buf +
                                 "; no parameter was updated in this iteration");
          }
          return stats;
        }
        if (options_.non_finite == NonFinitePolicy::Skip) {
          detail::warner(options_)("non-finite gradient in parameter '" + names_[i] +
                                   "': this iteration's update was skipped");
          opt.zero_grad(true);
          stats.skipped = true;
          return stats;
        }
        throw NonFiniteError("non-finite gradient in parameter '" + names_[i] +
                             "'; no parameter was updated in this iteration" +
                             detail::scale_hint(options_));
      }
    }
    if (options_.max_grad_norm > 0) {
      if (options_.clip_per_tensor) {
        for (size_t k = 0; k < with_grad.size(); ++k)
          detail::clip_by_norm_(params_[with_grad[k]], norms[k], options_.max_grad_norm);
      } else {
        // Global clipping exactly as torch.nn.utils.clip_grad_norm_ does it.
        at::Tensor coef = (options_.max_grad_norm / (total + 1e-6)).clamp_max_(1.0);
        for (size_t i : with_grad) params_[i].grad().mul_(coef.to(params_[i].grad().scalar_type()));
      }
    }
    stats.grad_norm = total.item<double>();
    stats.params_stepped = static_cast<int64_t>(with_grad.size());
    update(opt);
    if (scaler) scaler->update(false);
    return stats;
  }

  // Data parallel: parameter i's gradient is final for this backward pass.
  void arrived(size_t i) {
    if (error_) return;
    try {
      if (!reducer_.arrived(i))
        throw Error("parameter '" + names_[i] +
                    "' received a second gradient within one backward pass (retain_graph, double "
                    "backward or reentrant checkpointing?); data-parallel averaging takes each "
                    "gradient once per backward pass");
    } catch (...) {
      error_ = std::current_exception();
      throw;
    }
  }

  // Steps (this rank's share of) the parameters, frees every gradient, shares the results.
  void update(Optimizer& opt) {
    sharding_.drop_foreign_grads(params_, 0, params_.size());
    opt.step();
    opt.zero_grad(true);
    sharding_.broadcast(params_);
  }

  StepOptions options_;
  std::vector<std::shared_ptr<Optimizer>> optimizers_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  detail::GradReducer reducer_;
  detail::StateSharding sharding_;
  std::vector<std::unique_ptr<compat::GradReadyHook>> hooks_;
  std::exception_ptr error_;  // the first hook failure of this backward pass
};

}  // namespace

std::unique_ptr<StepMode> make_normal_step(std::shared_ptr<Optimizer> optimizer,
                                           StepOptions options) {
  if (!optimizer) throw Error("make_normal_step: no optimizer");
  detail::check_capabilities(*optimizer, "normal", options);
  return std::make_unique<NormalStep>(std::move(optimizer), std::move(options));
}

std::unique_ptr<StepMode> make_step_mode(const ModeChoice& choice,
                                         const std::vector<ParamGroup>& groups,
                                         const OptimizerFactory& make, StepOptions options) {
  if (choice.name == "normal") return make_normal_step(make(groups), std::move(options));
  if (choice.name == "fused") return make_fused_backward(make(groups), std::move(options));
  if (choice.name == "groups")
    return make_optimizer_groups(groups, choice.groups, choice.split, make, std::move(options));
  throw Error("make_step_mode: unknown mode '" + choice.name + "' (normal, fused or groups)");
}

}  // namespace fusebox
