// The hook machinery behind fused backward and optimizer groups.
#include <ATen/ATen.h>

#include <atomic>
#include <cmath>
#include <iterator>
#include <mutex>
#include <string>
#include <unordered_map>

#include "fusebox/core/loss_scaler.h"

#include "step_mode_common.h"

namespace fusebox::detail {

namespace {

// Which hooked modes hook which parameters. Two live modes over one parameter would both react to
// its gradient (the first one's hooks step it in the second one's backward pass before the first
// one's refusal arrives), so a backward() is refused while another mode hooks its parameters;
// making such a mode is allowed (to inspect it, or to destroy the first one later).
// An entry keeps the mode's name, taken when it attached: another thread may be destroying that
// mode (its derived part already gone), so the other modes never call into it.
struct HookedBy {
  const HookedStep* mode;
  std::string mode_name;
};
std::mutex hooked_mutex;
std::unordered_multimap<const void*, HookedBy>& hooked_params() {
  // Never destroyed: a mode destroyed during exit, after this function's statics, still
  // unregisters itself.
  static auto* m = new std::unordered_multimap<const void*, HookedBy>;
  return *m;
}
std::atomic<int64_t> hooked_twice{0};  // entries beyond the first per parameter: 0 skips the check

}  // namespace

HookedStep::HookedStep(StepOptions options)
    : options_(std::move(options)), reducer_(options_.comm, options_.bucket_bytes) {}

HookedStep::~HookedStep() {
  // Destroyed between backward() and step(): the gradients not stepped yet go with it, so that
  // they are not added to the next mode's.
  if (awaiting_step_)
    for (auto& p : params_) p.mutable_grad().reset();
  const std::lock_guard<std::mutex> lock(hooked_mutex);
  auto& m = hooked_params();
  for (const auto& p : params_) {
    auto [first, last] = m.equal_range(p.unsafeGetTensorImpl());
    if (std::distance(first, last) > 1) --hooked_twice;
    for (auto it = first; it != last; ++it)
      if (it->second.mode == this) {
        m.erase(it);
        break;
      }
  }
}

void HookedStep::attach(const std::vector<at::Tensor>& params,
                        const std::vector<std::string>& names,
                        const std::vector<size_t>& segment_of) {
  for (size_t i = 0; i < params.size(); ++i)  // name the tensor the hooks could not serve
    if (!params[i].requires_grad() || !params[i].is_leaf())
      throw Error("parameter '" + names[i] + "' cannot be stepped by the " + name() +
                  " mode: it is " +
                  (params[i].requires_grad() ? "not a leaf tensor (it is computed from others)"
                                             : "frozen (requires_grad is false)") +
                  "; leave it out of the optimizer's groups");
  params_ = params;  // before registering: the destructor unregisters what params_ holds
  names_ = names;
  {
    const std::lock_guard<std::mutex> lock(hooked_mutex);
    const std::string mode_name = name();
    for (const auto& p : params) {
      if (hooked_params().count(p.unsafeGetTensorImpl())) ++hooked_twice;
      hooked_params().emplace(p.unsafeGetTensorImpl(), HookedBy{this, mode_name});
    }
  }
  fired_.assign(params.size(), false);
  warned_.assign(params.size(), false);
  updated_.assign(params.size(), false);
  norms_.assign(params.size(), at::Tensor());
  sharding_ = StateSharding(options_, params);
  reducer_.plan(params, segment_of);
  for (size_t i = 0; i < params.size(); ++i)
    hooks_.push_back(std::make_unique<compat::GradReadyHook>(params[i], [this, i] { ready(i); }));
}

void HookedStep::ready(size_t i) {
  const at::Tensor& param = params_[i];
  // The hooks stay on the parameters as long as the mode exists: a backward pass run some other
  // way (loss.backward(), another step mode over the same parameters) would step them unseen.
  // Its gradient is dropped, so that the mode's next backward() does not add to it.
  if (!in_backward_) {
    param.mutable_grad().reset();
    throw Error("parameter '" + names_[i] + "' received a gradient from a backward pass outside " +
                "this " + name() + " mode's backward(): while the mode exists it steps its " +
                "parameters from their gradients; call mode->backward(loss), or destroy the mode " +
                "before computing these gradients another way");
  }
  if (error_) {  // an earlier hook failed: update nothing more, free memory
    param.mutable_grad().reset();
    return;
  }
  try {
    if (fired_[i])
      throw Error("parameter '" + names_[i] +
                  "' received a second gradient within one backward pass (retain_graph, double "
                  "backward or reentrant checkpointing?); fused stepping updates each parameter "
                  "once per iteration");
    fired_[i] = true;
    if (options_.track_grad_bytes) peak_bytes_ = std::max(peak_bytes_, live_grad_bytes(params_));
    if (reducer_.active()) {
      // Also without a gradient: the parameter's bucket is complete without it (zeros).
      reducer_.arrived(i);
      drain(false);
    } else if (param.grad().defined()) {
      process(i);
    }
  } catch (...) {
    error_ = as_std_exception(std::current_exception());
    param.mutable_grad().reset();
    std::rethrow_exception(error_);
  }
}

void HookedStep::drain(bool wait) {
  for (size_t j : reducer_.completed(wait)) process(j);
}

void HookedStep::process(size_t i) {
  const at::Tensor& param = params_[i];
  updated_[i] = true;
  // A fixed loss scale (dynamic ones are refused in these modes): unscale before anything else.
  if (const double unscale = unscale_factor(options_); unscale != 0) param.grad().mul_(unscale);
  if (!(options_.check_finite || options_.max_grad_norm > 0 || options_.track_grad_norm))
    return on_gradient(i);
  // One reduction serves the non-finite check, clipping and the statistics.
  const at::Tensor norm = grad_norm(param.grad());
  if (param.grad().is_cpu()) {
    // On the host a scalar read costs nothing: the rest is host arithmetic, no more tensor ops.
    const double n = norm.item<double>();
    if (options_.check_finite && !norm_says_finite(param, n))
      throw NonFiniteError("non-finite gradient in parameter '" + names_[i] + "' during the " +
                           (name() == "fused" ? "fused backward pass" : "backward pass (groups)") +
                           "; it was not updated (parameters updated earlier in this pass hold "
                           "finite values)" +
                           scale_hint(options_));
    if (options_.max_grad_norm > 0) clip_by_norm_(param, n, options_.max_grad_norm);
  } else {
    // On a GPU a scalar read stalls the stream: the check is kept on the device and read once,
    // at the end of backward (deferred_check); clipping and the sum stay on the device too.
    // The norm is non-finite when a value is (half and bfloat16 norms are float, so they do not
    // overflow from finite half values); a float32 norm also overflows above about 1.8e19.
    if (options_.check_finite) device_finite_.push_back(at::isfinite(norm));
    device_index_.push_back(i);
    if (options_.max_grad_norm > 0) clip_by_norm_(param, norm, options_.max_grad_norm);
  }
  norms_[i] = norm;  // summed at the end in parameter order, as the normal mode sums them
  on_gradient(i);
}

void HookedStep::deferred_check() {
  if (device_finite_.empty()) return;
  const at::Tensor finite = at::stack(device_finite_);
  const bool ok = finite.all().item<bool>();  // the one host sync of the iteration
  if (ok) {
    device_finite_.clear();
    device_index_.clear();
    return;
  }
  const at::Tensor flags = finite.cpu();
  size_t bad = 0;
  while (bad + 1 < device_finite_.size() && flags[static_cast<int64_t>(bad)].item<bool>()) ++bad;
  const std::string name = names_[device_index_[bad]];
  device_finite_.clear();
  device_index_.clear();
  throw NonFiniteError("non-finite gradient in parameter '" + name +
                       "' (a NaN or infinite value, "
                       "or a norm beyond float's range; on " +
                       params_[0].device().str() +
                       " the check runs once, at the end of the backward pass: parameters "
                       "updated in this pass may hold non-finite values; resume from the last "
                       "checkpoint)" +
                       scale_hint(options_));
}

void HookedStep::refuse_second_backward() const {
  if (awaiting_step_)
    throw Error("backward() was called a second time without step() in between: the " + name() +
                " mode updates parameters during backward, so gradients cannot accumulate; "
                "call step() after each backward() (or add the losses into one)");
}

void HookedStep::refuse_shared_parameters() const {
  if (hooked_twice.load() == 0) return;
  const std::lock_guard<std::mutex> lock(hooked_mutex);
  for (size_t i = 0; i < params_.size(); ++i) {
    auto [first, last] = hooked_params().equal_range(params_[i].unsafeGetTensorImpl());
    for (auto it = first; it != last; ++it)
      if (it->second.mode != this)
        throw Error("parameter '" + names_[i] + "' is also stepped by a " + it->second.mode_name +
                    " mode that still exists, whose hooks would react to its gradient in this " +
                    name() + " mode's backward pass; destroy that mode first");
  }
}

void HookedStep::backward(const at::Tensor& loss) {
  // Refused before anything runs, so the iteration stays as it was and step() still ends it.
  refuse_second_backward();
  refuse_shared_parameters();
  // A gradient from before (loss.backward() before this mode was made) would be added to this
  // pass's and stepped: these modes do not accumulate gradients.
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].grad().defined())
      throw Error("parameter '" + names_[i] + "' already has a gradient before this " + name() +
                  " mode's backward(), which would add it to this pass's and step the sum (the " +
                  name() +
                  " mode does not accumulate gradients); free it first (zero_grad()), "
                  "and compute gradients only through the mode's backward()");
  error_ = nullptr;
  struct InBackward {  // the hooks act only inside this call, also when it throws
    bool& flag;
    explicit InBackward(bool& f) : flag(f) { flag = true; }
    ~InBackward() { flag = false; }
  } in_backward(in_backward_);
  try {
    scaled_loss(loss, options_).backward();
  } catch (...) {
    std::exception_ptr original = error_ ? error_ : std::current_exception();
    error_ = nullptr;
    abandon_iteration();
    std::rethrow_exception(original);  // the plugin's own exception, not autograd's wrapper
  }
  try {
    if (reducer_.active()) {
      reducer_.launch_rest();  // with zeros for what this rank did not produce
      drain(true);
    }
    deferred_check();
  } catch (...) {
    abandon_iteration();
    throw;
  }
  awaiting_step_ = true;
}

void HookedStep::abandon_iteration() {
  awaiting_step_ = false;
  reducer_.abandon();
  for (auto& p : params_) p.mutable_grad().reset();
  fired_.assign(params_.size(), false);
  updated_.assign(params_.size(), false);
  norms_.assign(params_.size(), at::Tensor());
  device_finite_.clear();
  device_index_.clear();
  stepped_ = 0;
}

StepStats HookedStep::finish_iteration() {
  // The iteration is over whatever happens below (a warning callback or the norm's read may
  // throw): the next backward() starts clean.
  struct EndIteration {
    HookedStep& s;
    ~EndIteration() {
      s.fired_.assign(s.params_.size(), false);
      s.updated_.assign(s.params_.size(), false);
      s.norms_.assign(s.params_.size(), at::Tensor());
      s.peak_bytes_ = 0;
      s.awaiting_step_ = false;
    }
  } end_iteration{*this};
  StepStats stats;
  if (options_.loss_scaler) stats.loss_scale = options_.loss_scaler->scale();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (updated_[i]) {
      ++stats.params_stepped;
    } else if (!warned_[i]) {
      warned_[i] = true;
      warner(options_)("parameter '" + names_[i] + "' received no gradient in this iteration" +
                       (reducer_.active() ? " on any rank" : "") +
                       " and was not updated (reported once)");
    }
  }
  std::vector<at::Tensor> norms;
  for (const at::Tensor& n : norms_)
    if (n.defined()) norms.push_back(n);
  if (!norms.empty()) stats.grad_norm = stacked_norms(norms).norm().item<double>();
  if (options_.track_grad_bytes) stats.peak_grad_bytes = peak_bytes_;
  return stats;
}

}  // namespace fusebox::detail
