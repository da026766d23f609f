// Models the trainer can train: built-in MLP, transformer LM and UNet-style denoiser, or a
// TorchScript module whose forward returns the loss.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fusebox::trainer {

/// One training batch. Which fields are set depends on the model (see data.h).
struct Batch {
  at::Tensor input;      ///< features, tokens, clean images, or the script's argument
  at::Tensor target;     ///< regression targets or next tokens
  at::Tensor noise;      ///< denoiser: the noise to add and predict
  at::Tensor timesteps;  ///< denoiser: diffusion step per sample
  /// A script model's forward arguments by name (--dataset tensors: with named tensors); when
  /// set, `input` is not used.
  std::vector<std::pair<std::string, at::Tensor>> arguments;
};

/// One argument of a script model's forward (after self).
struct ForwardArgument {
  std::string name;
  bool has_default = false;  ///< may be left out
};

/// Sizes of the built-in models.
struct ModelOptions {
  std::string kind = "mlp";  ///< mlp, transformer, denoiser
  int64_t width = 64, depth = 2, heads = 4, seq_len = 64, vocab_size = 256, image_size = 16;
  /// Recompute each block (MLP layer, transformer block, denoiser residual block) in backward
  /// instead of keeping its activations (fusebox/core/activation_checkpoint.h).
  bool gradient_checkpointing = false;
  c10::Device device = c10::Device(c10::kCPU);
  c10::ScalarType dtype = c10::kFloat;
};

/// Image channels of the denoiser and its data.
constexpr int64_t kImageChannels = 3;
/// Diffusion steps of the denoiser's noise schedule.
constexpr int64_t kDiffusionSteps = 1000;

/// A trainable model.
class Model {
 public:
  virtual ~Model() = default;
  /// Every floating-point parameter once (tied weights appear once), with dotted names; those
  /// --freeze leaves untrained have requires_grad false.
  virtual std::vector<std::pair<std::string, at::Tensor>> parameters() = 0;
  /// Tensors the model keeps besides its parameters and may change while training (a script
  /// module's buffers, e.g. BatchNorm's running statistics); checkpoints save and restore them.
  virtual std::vector<std::pair<std::string, at::Tensor>> buffers() { return {}; }
  /// A script model's forward arguments (none for a built-in model).
  virtual std::vector<ForwardArgument> forward_arguments() { return {}; }
  /// The scalar training loss of `batch`.
  virtual at::Tensor loss(const Batch& batch) = 0;
  /// Training mode (true) or evaluation mode (dropout off, BatchNorm using its running
  /// statistics without updating them), as torch.nn.Module.train(mode).
  virtual void set_training(bool on) = 0;
  /// One line: kind, sizes, parameter count.
  virtual std::string describe() = 0;
  /// Writes the parameters to `path` (written to a temporary file, then renamed); a path ending
  /// in .safetensors gets the safetensors format (see write_weights). `as`: the float type the
  /// file holds (unset: the parameters' own); a TorchScript module saved as itself ignores it.
  virtual void save(const std::string& path, std::optional<c10::ScalarType> as = std::nullopt) = 0;
};

/// Writes `path` through a temporary file beside it (`write` fills the temporary), then renames
/// it into place; throws Error naming `path` with the cause's first line (the temporary is gone).
void save_via_temporary(const std::string& path,
                        const std::function<void(const std::string&)>& write);

/// Writes named tensors atomically: safetensors for a .safetensors path, else a {name: tensor}
/// dict in torch's pickle format (Python's torch.load reads either kind's library). With `as`,
/// floating tensors are written converted to that type.
void write_weights(const std::vector<std::pair<std::string, at::Tensor>>& named,
                   const std::string& path, std::optional<c10::ScalarType> as = std::nullopt);

/// Builds a built-in model (initialised from the current global seed).
std::unique_ptr<Model> make_builtin_model(const ModelOptions& options);

/// The number of parameters make_builtin_model(options) builds, worked out from the sizes alone
/// (in double, so that sizes no machine holds do not overflow; exact below 2^53).
double builtin_parameter_count(const ModelOptions& options);

/// Loads a TorchScript module; every parameter is made trainable. Throws Error naming the file.
std::unique_ptr<Model> load_script_model(const std::string& path, c10::Device device,
                                         c10::ScalarType dtype);

/// Keeps the first occurrence of each tensor (by storage identity of the TensorImpl).
std::vector<std::pair<std::string, at::Tensor>> unique_parameters(
    std::vector<std::pair<std::string, at::Tensor>> named);

/// Total number of elements of `params`.
int64_t count_elements(const std::vector<std::pair<std::string, at::Tensor>>& params);

}  // namespace fusebox::trainer
