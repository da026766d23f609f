#include "fusebox/core/lr_scheduler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "fusebox/core/suggest.h"

namespace fusebox {

namespace {
constexpr double kPi = 3.14159265358979323846;
}

const std::vector<std::string>& scheduler_types() {
  static const std::vector<std::string> types{"constant", "constant_with_warmup", "linear",
                                              "cosine",   "cosine_with_restarts", "polynomial",
                                              "adafactor"};
  return types;
}

namespace {
std::string short_real(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
}  // namespace

LrScheduler::LrScheduler(std::vector<std::shared_ptr<Optimizer>> optimizers,
                         SchedulerOptions options)
    : optimizers_(std::move(optimizers)), options_(std::move(options)) {
  const auto& types = scheduler_types();
  // Named as SchedulerOptions' fields: the trainer checks its own options before it gets here.
  if (std::find(types.begin(), types.end(), options_.type) == types.end())
    throw Error("learning-rate schedule: unknown type '" + options_.type + "'" +
                did_you_mean(options_.type, types));
  const auto bad = [](const std::string& field, const std::string& rule, double got) {
    return Error("learning-rate schedule: SchedulerOptions::" + field + " must be " + rule +
                 ", got " + short_real(got));
  };
  if (options_.warmup_steps < 0)
    throw bad("warmup_steps", ">= 0", static_cast<double>(options_.warmup_steps));
  if (options_.total_steps < 1)
    throw bad("total_steps", ">= 1", static_cast<double>(options_.total_steps));
  if (!(options_.num_cycles > 0)) throw bad("num_cycles", "> 0", options_.num_cycles);
  if (options_.type == "polynomial" && !(options_.power > 0))
    throw bad("power", "> 0", options_.power);
  for (const auto& opt : optimizers_) {
    std::vector<double> base;
    for (size_t g = 0; g < opt->num_groups(); ++g) {
      const double lr = opt->lr(g);
      // As transformers' polynomial schedule: decaying "to" an end at or above the start would
      // silently hold the lr constant.
      if (options_.type == "polynomial" && lr > 0 && lr <= options_.lr_end)
        throw Error("learning-rate schedule: polynomial decays to " + short_real(options_.lr_end) +
                    ", but the learning rate is " + short_real(lr) +
                    ": raise the learning rate above it or choose another schedule");
      base.push_back(lr);
    }
    base_lrs_.push_back(std::move(base));
  }
  apply();
}

double LrScheduler::factor(int64_t step) const {
  const double s = static_cast<double>(step);
  const double warm = static_cast<double>(options_.warmup_steps);
  const double total = static_cast<double>(options_.total_steps);
  const std::string& t = options_.type;
  if (t == "constant" || t == "adafactor") return 1.0;
  if (s < warm) return s / std::max(1.0, warm);
  if (t == "constant_with_warmup") return 1.0;
  const double progress = (s - warm) / std::max(1.0, total - warm);
  if (t == "linear") return std::max(0.0, (total - s) / std::max(1.0, total - warm));
  if (t == "cosine") return std::max(0.0, 0.5 * (1.0 + std::cos(kPi * progress)));
  if (t == "cosine_with_restarts") {
    if (progress >= 1.0) return 0.0;
    return std::max(0.0,
                    0.5 * (1.0 + std::cos(kPi * std::fmod(options_.num_cycles * progress, 1.0))));
  }
  // polynomial: decays from the base lr to lr_end; expressed as a factor per group in apply().
  return -1.0;
}

void LrScheduler::apply() {
  for (size_t k = 0; k < optimizers_.size(); ++k)
    for (size_t g = 0; g < base_lrs_[k].size(); ++g) {
      const double base = base_lrs_[k][g];
      double lr;
      if (options_.type == "polynomial" && step_count_ >= options_.warmup_steps) {
        const double total = static_cast<double>(options_.total_steps);
        const double warm = static_cast<double>(options_.warmup_steps);
        const double s = static_cast<double>(step_count_);
        if (s > total || base <= options_.lr_end) {
          lr = std::min(base, options_.lr_end);
        } else {
          const double remaining = 1.0 - (s - warm) / std::max(1.0, total - warm);
          lr = (base - options_.lr_end) * std::pow(remaining, options_.power) + options_.lr_end;
        }
      } else {
        lr = base * factor(step_count_);
      }
      optimizers_[k]->set_lr(g, lr);
    }
}

void LrScheduler::step() {
  ++step_count_;
  apply();
}

void LrScheduler::set_step_count(int64_t count) {
  step_count_ = count;
  apply();
}

std::vector<double> LrScheduler::lrs() const {
  std::vector<double> out;
  for (const auto& opt : optimizers_)
    for (size_t g = 0; g < opt->num_groups(); ++g) out.push_back(opt->lr(g));
  return out;
}

std::vector<double> LrScheduler::effective_lrs() const {
  std::vector<double> out;
  for (const auto& opt : optimizers_)
    for (size_t g = 0; g < opt->num_groups(); ++g) out.push_back(opt->effective_lr(g));
  return out;
}

}  // namespace fusebox
