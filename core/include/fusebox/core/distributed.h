// Data-parallel training on PyTorch's distributed engine (c10d): Gloo process groups on CPU,
// rendezvous through a TCPStore, set up the torchrun way (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT).
//
//   fusebox::DistributedConfig dc = fusebox::distributed_config_from_env();
//   auto comm = fusebox::connect(dc);            // blocks until every rank has joined
//   fusebox::StepOptions so;
//   so.comm = comm;                              // gradients are averaged before any step
//   auto mode = fusebox::make_fused_backward(optimizer, so);
//
// Every collective call takes the configured timeout: a rank that dies makes the others fail with
// a DistributedError at the next collective, a rank that hangs makes them fail after `timeout`.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "fusebox/error.h"

namespace at {
class Tensor;
}

namespace fusebox {

/// Where this process sits in the job and how to reach the others.
struct DistributedConfig {
  int rank = 0;                           ///< this process's rank, 0 .. world_size-1
  int world_size = 1;                     ///< number of processes; 1 means no distribution at all
  int local_rank = 0;                     ///< rank on this machine (selects the GPU on CUDA)
  int local_world_size = 1;               ///< processes on this machine (they share its cores)
  std::string master_addr = "127.0.0.1";  ///< rank 0's address (the TCPStore runs there)
  int master_port = 29500;                ///< rank 0's TCPStore port
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};  ///< rendezvous and collectives
};

/// Reads torchrun's environment variables; world_size 1 when WORLD_SIZE is unset. Throws Error
/// naming the variable when one is malformed or inconsistent (e.g. RANK >= WORLD_SIZE).
DistributedConfig distributed_config_from_env();

/// A failed or timed-out collective, or a failed rendezvous.
class FUSEBOX_VISIBLE DistributedError : public Error {
 public:
  using Error::Error;
};

/// The collectives fusebox needs, over one process group.
class FUSEBOX_VISIBLE Communicator {
 public:
  /// An operation in flight. Tensors handed to it must stay untouched until wait() returns.
  class Pending {
   public:
    virtual ~Pending();
    /// True once the operation has finished (never blocks).
    virtual bool done() = 0;
    /// Blocks until finished (at most the timeout); throws DistributedError on failure.
    virtual void wait() = 0;
  };

  virtual ~Communicator();
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// Starts replacing every tensor with its mean over the ranks (the sum divided by the world
  /// size), in one flat buffer for all: of doubles when any tensor is double, else of floats.
  virtual std::unique_ptr<Pending> average(std::vector<at::Tensor> tensors) = 0;
  /// Starts copying `tensors` from rank `root` into the same tensors on every other rank.
  virtual std::unique_ptr<Pending> broadcast(std::vector<at::Tensor> tensors, int root) = 0;
  /// Starts a sum over the ranks of a small double vector, in place.
  virtual std::unique_ptr<Pending> sum(at::Tensor values) = 0;
  /// Blocks until every rank has arrived.
  virtual void barrier() = 0;
};

/// The type Communicator::average sums a floating tensor of type `t` in: double stays double,
/// every narrower floating type travels (and is summed) as float, as Gloo reduces only those two.
inline at::ScalarType average_wire_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

/// Copies `params` (a model's parameters or buffers) from rank `root` to every rank; blocks.
void broadcast_parameters(Communicator& comm, const std::vector<at::Tensor>& params, int root);

/// Every rank's `mine`, indexed by rank, on every rank (sizes may differ); blocks.
std::vector<std::string> all_gather_bytes(Communicator& comm, const std::string& mine);
/// Every rank's `mine`, indexed by rank, on rank `root` only (elsewhere: empty); blocks. Other
/// ranks hold at most one rank's bytes at a time (a sharded optimizer state stays sharded).
std::vector<std::string> gather_bytes(Communicator& comm, const std::string& mine, int root);

/// A TCP port free on 127.0.0.1 right now (the kernel's pick), e.g. for MASTER_PORT of a job on
/// one machine. Throws Error when no socket can be bound.
int free_local_port();

/// True when this build of fusebox has c10d (Gloo) support.
bool distributed_available();

/// Joins the process group described by `config` (Gloo; blocks until all ranks have joined or the
/// timeout passes). Throws DistributedError naming MASTER_ADDR/MASTER_PORT when that fails.
std::shared_ptr<Communicator> connect(const DistributedConfig& config);

}  // namespace fusebox
