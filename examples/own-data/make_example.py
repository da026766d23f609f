"""Your own model and data, made in Python, trained by fusebox's trainer.

    python3 examples/own-data/make_example.py OUT        (needs PyTorch)
    build/bin/trainer --config examples/own-data/train.toml --model-script OUT/net.pt \
        --dataset tensors:OUT/train.pt --output-dir OUT/run --save-model OUT/trained.pt

writes OUT/net.pt, a TorchScript classifier whose forward(features, label) returns the loss,
and OUT/train.pt, 2000 samples of two interleaved spirals (torch.save'd tensors named after
forward's arguments; safetensors.torch.save_file writes the same data as a file the trainer maps
instead of reading). The trainer takes the tensors by name, shuffles them each epoch, and writes
the trained module back (torch.jit.load reads it). `make_example.py OUT --check` then prints the
trained module's accuracy on the samples.
"""
import math
import os
import sys

import torch


class Classifier(torch.nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(2, width), torch.nn.GELU(), torch.nn.Linear(width, width),
            torch.nn.GELU(), torch.nn.Linear(width, 2))

    # The trainer calls forward with the data file's tensors, by name, and minimises what it
    # returns.
    def forward(self, features: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.net(features), label)


def spirals(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    label = torch.arange(n) % 2
    t = torch.rand(n, generator=g) * 3 * math.pi
    angle = t + label * math.pi
    features = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], 1) / (3 * math.pi)
    return features + 0.02 * torch.randn(n, 2, generator=g), label


out = sys.argv[1]
os.makedirs(out, exist_ok=True)
features, label = spirals(2000)
if "--check" in sys.argv:
    trained = torch.jit.load(os.path.join(out, "trained.pt"))
    with torch.no_grad():
        accuracy = (trained.net(features).argmax(1) == label).double().mean().item()
    print(f"accuracy {accuracy:.3f}")
    sys.exit(0 if accuracy > 0.9 else 1)
torch.manual_seed(0)
torch.jit.script(Classifier()).save(os.path.join(out, "net.pt"))
torch.save({"features": features, "label": label}, os.path.join(out, "train.pt"))
print(f"wrote {out}/net.pt and {out}/train.pt (2000 samples)")
