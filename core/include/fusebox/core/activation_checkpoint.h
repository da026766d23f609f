// Activation (gradient) checkpointing: a segment of the forward pass that keeps none of its
// activations. It runs once without a graph and again inside backward, where its gradients are
// computed; the memory for activations drops to the segments' inputs plus one segment's own.
//
// The gradients of the segment's parameters reach them through the outer backward pass, one
// accumulation per parameter as without checkpointing, so every step mode (normal, fused backward,
// optimizer groups, data parallel) sees them exactly as it would otherwise, and results are the
// same bit for bit on the CPU.
#pragma once

#include <functional>
#include <vector>

namespace at {
class Tensor;
}

namespace fusebox {

/// A segment of the forward pass: its inputs -> one output tensor. It is called twice (forward,
/// then inside backward) and must compute the same thing both times: the default CPU (and CUDA)
/// random generators and the autocast state of the first call are restored for the second, but a
/// segment must not change state of its own (BatchNorm's running statistics would change twice).
using Segment = std::function<at::Tensor(const std::vector<at::Tensor>& inputs)>;

/// Returns `segment(inputs)` without keeping the segment's activations: only `inputs` (and the
/// parameters, which exist anyway) are kept for backward, where the segment runs again.
/// `params` are every tensor requiring a gradient that the segment uses besides `inputs` (its
/// module's parameters). A tensor it uses that is in neither list would get no gradient, so the
/// backward pass throws fusebox::Error instead. Inputs that do not require a gradient are
/// allowed: the parameters still get theirs.
at::Tensor recompute_in_backward(const Segment& segment, const std::vector<at::Tensor>& inputs,
                                 const std::vector<at::Tensor>& params);

}  // namespace fusebox
