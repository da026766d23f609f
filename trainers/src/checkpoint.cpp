#include "checkpoint.h"

#include "fusebox/error.h"

namespace fusebox::trainer {

void check_checkpoint_options(const TrainConfig& c) {
  if (c.resume)
    throw Error("--resume: checkpoints are not supported by this build of the trainer yet");
  if (c.save_every_n_steps > 0)
    throw Error(
        "--save-every-n-steps: checkpoints are not supported by this build of the "
        "trainer yet");
}

int64_t resume_from_checkpoint(const TrainConfig& c, Model&, StepMode&, LrScheduler&) {
  if (c.resume) throw Error("--resume: checkpoints are not supported yet");
  return 0;
}

void save_checkpoint_if_due(const TrainConfig& c, int64_t step, Model&, StepMode&, LrScheduler&) {
  if (c.save_every_n_steps > 0 && step % c.save_every_n_steps == 0)
    throw Error("--save-every-n-steps: checkpoints are not supported yet");
}

}  // namespace fusebox::trainer
