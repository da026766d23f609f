// How a training iteration turns gradients into parameter updates.
//
// Three modes share one interface, so a training loop is the same for all of them:
//
//   auto mode = fusebox::make_fused_backward(optimizer, options);   // or normal / groups
//   for (...) {
//     at::Tensor loss = model(batch);
//     mode->backward(loss);   // fused/groups: parameters are updated in here, grads freed
//     StepStats stats = mode->step();  // normal: clip + step + free grads; fused/groups: finish
//     if (!stats.skipped) scheduler.step();  // an overflowed (skipped) update keeps the lr
//   }
//
// Normal: backward, then (optionally) clip, check, step every parameter, free every gradient.
// Fused backward: a hook on each parameter runs right after its gradient is accumulated:
//   per-tensor clipping, a non-finite check, step_param, then the gradient is freed.
// Optimizer groups: N plugin instances over contiguous slices of the parameters; a group steps
//   and frees its gradients when its last gradient has been accumulated.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fusebox/optimizer.h"

namespace fusebox {

class Communicator;
class LossScaler;

/// What to do when a gradient is NaN or infinite.
enum class NonFinitePolicy {
  Stop,  ///< throw NonFiniteError before any parameter takes a non-finite value
  Skip,  ///< normal mode only: drop this iteration's update and go on
};

/// Options common to all modes.
struct StepOptions {
  double max_grad_norm = 0;      ///< > 0: clip gradients by norm (0 turns clipping off)
  bool clip_per_tensor = false;  ///< normal mode: clip each tensor alone (fused/groups always do)
  bool check_finite = true;      ///< look for NaN/Inf gradients before stepping
  NonFinitePolicy non_finite = NonFinitePolicy::Stop;  ///< reaction to NaN/Inf gradients
  bool track_grad_norm = true;    ///< compute StepStats::grad_norm (one reduction per tensor)
  bool track_grad_bytes = false;  ///< record peak live gradient bytes (costly: for tests)
  /// Receives warnings (e.g. a parameter that got no gradient); default prints to stderr.
  std::function<void(const std::string&)> warn;
  /// Data parallel (fusebox/core/distributed.h): gradients are averaged over the ranks as soon as
  /// they are accumulated, overlapping the rest of backward, and before any check or step.
  /// Every rank must run the same model and mode. A parameter may get a gradient on some ranks
  /// only (a forward that branches on the data): every rank then steps it with the average over
  /// all ranks (zeros from those without one), as PyTorch's DistributedDataParallel does; one that
  /// no rank got a gradient for is not stepped, as in one process. Parameters without
  /// requires_grad (normal mode) are left alone. Null or world size 1: single process.
  std::shared_ptr<Communicator> comm;
  /// Normal and fused modes: gradients are averaged in buckets of about this many bytes, planned
  /// once from the parameters (one dtype each) and the same on every rank (groups average each
  /// group as one bucket).
  int64_t bucket_bytes = int64_t{25} << 20;
  /// Data parallel only, ZeRO stage 1: each rank steps, and keeps optimizer state for, only its
  /// share of the parameters (parameter_owners), then sends them to the other ranks. Results are
  /// the same as unsharded. Not for auto-LR optimizers (their step size needs every parameter).
  bool shard_optimizer_state = false;
  /// Loss scaling (fusebox/core/loss_scaler.h), e.g. for fp16: backward() multiplies the loss by
  /// the current scale and every gradient is divided by it before any check, clip or step. A
  /// dynamic scaler (normal mode only) is updated by step(): an overflow skips the iteration
  /// (StepStats::overflow) whatever the NonFinitePolicy. Null: no scaling.
  std::shared_ptr<LossScaler> loss_scaler;
};

/// Thrown when a gradient is not finite and the policy is Stop.
class FUSEBOX_VISIBLE NonFiniteError : public Error {
 public:
  using Error::Error;
};

/// Statistics of the last iteration, gathered for free where the mode sees the gradients.
struct StepStats {
  double grad_norm = -1;         ///< global L2 norm of the gradients before clipping; -1 unknown
  int64_t params_stepped = 0;    ///< tensors updated this iteration
  bool skipped = false;          ///< the update was dropped (NonFinitePolicy::Skip, or overflow)
  bool overflow = false;         ///< dynamic loss scaling: gradients overflowed, scale lowered
  double loss_scale = 0;         ///< the scale this iteration's loss was multiplied by; 0: none
  int64_t peak_grad_bytes = -1;  ///< peak live gradient bytes (track_grad_bytes only)
};

/// The interface of the three modes.
class StepMode {
 public:
  virtual ~StepMode();
  /// Runs backward from `loss`; fused and grouped modes update parameters inside.
  virtual void backward(const at::Tensor& loss);
  /// Completes the iteration (see the file comment); returns its statistics.
  virtual StepStats step() = 0;
  /// Every optimizer instance (one, or one per group), for schedulers and checkpoints.
  virtual const std::vector<std::shared_ptr<Optimizer>>& optimizers() const = 0;
  /// "normal", "fused" or "groups".
  virtual std::string name() const = 0;
};

/// The plain loop: backward, then step all and free all gradients.
std::unique_ptr<StepMode> make_normal_step(std::shared_ptr<Optimizer> optimizer,
                                           StepOptions options = {});

/// Fused backward pass over every parameter of `optimizer` (which must support step_param).
std::unique_ptr<StepMode> make_fused_backward(std::shared_ptr<Optimizer> optimizer,
                                              StepOptions options = {});

/// How parameters are cut into groups.
enum class SplitPolicy {
  Size,   ///< balanced by bytes (the largest group sets the memory peak)
  Count,  ///< equal numbers of tensors
};

/// Cuts the parameters of `groups`, in order, into `n` contiguous pieces (`n` larger than the
/// number of tensors is clamped; the count policy may make fewer). Each piece becomes one
/// optimizer; a piece that spans parameter groups holds a part of each, with its lr and weight
/// decay.
std::vector<std::vector<ParamGroup>> split_param_groups(const std::vector<ParamGroup>& groups,
                                                        int64_t n, SplitPolicy policy);

/// Builds one optimizer over the given groups (e.g. a plugin's factory with fixed hyperparameters).
using OptimizerFactory = std::function<std::shared_ptr<Optimizer>(std::vector<ParamGroup>)>;

/// Optimizer groups: one optimizer per split, each stepped once its gradients are all there.
std::unique_ptr<StepMode> make_optimizer_groups(const std::vector<ParamGroup>& groups, int64_t n,
                                                SplitPolicy policy, const OptimizerFactory& make,
                                                StepOptions options = {});

/// Which of the three modes to build, as a trainer's options choose it.
struct ModeChoice {
  std::string name = "normal";            ///< "normal", "fused" or "groups"
  int64_t groups = 1;                     ///< groups: how many optimizers
  SplitPolicy split = SplitPolicy::Size;  ///< groups: how the parameters are cut
};

/// The mode `choice` names over `groups`, its optimizer(s) built by `make`: make_normal_step,
/// make_fused_backward or make_optimizer_groups. An unknown name throws Error.
std::unique_ptr<StepMode> make_step_mode(const ModeChoice& choice,
                                         const std::vector<ParamGroup>& groups,
                                         const OptimizerFactory& make, StepOptions options = {});

/// ZeRO stage 1: the rank owning each parameter of `groups` (in order) when `world` ranks share
/// the optimizer state: contiguous runs balanced by bytes.
std::vector<int> parameter_owners(const std::vector<ParamGroup>& groups, int world);

/// Clips one tensor's gradient to `max_norm` (torch's clip_grad_norm_ rule applied to one tensor);
/// returns the norm before clipping as a 0-d tensor on the gradient's device (no host sync).
at::Tensor clip_grad_norm_one(const at::Tensor& param, double max_norm);

}  // namespace fusebox
