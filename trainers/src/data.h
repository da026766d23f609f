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
// --dataset tensors:PATH gives every model samples of the user's own (tensor_data.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "config.h"
#include "model.h"

namespace fusebox::trainer {

/// Which part of a file a stream draws from. With --eval-holdout F the file's last F (bytes of a
/// text file, samples of a tensors file; rounded down) is the evaluation's and the rest the
/// training's: the two share nothing.
struct DataPart {
  double holdout = 0;     ///< the fraction held out (0: none; the stream takes the whole file)
  bool held_out = false;  ///< true: this is the evaluation's stream, the held-out end
};

/// How many of `size` bytes or samples --eval-holdout `fraction` holds out: floor(size x
/// fraction). One rule for the streams and for the epochs worked out from the training part.
int64_t held_out(int64_t size, double fraction);

/// The training data stream's seed for --seed: its own, so that model initialisation and data
/// do not interfere.
uint64_t data_seed(int64_t seed);
/// A CPU generator seeded with data_seed(seed).
at::Generator data_generator(int64_t seed);
/// A fraction as it was given (0.1, not 0.100000).
std::string fraction_text(double f);

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
  /// Samples drawn so far, for a stream that walks through a file epoch by epoch (0 for the
  /// others); saved in checkpoints with the generator's state.
  virtual int64_t samples_drawn() const { return 0; }
  virtual void set_samples_drawn(int64_t) {}
  /// Starts the stream again from `seed`, as a fresh stream of that seed would start.
  virtual void restart(uint64_t seed);
  /// For a stream over a file of samples: the batches one pass over them in the file's order
  /// takes (the last may hold fewer samples); 0 for the others, which have no end.
  virtual int64_t pass_batches() const { return 0; }
  /// Batch `i` of that pass (0 <= i < pass_batches()). What it draws at random (the denoiser's
  /// noise and timesteps) comes from the seed of the last restart() and `i` alone, so any rank
  /// may make any batch of the pass and get the same one.
  virtual Batch pass_batch(int64_t i);
};

/// The data for `config`'s model and dataset; `forward` (a script model's arguments; none: a
/// script that makes its own data, which only --dataset none suits) says what a --dataset
/// tensors: file must hold. Throws Error naming an unreadable or unsuitable file.
std::unique_ptr<DataSource> make_data(const TrainConfig& config,
                                      const std::vector<ForwardArgument>& forward = {});

/// The held-out batches of --eval-every: the same task as make_data(config) (the same teacher
/// network or token permutation, made from --seed), from --eval-dataset or the end of the text
/// file that --eval-holdout keeps from training, drawn from a random stream of their own that
/// starts again at each evaluation, so every evaluation sees the same batches and none of the
/// training data stream is used.
class EvalData {
 public:
  explicit EvalData(const TrainConfig& config, const std::vector<ForwardArgument>& forward = {});
  /// The first of this evaluation's batches comes next.
  void rewind();
  Batch next() { return source_->next(); }
  /// --eval-batches 0: every sample once, as the batches of one pass (see DataSource).
  int64_t pass_batches() const { return source_->pass_batches(); }
  Batch pass_batch(int64_t i) { return source_->pass_batch(i); }
  /// One line describing the data.
  std::string describe() const;

 private:
  std::unique_ptr<DataSource> source_;
  uint64_t seed_;
};

}  // namespace fusebox::trainer
