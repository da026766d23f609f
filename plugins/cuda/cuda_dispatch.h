// The plugins' way to the CUDA kernels (update_kernels.h): the one place where plugin code touches
// CUDA LibTorch. Each function runs its update on the GPU and returns true when the parameter is a
// CUDA tensor the kernel handles (fp32, or bf16 rounded to nearest; dense, contiguous, with fp32
// state), and returns false otherwise, leaving the update to the plugin's ATen path. Built without
// FUSEBOX_WITH_CUDA (CPU LibTorch), every function returns false.
#pragma once

#include <fusebox/sdk.h>

#include <cmath>
#include <string>
#include <vector>

#if defined(FUSEBOX_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "update_kernels.h"
#endif

namespace fusebox_plugins::cuda {

#if defined(FUSEBOX_WITH_CUDA)

namespace detail {

/// The kernel's parameter type for `param` (with gradient `grad`), or false when the kernel does
/// not apply.
inline bool param_type(const at::Tensor& param, const at::Tensor& grad, bool stochastic,
                       ParamType& type) {
  if (!param.is_cuda() || !grad.defined() || grad.layout() != at::kStrided) return false;
  if (grad.scalar_type() != param.scalar_type() || grad.device() != param.device()) return false;
  if (!param.is_contiguous() || !grad.is_contiguous()) return false;
  if (param.scalar_type() == at::kFloat)
    type = ParamType::kFloat32;
  else if (param.scalar_type() == at::kBFloat16 && !stochastic)
    type = ParamType::kBFloat16;
  else
    return false;
  return true;
}

/// True when state tensor `key` exists as fp32, contiguous, on `param`'s device, `numel` long.
inline bool state_ok(fusebox::ParamState& state, const std::string& key, const at::Tensor& param,
                     int64_t numel) {
  auto it = state.tensors.find(key);
  if (it == state.tensors.end() || !it->second.defined()) return false;
  const at::Tensor& t = it->second;
  return t.scalar_type() == at::kFloat && t.device() == param.device() && t.is_contiguous() &&
         t.numel() == numel;
}

inline at::Tensor fp32_zeros(const at::Tensor& param, at::IntArrayRef sizes) {
  return at::zeros(sizes, param.options().dtype(at::kFloat));
}

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw fusebox::Error(std::string(what) + ": CUDA error: " + cudaGetErrorString(err));
}

}  // namespace detail

/// One Adam (decoupled=false) or AdamW step of `param` on the GPU; see the file comment.
/// On success the state holds "exp_avg", "exp_avg_sq" (and "max_exp_avg_sq") as the ATen path.
inline bool adam_step(const at::Tensor& param, fusebox::ParamState& state, double lr, double beta1,
                      double beta2, double eps, double weight_decay, bool decoupled, bool amsgrad,
                      bool stochastic) {
  ParamType type = ParamType::kFloat32;
  const at::Tensor& grad = param.grad();
  if (!detail::param_type(param, grad, stochastic, type)) return false;
  const int64_t n = param.numel();
  if (state.step == 0) {
    state["exp_avg"] = detail::fp32_zeros(param, param.sizes());
    state["exp_avg_sq"] = detail::fp32_zeros(param, param.sizes());
    if (amsgrad) state["max_exp_avg_sq"] = detail::fp32_zeros(param, param.sizes());
  } else if (!detail::state_ok(state, "exp_avg", param, n) ||
             !detail::state_ok(state, "exp_avg_sq", param, n) ||
             (amsgrad && !detail::state_ok(state, "max_exp_avg_sq", param, n))) {
    return false;
  }
  ++state.step;
  const AdamScalars s =
      make_adam_scalars(lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, state.step);
  const c10::cuda::CUDAGuard guard(param.device());
  detail::check(adam_step(type, param.data_ptr(), grad.data_ptr(),
                          state["exp_avg"].data_ptr<float>(), state["exp_avg_sq"].data_ptr<float>(),
                          amsgrad ? state["max_exp_avg_sq"].data_ptr<float>() : nullptr, n, s,
                          c10::cuda::getCurrentCUDAStream(param.device().index()).stream()),
                "adam kernel");
  return true;
}

/// One factored Adafactor step (parameters with >= 2 dims) on the GPU; see the file comment.
/// `beta2` and `rho` (the relative or external step size) are those of step state.step + 1;
/// `scale` multiplies rho by max(eps2, rms(θ)); beta1 < 0: no first moment. On success the state
/// holds "exp_avg_sq_row", "exp_avg_sq_col", "RMS" (and "exp_avg") as the ATen path keeps them,
/// and state.step is incremented.
inline bool adafactor_factored_step(const at::Tensor& param, fusebox::ParamState& state,
                                    double eps1, double eps2, double clip, double beta2, double rho,
                                    double beta1, double weight_decay, bool scale,
                                    bool stochastic) {
  ParamType type = ParamType::kFloat32;
  const at::Tensor& grad = param.grad();
  if (param.dim() < 2 || !detail::param_type(param, grad, stochastic, type)) return false;
  const int64_t C = param.size(-1), R = param.size(-2), n = param.numel();
  if (n == 0) return false;
  const int64_t B = n / (R * C);
  if (state.step == 0) {
    std::vector<int64_t> col_sizes(param.sizes().begin(), param.sizes().end() - 2);
    col_sizes.push_back(C);
    state["exp_avg_sq_row"] = detail::fp32_zeros(param, param.sizes().slice(0, param.dim() - 1));
    state["exp_avg_sq_col"] = detail::fp32_zeros(param, col_sizes);
    if (beta1 >= 0) state["exp_avg"] = detail::fp32_zeros(param, param.sizes());
  } else if (!detail::state_ok(state, "exp_avg_sq_row", param, B * R) ||
             !detail::state_ok(state, "exp_avg_sq_col", param, B * C) ||
             (beta1 >= 0 && !detail::state_ok(state, "exp_avg", param, n))) {
    return false;
  }
  ++state.step;
  const c10::cuda::CUDAGuard guard(param.device());
  // rms(θ) before the update, in fp32 (a reduction, no fp32 copy of a bf16 parameter).
  at::Tensor rms = state["RMS"] =
      type == ParamType::kFloat32
          ? fusebox::rms(param)
          : at::norm(param, 2, at::kFloat) / std::sqrt(static_cast<double>(n));
  at::Tensor alpha = scale ? rms.clamp_min(eps2).mul_(rho) : at::Tensor();
  at::Tensor workspace = at::empty({static_cast<int64_t>(adafactor_workspace_floats(B, R, C))},
                                   param.options().dtype(at::kFloat));
  const AdafactorScalars s = make_adafactor_scalars(eps1, beta2, n, clip, rho, beta1, weight_decay);
  detail::check(
      adafactor_factored_step(
          type, param.data_ptr(), grad.data_ptr(), state["exp_avg_sq_row"].data_ptr<float>(),
          state["exp_avg_sq_col"].data_ptr<float>(),
          beta1 >= 0 ? state["exp_avg"].data_ptr<float>() : nullptr,
          scale ? alpha.data_ptr<float>() : nullptr, B, R, C, s, workspace.data_ptr<float>(),
          c10::cuda::getCurrentCUDAStream(param.device().index()).stream()),
      "adafactor kernel");
  return true;
}

#else  // CPU LibTorch: the ATen path does everything.

inline bool adam_step(const at::Tensor&, fusebox::ParamState&, double, double, double, double,
                      double, bool, bool, bool) {
  return false;
}

inline bool adafactor_factored_step(const at::Tensor&, fusebox::ParamState&, double, double, double,
                                    double, double, double, double, bool, bool) {
  return false;
}

#endif

}  // namespace fusebox_plugins::cuda
