// Where checkpoint saving and resuming plug into the run loop.
#pragma once

#include <cstdint>

#include "config.h"
#include "fusebox/core/lr_scheduler.h"
#include "fusebox/core/step_mode.h"
#include "model.h"

namespace fusebox::trainer {

/// Refuses checkpoint options this build cannot honour (called before any work starts).
void check_checkpoint_options(const TrainConfig& config);

/// Restores model, optimizer state and scheduler from --resume (when given) and returns the
/// number of steps already done (0 without --resume). Must run before fused hooks see a step.
int64_t resume_from_checkpoint(const TrainConfig& config, Model& model, StepMode& mode,
                               LrScheduler& scheduler);

/// Saves a checkpoint after `step` steps when --save-every-n-steps says so (and prunes old ones
/// per --keep-last-n-checkpoints).
void save_checkpoint_if_due(const TrainConfig& config, int64_t step, Model& model, StepMode& mode,
                            LrScheduler& scheduler);

}  // namespace fusebox::trainer
