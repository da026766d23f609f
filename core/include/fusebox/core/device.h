// The device a training process runs on.
#pragma once

#include <c10/core/Device.h>

#include <string>

namespace fusebox {

/// Where a process trains: "cpu", or "cuda" for the GPU of its local rank.
struct DeviceRequest {
  std::string kind = "cpu";  ///< "cpu" or "cuda"
  int local_rank = 0;        ///< rank on this machine (LOCAL_RANK)
  int local_world_size = 1;  ///< processes on this machine (LOCAL_WORLD_SIZE)
};

/// The GPU index of local rank `local_rank` when `visible_gpus` GPUs are visible: each process
/// on a machine gets a GPU of its own, as in DDP. Throws Error (one line saying how to fix the
/// launch) when there are more processes than GPUs: ranks sharing a GPU would split its memory,
/// which is what fusebox exists to save, and NCCL refuses it.
int gpu_for_local_rank(int local_rank, int local_world_size, int visible_gpus);

/// The GPUs this process sees (0 without CUDA support in LibTorch or without a GPU).
int visible_gpus();

/// Resolves `request` and, for a GPU, makes it the process's current CUDA device, so that every
/// "cuda" tensor, CUDA kernel launch and allocator statistic without an explicit index refers to
/// it. Throws Error naming --device when the request cannot be met.
c10::Device select_device(const DeviceRequest& request);

}  // namespace fusebox
