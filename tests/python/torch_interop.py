"""fusebox and Python's PyTorch, both ways, value for value:
- torch.load reads what the trainer's --save-model writes (.pt), and a safetensors reader (the
  safetensors package when installed, else this file's own, written from the format's
  specification) reads the .safetensors files;
- the trainer's --init-weights reads what torch.save and a safetensors writer write (torch.save'd
  views of one storage, an archive re-zipped compressed, and fp8 safetensors weights, too);
- a module scripted in Python (torch.jit.script) trains with --model-script on samples written by
  torch.save (--dataset tensors:), its forward taking them by name, and torch.jit.load reads the
  trained module back with the weights the samples were made with;
- arrays written by NumPy's np.save (Fortran-ordered floats, a uint16 token stream), np.savez
  and np.savez_compressed (named input and target; the same run from either) and tofile (a headerless .bin of uint16 ids, as nanoGPT's train.bin)
  train as --dataset tensors: files.
Run by ctest (tests/CMakeLists.txt, where a python3 imports torch: Debian's python3-torch) and by
bench/gpu_check.sh:  python3 tests/python/torch_interop.py TRAINER FOLDER
"""
import json
import os
import struct
import subprocess
import sys
from typing import Optional

import torch

trainer, folder = sys.argv[1], sys.argv[2]
os.makedirs(folder, exist_ok=True)


def path(name):
    return os.path.join(folder, name)


def run(*args):
    result = subprocess.run([trainer, "--log-every", "0", "--threads", "1", "--device", "cpu"] +
                            list(args), capture_output=True, text=True)
    assert result.returncode == 0, f"trainer {' '.join(args)}: exit {result.returncode}\n" + \
        result.stderr
    return result.stdout


def same(a, b, what):
    assert sorted(a) == sorted(b), f"{what}: names {sorted(a)} vs {sorted(b)}"
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: '{k}' differs"
    print(f"{what}: {len(a)} tensors equal")


# safetensors from its specification: an 8-byte little-endian header size, a JSON header of dtype,
# shape and byte range per tensor (padded with spaces to 8 bytes, as the safetensors package
# does), then the little-endian bytes.
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}


def spec_save_file(tensors, name):
    header, blobs, offset = {}, [], 0
    for key, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[key] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(name, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def spec_load_file(name):
    with open(name, "rb") as f:
        data = f.read()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    header.pop("__metadata__", None)
    by_name = {v: k for k, v in DTYPES.items()}
    out = {}
    for key, info in header.items():
        begin, end = info["data_offsets"]
        raw = bytearray(data[8 + size + begin:8 + size + end])
        t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out[key] = t.view(by_name[info["dtype"]]).reshape(info["shape"])
    return out


try:
    from safetensors.torch import load_file, save_file
    print("safetensors: the package's load_file and save_file")
except ImportError:
    load_file, save_file = spec_load_file, spec_save_file
    print("safetensors: read and written from the format's specification (no package installed)")

# ---- Weights files -----------------------------------------------------------------------------
# Every learning rate scaled to 0: the files hold the initial weights, the same in every run.
MLP = ["--model", "mlp", "--model-width", "32", "--max-train-steps", "1", "--optimizer", "adamw",
       "--lr-scale", "*=0"]
run(*MLP, "--output-dir", path("pt"), "--save-model", path("trained.pt"))
run(*MLP, "--output-dir", path("st"), "--save-model", path("trained.safetensors"))
trained = torch.load(path("trained.pt"))
assert isinstance(trained, dict) and len(trained) == 6, f"unexpected {type(trained)}"
same(trained, load_file(path("trained.safetensors")), "--save-model .pt vs .safetensors")
run(*MLP, "--output-dir", path("bf16"), "--save-model", path("bf16.safetensors"),
    "--save-precision", "bf16")
same({k: v.bfloat16() for k, v in trained.items()}, load_file(path("bf16.safetensors")),
     "--save-model --save-precision bf16")

half = {k: v * 0.5 for k, v in trained.items()}
torch.save(half, path("half.pt"))
run(*MLP, "--output-dir", path("from_pt"), "--init-weights", path("half.pt"), "--save-model",
    path("from_pt.pt"))
same(half, torch.load(path("from_pt.pt")), "torch.save -> --init-weights")
save_file(half, path("half.safetensors"))
run(*MLP, "--output-dir", path("from_st"), "--init-weights", path("half.safetensors"),
    "--save-model", path("from_st.pt"))
same(half, torch.load(path("from_st.pt")), "safetensors writer -> --init-weights")

# torch.save'd tensors are mapped, each a view of its storage's record: views of one flat storage
# (torch.save writes it once, each tensor at its offset) must read as themselves.
flat = torch.cat([v.flatten() for v in half.values()])
views, at = {}, 0
for k, v in half.items():
    views[k] = flat[at:at + v.numel()].view(v.shape)
    at += v.numel()
torch.save(views, path("views.pt"))
run(*MLP, "--output-dir", path("from_views"), "--init-weights", path("views.pt"), "--save-model",
    path("from_views.pt"))
same(half, torch.load(path("from_views.pt")), "torch.save'd views of one storage -> --init-weights")
# fp8 weights (safetensors F8_E4M3, as published fp8 checkpoints hold them) start a run with
# their exact values: the codes of 0.5, 1, -1, 0.125, 448 (the largest) and 2^-9 (the smallest).
E4M3 = {0x30: 0.5, 0x38: 1.0, 0xB8: -1.0, 0x20: 0.125, 0x7E: 448.0, 0x01: 2.0 ** -9}
header, blobs, offset, fp8_values = {}, [], 0, {}
for k, v in half.items():
    codes = [list(E4M3)[i % len(E4M3)] for i in range(v.numel())]
    header[k] = {"dtype": "F8_E4M3", "shape": list(v.shape),
                 "data_offsets": [offset, offset + v.numel()]}
    fp8_values[k] = torch.tensor([E4M3[c] for c in codes], dtype=v.dtype).view(v.shape)
    blobs.append(bytes(codes))
    offset += v.numel()
raw_header = json.dumps(header).encode()
raw_header += b" " * ((8 - len(raw_header) % 8) % 8)
with open(path("fp8.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(raw_header)) + raw_header + b"".join(blobs))
run(*MLP, "--output-dir", path("from_fp8"), "--init-weights", path("fp8.safetensors"),
    "--save-model", path("from_fp8.pt"))
same(fp8_values, torch.load(path("from_fp8.pt")), "safetensors F8_E4M3 -> --init-weights")
# Records that cannot be viewed (the archive re-zipped compressed) are read the usual way.
import zipfile  # noqa: E402
with zipfile.ZipFile(path("half.pt")) as src, \
        zipfile.ZipFile(path("deflated.pt"), "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        dst.writestr(info.filename, src.read(info.filename))
run(*MLP, "--output-dir", path("from_deflated"), "--init-weights", path("deflated.pt"),
    "--save-model", path("from_deflated.pt"))
same(half, torch.load(path("from_deflated.pt")), "torch.save re-zipped compressed -> --init-weights")


# ---- A module scripted in Python, trained on samples saved by Python ---------------------------
class Fit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    # The arguments are not in the file's (alphabetical) order, and one has a default.
    def forward(self, y: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor] = None):
        err = (self.linear(x).squeeze(1) - y) ** 2
        if weight is not None:
            err = err * weight
        return err.mean()


torch.manual_seed(0)
torch.jit.script(Fit()).save(path("fit.pt"))
x = torch.randn(256, 3, dtype=torch.float64)
true_w, true_b = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64), 0.25
torch.save({"x": x, "y": x @ true_w + true_b}, path("xy.pt"))
out = run("--model-script", path("fit.pt"), "--dataset", "tensors:" + path("xy.pt"), "--dtype",
          "float64", "--optimizer", "sgd", "--learning-rate", "0.1", "--train-batch-size", "16",
          "--max-train-steps", "300", "--output-dir", path("fit"), "--save-model",
          path("fitted.pt"))
assert "tensors " + path("xy.pt") + " (256 samples: y [] Double, x [3] Double" in out, out
fitted = torch.jit.load(path("fitted.pt"))
w, b = fitted.linear.weight.detach().flatten(), fitted.linear.bias.detach().item()
assert torch.allclose(w, true_w, atol=1e-4) and abs(b - true_b) < 1e-4, f"fitted {w}, {b}"
print(f"torch.jit.script module on torch.save'd samples: fitted {w.tolist()}, {b:.6f}")


# ---- Arrays saved by NumPy (np.save), read mapped as --dataset tensors: ------------------------
import numpy as np  # noqa: E402  (PyTorch needs NumPy: it is there whenever torch is)


class Center(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c = torch.nn.Parameter(torch.zeros(3))

    def forward(self, rows: torch.Tensor):
        return ((rows - self.c) ** 2).mean()


rows = np.asfortranarray(np.random.default_rng(1).normal([1.0, -2.0, 3.0], 0.1, (64, 3)))
np.save(path("rows.npy"), rows.astype(np.float32))  # Fortran order: read with its strides
torch.jit.script(Center()).save(path("center.pt"))
out = run("--model-script", path("center.pt"), "--dataset", "tensors:" + path("rows.npy"),
          "--optimizer", "sgd", "--learning-rate", "0.5", "--train-batch-size", "64",
          "--max-train-steps", "60", "--output-dir", path("center"), "--save-model",
          path("centered.pt"))
assert "tensors " + path("rows.npy") + " (64 samples: rows [3] Float" in out, out
c = torch.jit.load(path("centered.pt")).c.detach()
assert torch.allclose(c, torch.tensor(rows.mean(0), dtype=torch.float32), atol=1e-4), c
print(f"np.save'd Fortran-ordered rows: fitted their column means {c.tolist()}")
ids = np.random.default_rng(2).integers(0, 60000, 4001).astype(np.uint16)
assert ids.max() > 32767  # read as int16 they would be negative, and refused
np.save(path("ids.npy"), ids)
out = run("--model", "transformer", "--model-width", "16", "--vocab-size", "60000", "--seq-len",
          "16", "--dataset", "tensors:" + path("ids.npy"), "--optimizer", "sgd",
          "--max-train-steps", "2", "--output-dir", path("ids"))
assert "(250 samples: ids [17] Int, windows of a stream of 4001 ids" in out, out
print("np.save'd uint16 token stream: 250 windows of 17 ids")
ids.tofile(path("train.bin"))  # nanoGPT's train.bin: the ids alone, no header
out = run("--model", "transformer", "--model-width", "16", "--vocab-size", "60000", "--seq-len",
          "16", "--dataset", "tensors:" + path("train.bin"), "--optimizer", "sgd",
          "--max-train-steps", "2", "--output-dir", path("bin"))
assert "(250 samples: train [17] Int, windows of a stream of 4001 ids" in out, out
print("tofile'd uint16 token stream (.bin, --token-dtype uint16): 250 windows of 17 ids")
x = np.random.default_rng(3).normal(size=(128, 4)).astype(np.float32)
np.savez(path("xy.npz"), input=x, target=np.tanh(x.sum(1, keepdims=True)))
out = run("--model", "mlp", "--model-width", "4", "--dataset", "tensors:" + path("xy.npz"),
          "--optimizer", "adamw", "--max-train-steps", "2", "--output-dir", path("xy"))
assert "(128 samples: input [4] Float, target [1] Float" in out, out
print("np.savez'd input and target: 128 samples")


def last_loss(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)["last_loss"]


version = subprocess.run([trainer, "--version"], capture_output=True, text=True).stdout
if "np.savez_compressed (zlib) yes" in version:
    np.savez_compressed(path("xy_deflated.npz"), input=x, target=np.tanh(x.sum(1, keepdims=True)))
    out = run("--model", "mlp", "--model-width", "4", "--dataset",
              "tensors:" + path("xy_deflated.npz"), "--optimizer", "adamw", "--max-train-steps",
              "2", "--output-dir", path("xy_deflated"))
    assert "(128 samples: input [4] Float, target [1] Float" in out, out
    assert last_loss(path("xy_deflated")) == last_loss(path("xy")), \
        (last_loss(path("xy_deflated")), last_loss(path("xy")))
    print("np.savez_compressed'd input and target: the same run as np.savez's")
else:
    print("np.savez_compressed: skipped, this trainer was built without zlib")
print("torch interop: all equal")
