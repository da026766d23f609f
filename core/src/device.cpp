// Picks the training device: the CPU, or the local rank's own GPU.
#include "fusebox/core/device.h"

#include "fusebox/error.h"

#if defined(FUSEBOX_WITH_CUDA)
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace fusebox {

int gpu_for_local_rank(int local_rank, int local_world_size, int visible_gpus) {
  if (visible_gpus <= 0)
    throw Error(
        "--device cuda: this LibTorch has no CUDA support or no GPU is visible (nvidia-smi lists "
        "the GPUs); train with --device cpu");
  if (local_rank < 0 || local_rank >= visible_gpus) {
    const std::string n = std::to_string(visible_gpus);
    throw Error("--device cuda: local rank " + std::to_string(local_rank) + " of " +
                std::to_string(local_world_size) + " on this machine has no GPU of its own (" + n +
                " visible): start at most " + n +
                " processes per machine (--nproc-per-node), or check CUDA_VISIBLE_DEVICES and "
                "LOCAL_RANK");
  }
  return local_rank;
}

int visible_gpus() {
#if defined(FUSEBOX_WITH_CUDA)
  return static_cast<int>(c10::cuda::device_count());
#else
  return 0;  // a LibTorch without CUDA
#endif
}

c10::Device select_device(const DeviceRequest& request) {
  if (request.kind == "cpu") return c10::Device(c10::kCPU);
  if (request.kind != "cuda")
    throw Error("--device " + request.kind + ": unknown device; use cpu or cuda");
  const int index =
      gpu_for_local_rank(request.local_rank, request.local_world_size, visible_gpus());
#if defined(FUSEBOX_WITH_CUDA)
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
#endif
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

}  // namespace fusebox
