// --init-weights: a run that starts from saved parameters (fine-tuning a trained model) instead of
// the model's own initialisation.
#pragma once

#include <string>

namespace fusebox::trainer {

class Model;

/// Copies the tensors saved in `path` into `model`: a --save-model file, a safetensors file or a
/// torch.save'd state_dict ({name: tensor}), or a fusebox checkpoint (its model parameters and
/// buffers, not its optimizer state); the format is told by the file's first bytes. Every parameter
/// of the model, trained or frozen, must be in the file with its shape; the model's buffers are
/// taken when the file has them. A name the model does not have, a missing parameter, another
/// shape, an integer tensor for a floating one or a value that is not finite is refused before
/// anything is copied. Not `strict`: parameters the file lacks keep their initialisation and names
/// the model lacks are left unused (both named in the returned text), unless the file has none of
/// the model's parameters. Values are converted to the model's dtype and device. Returns what was
/// taken, for the run's header ("w.pt: 6 parameter tensors"). Throws Error starting
/// "--init-weights: ".
std::string load_initial_weights(const std::string& path, Model& model, bool strict = true);

}  // namespace fusebox::trainer
