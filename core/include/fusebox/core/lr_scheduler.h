// Learning-rate schedules (Hugging Face transformers' semantics) driving any number of optimizers.
//
// One scheduler sets the lr of every group of every optimizer it drives (all optimizer groups of
// a grouped run): lr = base_lr * factor(step). Call step() once per iteration after the update,
// so iteration k trains with factor(k - 1), exactly as in the normal loop.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fusebox/optimizer.h"

namespace fusebox {

/// The schedule's shape and parameters.
struct SchedulerOptions {
  std::string type = "constant";  ///< constant, constant_with_warmup, linear, cosine,
                                  ///< cosine_with_restarts, polynomial, adafactor
  int64_t warmup_steps = 0;       ///< linear warm-up from 0
  int64_t total_steps = 1;        ///< training steps (decaying schedules end here)
  double num_cycles = 1;          ///< cosine_with_restarts: number of restarts
  double power = 1;               ///< polynomial: exponent
  double lr_end = 1e-7;           ///< polynomial: final lr
};

/// The names accepted in SchedulerOptions::type.
const std::vector<std::string>& scheduler_types();

class LrScheduler {
 public:
  /// Validates `options` (throws Error) and records every group's current lr as its base lr.
  LrScheduler(std::vector<std::shared_ptr<Optimizer>> optimizers, SchedulerOptions options);
  /// Multiplier of the base lr after `step` scheduler steps.
  double factor(int64_t step) const;
  /// Advances one step and sets every group's lr.
  void step();
  /// Scheduler steps taken so far.
  int64_t step_count() const { return step_count_; }
  /// Jumps to `count` steps (checkpoint resume) and sets every group's lr accordingly.
  void set_step_count(int64_t count);
  /// Current lr of every group of every optimizer, in order.
  std::vector<double> lrs() const;
  /// Effective step size of every group (Adafactor's alpha, auto-LR's d*lr), in order.
  std::vector<double> effective_lrs() const;

 private:
  void apply();
  std::vector<std::shared_ptr<Optimizer>> optimizers_;
  SchedulerOptions options_;
  std::vector<std::vector<double>> base_lrs_;
  int64_t step_count_ = 0;
};

}  // namespace fusebox
