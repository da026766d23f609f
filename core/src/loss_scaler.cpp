#include "fusebox/core/loss_scaler.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <string>

#include "fusebox/error.h"

namespace fusebox {

namespace {

std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

void check_scale(double scale, const char* what) {
  // float's largest finite value: a larger scale turns every float loss into infinity.
  if (!std::isfinite(scale) || scale <= 0 || scale > 3.4e38)
    throw Error(std::string(what) + " must be a finite number above 0 and at most 3.4e38, not " +
                number(scale));
}

}  // namespace

LossScaler::LossScaler(LossScaleOptions options) : options_(options), scale_(options.scale) {
  check_scale(options_.scale, "loss scale");
  if (!options_.dynamic) return;
  if (!(options_.growth_factor > 1) || !std::isfinite(options_.growth_factor))
    throw Error("loss scale growth factor must be above 1, not " + number(options_.growth_factor));
  if (!(options_.backoff_factor > 0 && options_.backoff_factor < 1))
    throw Error("loss scale backoff factor must be between 0 and 1, not " +
                number(options_.backoff_factor));
  if (options_.growth_interval < 1)
    throw Error("loss scale growth interval must be at least 1, not " +
                std::to_string(options_.growth_interval));
  check_scale(options_.min_scale, "minimum loss scale");
  // Its first overflow would already count as "not finite at any scale".
  if (options_.scale < options_.min_scale)
    throw Error("a dynamic loss scale must start at or above its minimum " +
                number(options_.min_scale) + ", not " + number(options_.scale));
}

bool LossScaler::update(bool overflow) {
  if (!options_.dynamic) return true;
  if (overflow) {
    const double lower = scale_ * options_.backoff_factor;
    if (lower < options_.min_scale) return false;
    scale_ = lower;
    good_steps_ = 0;
    return true;
  }
  if (++good_steps_ >= options_.growth_interval) {
    // A scale that would pass float's largest value stays where it is (as GradScaler keeps its
    // scale when the grown one is infinite in float), so a power of two stays one: capping at
    // FLT_MAX instead would leave every later scale a non-power of two, and unscaling inexact.
    const double grown = scale_ * options_.growth_factor;
    if (grown <= FLT_MAX) scale_ = grown;
    good_steps_ = 0;
  }
  return true;
}

void LossScaler::restore(double scale, int64_t good_steps) {
  check_scale(scale, "saved loss scale");
  if (good_steps < 0)
    throw Error("saved loss scale progress must be >= 0, not " + std::to_string(good_steps));
  if (!options_.dynamic) return;  // a fixed scale is the one configured now
  scale_ = scale;
  // A run resumed with a shorter growth interval grows at its next good iteration.
  good_steps_ = std::min(good_steps, options_.growth_interval - 1);
}

}  // namespace fusebox
