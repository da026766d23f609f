// recompute_in_backward: an autograd function whose inputs are the segment's inputs and its
// parameters. Its forward runs the segment without a graph; its backward runs it again with one
// and returns the gradients of both, which the outer backward pass accumulates as usual. (Calling
// backward() on the recomputed graph instead, as reentrant checkpointing does, would accumulate
// the parameters' gradients inside a nested pass, before a fused step mode's backward() sees them
// arrive in order, and would not reach parameters when no input requires a gradient.)
#include "fusebox/core/activation_checkpoint.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <optional>
#include <string>
#include <unordered_set>
#include <utility>

#include "fusebox/core/autocast.h"
#include "fusebox/core/random_state.h"
#include "fusebox/error.h"

namespace fusebox {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the second call must see as the first did.
struct AutocastState {
  c10::DeviceType device;
  std::optional<at::ScalarType> dtype;  // nullopt: autocast off
};

struct SegmentState : torch::CustomClassHolder {
  Segment segment;
  size_t num_inputs = 0;
  std::vector<bool> input_requires_grad;
  std::vector<AutocastState> autocast;
  c10::Device device = c10::kCPU;  // whose default generator the segment may draw from
  DefaultRngState rng;             // the default generators' states at forward
};

// The device whose default generator the segment may draw from besides the CPU's: a CUDA
// input's.
c10::Device device_of(const std::vector<at::Tensor>& inputs) {
  for (const auto& t : inputs)
    if (t.defined() && t.is_cuda()) return t.device();
  return c10::kCPU;
}

// A tensor requiring a gradient that the recomputed graph reaches but that is neither an input nor
// a listed parameter would silently get no gradient: refuse it. The walk stops at the listed
// tensors: at a leaf's accumulator, and at the node that made a listed tensor which is not a leaf
// (what lies behind it belongs to the forward pass outside the segment).
void refuse_unlisted_leaves(const at::Tensor& out, const std::vector<at::Tensor>& known) {
  std::unordered_set<const void*> listed;
  std::unordered_set<const torch::autograd::Node*> ends;
  for (const auto& t : known) {
    if (t.is_leaf())
      listed.insert(t.unsafeGetTensorImpl());
    else
      ends.insert(t.grad_fn().get());
  }
  std::vector<torch::autograd::Node*> stack{out.grad_fn().get()};
  std::unordered_set<const torch::autograd::Node*> seen;
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!node || ends.count(node) || !seen.insert(node).second) continue;
    if (const auto* acc = dynamic_cast<const torch::autograd::AccumulateGrad*>(node)) {
      if (!listed.count(acc->variable.unsafeGetTensorImpl()))
        throw Error("recompute_in_backward: the segment uses a tensor of shape " +
                    c10::str(acc->variable.sizes()) +
                    " that requires a gradient but is neither one of its inputs nor one of its "
                    "params; it would get no gradient: pass it in params");
      continue;
    }
    for (const auto& edge : node->next_edges()) stack.push_back(edge.function.get());
  }
}

struct Recompute : torch::autograd::Function<Recompute> {
  static at::Tensor forward(AutogradContext* ctx, c10::intrusive_ptr<SegmentState> state,
                            at::TensorList inputs, at::TensorList params) {
    std::vector<at::Tensor> in(inputs.begin(), inputs.end());
    state->num_inputs = in.size();
    for (const auto& t : in) state->input_requires_grad.push_back(t.defined() && t.requires_grad());
    for (c10::DeviceType d : {c10::kCPU, c10::kCUDA})
      state->autocast.push_back({d, active_autocast_dtype(d)});
    state->device = device_of(in);
    state->rng = DefaultRngState(state->device);
    variable_list saved(in);
    saved.insert(saved.end(), params.begin(), params.end());
    ctx->save_for_backward(saved);
    at::Tensor out = state->segment(in);  // no graph: apply() runs forward with gradients off
    ctx->saved_data["segment"] = at::IValue::make_capsule(std::move(state));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto state =
        c10::static_intrusive_pointer_cast<SegmentState>(ctx->saved_data["segment"].toCapsule());
    const variable_list saved = ctx->get_saved_variables();  // checks for in-place changes
    std::vector<at::Tensor> inputs(saved.begin(), saved.begin() + state->num_inputs);
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].defined())
        inputs[i] = inputs[i].detach().requires_grad_(state->input_requires_grad[i]);
    // Gradients are wanted for the inputs that require one and for every parameter.
    variable_list wrt;
    std::vector<size_t> slot;
    for (size_t i = 0; i < saved.size(); ++i) {
      const at::Tensor& t = i < inputs.size() ? inputs[i] : saved[i];
      if (t.defined() && t.requires_grad()) {
        wrt.push_back(t);
        slot.push_back(i);
      }
    }
    // One gradient per argument of forward(): none for the state, then inputs and parameters.
    variable_list grads(1 + saved.size());
    if (wrt.empty()) return grads;
    at::Tensor out;
    {
      torch::autograd::AutoGradMode grad_on(true);
      // The forward's random numbers again, and afterwards the stream where it was.
      KeepDefaultRng keep_rng(state->device);
      state->rng.restore();
      std::optional<AutocastGuard> on[2];
      std::optional<AutocastOffGuard> off[2];
      for (size_t d = 0; d < state->autocast.size(); ++d) {
        const AutocastState& a = state->autocast[d];
        if (a.dtype)
          on[d].emplace(true, a.device, *a.dtype);
        else
          off[d].emplace(a.device);
      }
      out = state->segment(inputs);
    }
    if (!out.requires_grad()) return grads;  // nothing in the segment needs a gradient
    refuse_unlisted_leaves(out, wrt);
    const variable_list got = torch::autograd::grad({out}, wrt, {grad_outputs.at(0)},
                                                    /*retain_graph=*/false,
                                                    /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t k = 0; k < slot.size(); ++k) grads[1 + slot[k]] = got[k];
    return grads;
  }
};

}  // namespace

at::Tensor recompute_in_backward(const Segment& segment, const std::vector<at::Tensor>& inputs,
                                 const std::vector<at::Tensor>& params) {
  if (!segment) throw Error("recompute_in_backward: the segment is empty");
  for (const auto& p : params)
    if (!p.defined() || !p.requires_grad())
      throw Error("recompute_in_backward: params must be tensors that require a gradient");
  // Without a graph to build (inference, or nothing requires a gradient) there is nothing to save.
  bool any = false;
  for (const auto& t : inputs) any = any || (t.defined() && t.requires_grad());
  if (!torch::autograd::GradMode::is_enabled() || (!any && params.empty())) return segment(inputs);
  auto state = c10::make_intrusive<SegmentState>();
  state->segment = segment;
  return Recompute::apply(std::move(state), at::TensorList(inputs), at::TensorList(params));
}

}  // namespace fusebox
