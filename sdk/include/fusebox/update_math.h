// fusebox SDK: small numeric helpers shared by optimizer plugins, so none re-implements them.
// Every helper is device-agnostic and keeps scalars on the tensor's device (no host sync).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fusebox/optimizer.h"

namespace fusebox {

/// Root mean square of `x` as a 0-d tensor: ||x||_2 / sqrt(numel).
inline at::Tensor rms(const at::Tensor& x) {
  return x.norm() / std::sqrt(static_cast<double>(x.numel()));
}

/// 1 - beta^step, the usual Adam-style bias correction.
inline double bias_correction(double beta, int64_t step);

/// Adam's bias correction folded into a step size, sqrt(1 - beta2^t) / (1 - beta1^t), or 1 when
/// `enabled` is false (auto-LR algorithms' use_bias_correction).
inline double adam_bias_factor(bool enabled, double beta1, double beta2, int64_t step) {
  return enabled ? std::sqrt(bias_correction(beta2, step)) / bias_correction(beta1, step) : 1.0;
}

/// The one lr that every group with a non-zero lr shares (auto-LR algorithms estimate a single
/// step size); throws naming `plugin` when groups disagree.
inline double shared_lr(const Optimizer& opt, const std::string& plugin) {
  double lr = 0;
  for (size_t g = 0; g < opt.num_groups(); ++g) lr = std::max(lr, opt.lr(g));
  for (size_t g = 0; g < opt.num_groups(); ++g)
    if (opt.lr(g) != lr && opt.lr(g) != 0)
      throw Error(plugin + ": every parameter group needs the same lr (or 0)");
  return lr;
}

inline double bias_correction(double beta, int64_t step) {
  return 1.0 - std::pow(beta, static_cast<double>(step));
}

/// Zero row and column statistics of a factored second moment for `p` (>= 2 dims): shapes
/// p.shape[:-1] and p.shape[:-2] + p.shape[-1:], in `p`'s dtype and device.
inline std::pair<at::Tensor, at::Tensor> factored_zeros(const at::Tensor& p) {
  std::vector<int64_t> col(p.sizes().begin(), p.sizes().end() - 2);
  col.push_back(p.size(-1));
  return {at::zeros(p.sizes().slice(0, p.dim() - 1), p.options()), at::zeros(col, p.options())};
}

/// In place: row = beta·row + (1-beta)·mean_lastdim(q); col = beta·col + (1-beta)·mean_dim(-2)(q).
inline void factored_ema_(const at::Tensor& row, const at::Tensor& col, const at::Tensor& q,
                          double beta) {
  row.mul_(beta).add_(q.mean(-1), 1.0 - beta);
  col.mul_(beta).add_(q.mean(-2), 1.0 - beta);
}

/// Writes rsqrt(row / mean_lastdim(row))[..., :, None] · rsqrt(col)[..., None, :] into `out`
/// (Adafactor's factored estimate of 1/sqrt(E[g²])); `out` has the full parameter shape.
inline void factored_rsqrt_out(const at::Tensor& out, const at::Tensor& row,
                               const at::Tensor& col) {
  at::Tensor o = out;
  at::mul_out(o, row.div(row.mean(-1, /*keepdim=*/true)).rsqrt_().unsqueeze(-1),
              col.unsqueeze(-2).rsqrt());
}

/// Adam's moment updates and bias-corrected step (torch.optim semantics), all in place:
/// m = b1·m + (1-b1)·g; v = b2·v + (1-b2)·g²; vmax = max(vmax, v) when `vmax` is defined (AMSGrad);
/// p -= lr/(1-b1^t) · m / (sqrt(vmax or v)/sqrt(1-b2^t) + eps).
inline void adam_step_(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                       const at::Tensor& v, const at::Tensor& vmax, int64_t t, double lr, double b1,
                       double b2, double eps) {
  m.mul_(b1).add_(g, 1.0 - b1);
  v.mul_(b2).addcmul_(g, g, 1.0 - b2);
  if (vmax.defined()) {
    at::Tensor out = vmax;
    at::maximum_out(out, vmax, v);
  }
  at::Tensor denom = (vmax.defined() ? vmax : v).sqrt();
  denom.div_(std::sqrt(bias_correction(b2, t))).add_(eps);
  p.addcdiv_(m, denom, -lr / bias_correction(b1, t));
}

/// Adafactor's preconditioned update (shared by Adafactor and CAME). On entry `u` holds
/// g² + eps1; folds it into the second-moment statistics in `state` ("exp_avg_sq_row"/"_col" when
/// `factored`, else "exp_avg_sq") with weight 1 - beta2, then leaves u = g / sqrt(v̂) scaled down
/// so that rms(u) <= clip.
inline void second_moment_update_(const at::Tensor& u, const at::Tensor& g, ParamState& state,
                                  bool factored, double beta2, double clip) {
  if (factored) {
    factored_ema_(state["exp_avg_sq_row"], state["exp_avg_sq_col"], u, beta2);
    factored_rsqrt_out(u, state["exp_avg_sq_row"], state["exp_avg_sq_col"]);
  } else {
    state["exp_avg_sq"].mul_(beta2).add_(u, 1.0 - beta2);
    at::Tensor out = u;  // a handle to the same storage: rsqrt_out writes into u
    at::rsqrt_out(out, state["exp_avg_sq"]);
  }
  u.mul_(g).div_((rms(u) / clip).clamp_min_(1.0));
}

/// True for fp16 and bf16, whose updates are computed in fp32 and copied back.
inline bool is_low_precision(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}

/// The fp32 working copy of a low-precision tensor, or the tensor itself otherwise.
inline at::Tensor fp32_view(const at::Tensor& t) {
  return is_low_precision(t) ? t.to(at::kFloat) : t;
}

/// Writes fp32 `src` into bf16 `dst` with stochastic rounding: a uniform integer in [0, 2^16) is
/// added to the fp32 bit pattern and the low 16 bits are cleared, which rounds up with probability
/// equal to the discarded fraction (unbiased in expectation; exact values stay exact).
/// The noise comes from `generator`, or the default generator of `src`'s device when undefined.
inline void copy_stochastic_(const at::Tensor& dst, const at::Tensor& src,
                             const at::Generator& generator = {}) {
  TORCH_CHECK(dst.scalar_type() == at::kBFloat16 && src.scalar_type() == at::kFloat,
              "copy_stochastic_ needs a bf16 destination and an fp32 source");
  at::Tensor bits = src.contiguous().view(at::kInt);
  at::Tensor noise = at::empty_like(bits);
  if (generator.defined())
    noise.random_(0, 1 << 16, generator);
  else
    noise.random_(0, 1 << 16);
  at::Tensor rounded = (bits + noise).bitwise_and_(static_cast<int64_t>(-65536));
  dst.copy_(rounded.view(at::kFloat));
}

/// A generator of `device`'s kind seeded with `seed`, apart from the default one.
inline at::Generator seeded_generator(const at::Device& device, uint64_t seed) {
  at::Generator def = at::globalContext().defaultGenerator(device);
  at::Generator g;
  {
    std::lock_guard<std::mutex> lock(def.mutex());
    g = def.clone();
  }
  g.set_current_seed(seed);
  return g;
}

/// Writes the fp32 result `work` back into `param` if `param` is low precision: by stochastic
/// rounding for bf16 when `stochastic`, else round-to-nearest. No-op when `work` is `param`.
/// Inside an Optimizer pass `seed` = rounding_seed(param): the noise then does not depend on the
/// order of updates, so every step mode rounds alike. Without it the noise comes from the
/// device's default generator, in whatever order parameters are updated.
inline void write_back(const at::Tensor& param, const at::Tensor& work, bool stochastic,
                       std::optional<uint64_t> seed = std::nullopt) {
  if (work.is_same(param)) return;
  if (stochastic && param.scalar_type() == at::kBFloat16)
    copy_stochastic_(param, work, seed ? seeded_generator(work.device(), *seed) : at::Generator());
  else
    param.copy_(work);
}

}  // namespace fusebox
