// Internals shared by the step modes: per-gradient hooks with clipping, finiteness checks,
// once-per-iteration bookkeeping and error capture.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fusebox/core/step_mode.h"
#include "grad_reducer.h"
#include "state_sharding.h"
#include "torch_compat.h"

namespace fusebox::detail {

/// `e` itself when it holds a std::exception, else an Error saying that a plugin threw something
/// else: autograd's engine passes only std::exceptions on (anything else ends the process).
inline std::exception_ptr as_std_exception(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception&) {
    return e;
  } catch (...) {
    return std::make_exception_ptr(
        Error("the optimizer plugin threw a value that is not a std::exception (a bug in the "
              "plugin: throw fusebox::Error)"));
  }
}

/// `loss` times the loss scale of `o`; `loss` itself without a scaler or at scale 1.
at::Tensor scaled_loss(const at::Tensor& loss, const StepOptions& o);
/// The factor that unscales gradients (1 / scale), or 0 when they need none.
double unscale_factor(const StepOptions& o);
/// True when `o` has a dynamic loss scaler (which needs every gradient checked).
bool dynamic_scaling(const StepOptions& o);
/// For non-finite messages: " (the gradients were scaled by S ...)" when a scaler is set.
std::string scale_hint(const StepOptions& o);
/// The warning sink of `o` (stderr when unset).
std::function<void(const std::string&)> warner(const StepOptions& o);
/// The L2 norm of `grad` as a 0-d tensor on its device. Every mode takes its norms from here, so
/// they clip alike bit for bit. Contiguous float/double host tensors use BLAS's dot product
/// (sqrt(g·g)): 1.5-2.5x faster than at::norm on this CPU, and the norm is needed for every
/// gradient of every step (non-finite check, clipping, statistics). Half and bfloat16 gradients
/// get a float norm, summed in float or wider: a half norm does not overflow above 65504.
at::Tensor grad_norm(const at::Tensor& grad);
/// True when `param.grad()` holds only finite values (one host sync).
bool grad_is_finite(const at::Tensor& param);
/// The same answer from the gradient's norm, already computed: a non-finite value always makes
/// the norm non-finite; a non-finite norm from finite values (the sum of squares overflowed, e.g.
/// in fp16) is told apart by a look at the values, only on that rare path. One host sync.
bool norm_says_finite(const at::Tensor& param, const at::Tensor& norm);
/// The same from a norm already read to the host.
bool norm_says_finite(const at::Tensor& param, double norm);
/// Scales `param.grad()` so its norm (given) is at most `max_norm` (clip_grad_norm_'s rule).
/// Host tensors read the norm and scale by a host scalar (no extra tensor ops); device tensors
/// stay on the device. Every mode clips through here, so they agree bit for bit.
void clip_by_norm_(const at::Tensor& param, const at::Tensor& norm, double max_norm);
/// The same with the norm already on the host.
void clip_by_norm_(const at::Tensor& param, double norm, double max_norm);
/// Bytes of all defined gradients of `params`.
int64_t live_grad_bytes(const std::vector<at::Tensor>& params);
/// The per-gradient norms (0-d, any float dtype) as one double vector on the first norm's device,
/// in the order given; its norm() is the global gradient norm. Every mode computes it so, over the
/// norms in parameter order, so they report the same norm bit for bit.
at::Tensor stacked_norms(const std::vector<at::Tensor>& norms);

/// Refuses an optimizer made by a plugin whose capabilities do not allow `mode` ("normal",
/// "fused" or "groups") with these options: fused stepping needs supports_step_param; groups and
/// sharded state need one step size per parameter (no auto_lr). Optimizers made otherwise pass.
void check_capabilities(const Optimizer& optimizer, const std::string& mode,
                        const StepOptions& options);

/// A mode that reacts to each gradient as soon as it is accumulated (fused and groups).
///
/// Single process: hook(i) -> process(i): checks, clipping, on_gradient(i).
/// Data parallel: the hook hands the gradient to the reducer (its bucket is launched once
/// complete, or at the end of backward); process(i) runs for each parameter whose average has come
/// back, from later hooks or at the end of backward, on every rank alike: also for a parameter
/// whose gradient only other ranks produced (the average is then its gradient here too).
class HookedStep : public StepMode {
 public:
  ~HookedStep() override;
  void backward(const at::Tensor& loss) override;

 protected:
  explicit HookedStep(StepOptions options);
  /// Installs one hook per parameter; `names` label messages. Data parallel: `segment_of[i]`,
  /// if given, is parameter i's segment, which the reducer averages as one bucket (per wire type).
  void attach(const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
              const std::vector<size_t>& segment_of = {});
  /// Called once `i`'s gradient is final (averaged when data parallel), checked and clipped.
  virtual void on_gradient(size_t i) = 0;
  /// Checks, clips and counts gradient `i` (now final), then calls on_gradient(i).
  void process(size_t i);
  /// Processes every gradient whose average has finished (all launched ones with `wait`).
  void drain(bool wait);
  /// End-of-iteration bookkeeping: warns (once each) about parameters that got no gradient,
  /// resets the per-iteration flags and returns the statistics gathered by the hooks.
  StepStats finish_iteration();
  /// Abandons the iteration after a failure: frees every gradient and forgets what fired, so the
  /// next backward starts clean.
  void abandon_iteration();
  /// Throws when a backward() has run and step() has not ended its iteration yet (changes
  /// nothing: the pending iteration can still be stepped).
  void refuse_second_backward() const;
  /// Throws when another hooked mode that still exists hooks one of these parameters.
  void refuse_shared_parameters() const;
  /// Device gradients: reads the finiteness flags gathered during backward (one host sync) and
  /// throws NonFiniteError naming the first non-finite gradient.
  void deferred_check();

  StepOptions options_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  GradReducer reducer_;
  StateSharding sharding_;  // set by attach()

 private:
  void ready(size_t i);
  std::vector<std::unique_ptr<compat::GradReadyHook>> hooks_;
  std::vector<bool> fired_, warned_;
  bool in_backward_ = false;    // inside backward(): the only time the hooks may step
  bool awaiting_step_ = false;  // a backward() has run; step() must end the iteration first
  std::vector<bool> updated_;   // process(i) ran in this iteration
  std::exception_ptr error_;
  std::vector<at::Tensor> norms_;          // per parameter: its gradient's norm in this iteration
  std::vector<at::Tensor> device_finite_;  // device gradients: 0-d "is finite" flags
  std::vector<size_t> device_index_;       // ... and whose they are
  int64_t stepped_ = 0, peak_bytes_ = 0;
};

}  // namespace fusebox::detail
