"""Weights files between fusebox and Python: torch.load (and safetensors' loader, when installed)
reads what the trainer's --save-model wrote, and the trainer's --init-weights reads what torch.save
(and safetensors' save_file) wrote, value for value. bench/gpu_check.sh runs it on a machine with
PyTorch:  python3 bench/weights_interop.py TRAINER FOLDER
"""
import os
import subprocess
import sys

import torch

trainer, folder = sys.argv[1], sys.argv[2]
os.makedirs(folder, exist_ok=True)
# Every learning rate scaled to 0: the files hold the initial weights, the same in every run.
BASE = [trainer, "--model", "mlp", "--model-width", "32", "--max-train-steps", "1",
        "--log-every", "0", "--optimizer", "adamw", "--lr-scale", "*=0", "--device", "cpu"]


def train(name, *args):
    subprocess.run(BASE + ["--output-dir", os.path.join(folder, name)] + list(args), check=True)


def path(name):
    return os.path.join(folder, name)


def same(a, b, what):
    assert sorted(a) == sorted(b), f"{what}: names {sorted(a)} vs {sorted(b)}"
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: '{k}' differs"
    print(f"{what}: {len(a)} tensors equal")


try:
    from safetensors.torch import load_file, save_file
except ImportError:
    load_file = save_file = None
    print("safetensors is not installed: its files are checked through fusebox alone")

train("pt", "--save-model", path("trained.pt"))
train("st", "--save-model", path("trained.safetensors"))
trained = torch.load(path("trained.pt"))
assert isinstance(trained, dict) and len(trained) == 6, f"unexpected {type(trained)}"
if load_file:
    same(trained, load_file(path("trained.safetensors")), "--save-model .pt vs .safetensors")

half = {k: v * 0.5 for k, v in trained.items()}
torch.save(half, path("half.pt"))
train("from_pt", "--init-weights", path("half.pt"), "--save-model", path("from_pt.pt"))
same(half, torch.load(path("from_pt.pt")), "torch.save -> --init-weights")
# A safetensors file fusebox wrote, read back by fusebox, equals what torch.load gave.
train("from_st", "--init-weights", path("trained.safetensors"), "--save-model", path("from_st.pt"))
same(trained, torch.load(path("from_st.pt")), "--save-model .safetensors -> --init-weights")
if save_file:
    save_file(half, path("half.safetensors"))
    train("from_py_st", "--init-weights", path("half.safetensors"), "--save-model",
          path("from_py_st.pt"))
    same(half, torch.load(path("from_py_st.pt")), "safetensors save_file -> --init-weights")
print("weights interop: all equal")
