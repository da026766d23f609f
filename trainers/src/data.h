// Training data: deterministic synthetic batches for each built-in model, byte-level text for
// the transformer, or nothing (a script model that makes its own data).
//
// Batches are made on the CPU in float32 / int64; the run loop moves them to the device and dtype.
//   mlp:         input [B, width] ~ N(0, 1), target [B, 1] from a fixed random teacher network
//   transformer: input [B, seq_len] tokens, target = the next tokens; synthetic sequences follow a
//                fixed random permutation of the vocabulary (tok[i+1] = perm[tok[i]]), text data
//                are random windows of the file's bytes (of its first part, with --eval-holdout)
//   denoiser:    input [B, 3, S, S] smooth random images in [-1, 1], noise ~ N(0, 1), timesteps
//   script:      synthetic: input [B, width] ~ N(0, 1); text: tokens [B, seq_len + 1]; none: an
//                empty tensor
#pragma once

#include <memory>
#include <string>

#include "config.h"
#include "model.h"

namespace fusebox::trainer {

/// An endless stream of batches.
class DataSource {
 public:
  virtual ~DataSource() = default;
  /// The next batch (deterministic for a given seed).
  virtual Batch next() = 0;
  /// One line describing the data.
  virtual std::string describe() const = 0;
  /// The generator behind the stream (its state is saved in checkpoints to resume exactly).
  virtual at::Generator& generator() = 0;
};

/// The data for `config`'s model and dataset; throws Error naming an unreadable file.
std::unique_ptr<DataSource> make_data(const TrainConfig& config);

/// The held-out batches of --eval-every: the same task as make_data(config) (the same teacher
/// network or token permutation, made from --seed), from --eval-dataset or the end of the text
/// file that --eval-holdout keeps from training, drawn from a random stream of their own that
/// starts again at each evaluation, so every evaluation sees the same batches and none of the
/// training data stream is used.
class EvalData {
 public:
  explicit EvalData(const TrainConfig& config);
  /// The first of this evaluation's batches comes next.
  void rewind();
  Batch next() { return source_->next(); }
  /// One line describing the data.
  std::string describe() const;

 private:
  std::unique_ptr<DataSource> source_;
  uint64_t seed_;
};

}  // namespace fusebox::trainer
