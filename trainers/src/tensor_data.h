// --dataset tensors:PATH: training on samples of the user's own, a file of tensors whose first
// dimension counts the samples (a safetensors file, or a {name: tensor} dict written by Python's
// torch.save). What the model reads from it:
//   script:      its forward's arguments, by name (one tensor may feed a one-argument forward
//                whatever its name)
//   transformer: one integer tensor of token ids [N, seq_len + 1] (input and next tokens), or one
//                stream of ids [T] read as windows of seq_len + 1 ids every seq_len ids
//   mlp:         'input' [N, width] and 'target' [N, 1] (or [N])
//   denoiser:    one tensor of images [N, 3, S, S], floating in [-1, 1] or uint8 pixels (0 to 255,
//                mapped onto [-1, 1]); noise and timesteps are drawn from the stream's
//                generator, as for synthetic images
// Batches walk through the samples in an order shuffled anew each epoch (a permutation made from
// the seed and the epoch's number), so every sample is seen once per epoch and a resumed run,
// given the samples drawn so far, continues exactly where the checkpoint left off.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "config.h"
#include "data.h"
#include "model.h"

namespace fusebox::trainer {

/// Reads the file at `path` (named in errors as `label` tensors:PATH), checks it against
/// `config`'s model (`forward`: a script model's arguments) and returns the stream of `part`.
/// Throws Error in one line saying what the file holds and what the model needs.
std::unique_ptr<DataSource> make_tensor_data(const TrainConfig& config, const std::string& label,
                                             const std::string& path, DataPart part,
                                             const std::vector<ForwardArgument>& forward);

/// The files of --dataset tensors:PATH (`where` names the option and PATH in errors): PATH itself,
/// or for a folder every .safetensors, .npy, .npz, .pt and .pth file in it, in name order (the
/// shards of one dataset: their samples follow one another in that order). Throws Error for a
/// folder without any.
std::vector<std::string> data_files(const std::string& where, const std::string& path);

/// --check-data's reading of the zip archives among the run's --dataset and --eval-dataset
/// tensors: files (.npz, torch.save'd files) whole, each entry against its CRC-32 (the readers view
/// stored entries without reading every byte): the entries checked, and the archives left
/// unchecked in a build without zlib. Throws Error naming the option, the file and the entry.
struct ArchiveCheck {
  int64_t entries = 0;
  int64_t unchecked_archives = 0;
};
ArchiveCheck check_archive_crcs(const TrainConfig& config);

/// With --max-train-epochs, --save-every-n-epochs or --eval-every-n-epochs: sets `config`'s
/// epoch_samples (the training samples of its --dataset tensors: file, without a held-out part),
/// and with --max-train-epochs max_train_steps (ceil(epochs x samples / (batch x accumulation))). A
/// safetensors file is mapped, not read, for it. Throws Error naming the file or the option.
void set_steps_from_epochs(TrainConfig& config);

}  // namespace fusebox::trainer
