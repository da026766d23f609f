#include "fusebox/core/ema.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>

#include "fusebox/error.h"

namespace fusebox {

namespace {

at::ScalarType average_dtype(const at::Tensor& p) {
  const at::ScalarType t = p.scalar_type();
  return t == at::kBFloat16 || t == at::kHalf ? at::kFloat : t;
}

// A parameter and its average can trade storages when nothing but their values differ.
bool exchangeable(const at::Tensor& p, const at::Tensor& avg) {
  return p.scalar_type() == avg.scalar_type() && p.device() == avg.device() &&
         p.sizes() == avg.sizes() && p.strides() == avg.strides();
}

}  // namespace

ParameterEma::ParameterEma(std::vector<std::pair<std::string, at::Tensor>> params, double decay)
    : params_(std::move(params)), decay_(decay) {
  if (!(decay > 0 && decay < 1))
    throw Error("EMA decay must be above 0 and below 1, got " + std::to_string(decay));
  at::NoGradGuard no_grad;
  for (const auto& [name, p] : params_) {
    if (!averages_.emplace(name, p.detach().to(average_dtype(p), false, true)).second)
      throw Error("EMA: parameter name '" + name + "' is given twice");
  }
}

double ParameterEma::next_decay() const {
  const double t = static_cast<double>(updates_);
  return std::min(decay_, (1 + t) / (10 + t));
}

void ParameterEma::update() {
  at::NoGradGuard no_grad;
  const double d = next_decay();
  for (const auto& [name, p] : params_) {
    at::Tensor& avg = averages_.at(name);
    const at::Tensor value = p.detach().scalar_type() == avg.scalar_type()
                                 ? p.detach()
                                 : p.detach().to(avg.scalar_type());
    avg.mul_(d).add_(value, 1 - d);
  }
  ++updates_;
}

void ParameterEma::load(const std::map<std::string, at::Tensor>& averages, int64_t updates) {
  if (updates < 0) throw Error("EMA: a saved update count is >= 0, got " + std::to_string(updates));
  for (const auto& [name, avg] : averages_) {
    const auto it = averages.find(name);
    if (it == averages.end())
      throw Error("EMA: the saved averages have no entry for parameter '" + name +
                  "' (saved for another model?)");
    if (!it->second.defined() || it->second.sizes() != avg.sizes() ||
        it->second.scalar_type() != avg.scalar_type())
      throw Error("EMA: the saved average of '" + name + "' is " +
                  (it->second.defined() ? c10::str(it->second.scalar_type(), it->second.sizes())
                                        : std::string("empty")) +
                  ", this run keeps " + c10::str(avg.scalar_type(), avg.sizes()) +
                  " (saved for another model or dtype?)");
  }
  if (averages.size() != averages_.size())
    for (const auto& [name, t] : averages)
      if (!averages_.count(name))
        throw Error("EMA: the saved averages have an entry '" + name +
                    "' that is no parameter of this model (saved for another model?)");
  at::NoGradGuard no_grad;
  for (auto& [name, avg] : averages_) avg.copy_(averages.at(name));
  updates_ = updates;
}

ParameterEma::Swap::Swap(ParameterEma& ema) : ema_(ema) {
  at::NoGradGuard no_grad;
  saved_.reserve(ema.params_.size());
  for (auto& [name, p] : ema.params_) {
    at::Tensor& avg = ema.averages_.at(name);
    if (exchangeable(p, avg)) {
      // The parameter takes the average's storage and the average keeps the trained values':
      // nothing is copied and no memory is allocated. set_data keeps the parameter's identity
      // (autograd, hooks and optimizers see the same tensor).
      const at::Tensor trained = p.detach();
      p.set_data(avg);
      avg = trained;
      saved_.emplace_back();
    } else {
      saved_.push_back(p.detach().clone());  // a bf16/fp16 parameter and its float32 average
      p.detach().copy_(avg);
    }
  }
}

ParameterEma::Swap::~Swap() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < saved_.size(); ++i) {
    auto& [name, p] = ema_.params_[i];
    if (saved_[i].defined()) {
      p.detach().copy_(saved_[i]);
      continue;
    }
    at::Tensor& trained = ema_.averages_.at(name);
    const at::Tensor average = p.detach();
    p.set_data(trained);
    trained = average;
  }
}

}  // namespace fusebox
