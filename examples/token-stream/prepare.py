"""A tokenized corpus, written as nanoGPT writes one, for fusebox's transformer.

    python3 examples/token-stream/prepare.py OUT [TEXT]                      (needs NumPy)
    build/bin/trainer --config examples/token-stream/train.toml --dataset tensors:OUT/train.bin \
        --output-dir OUT/run

splits TEXT (default: the chapter in data/) into words and punctuation, numbers them by how
often they occur (OUT/vocab.txt: one token a line, id = line number; the rarest past 511 share
id 511, "<unk>") and writes the ids as uint16 with no header to OUT/train.bin: what
`ids.astype(np.uint16).tofile(path)` or an np.memmap writes, nanoGPT's train.bin. The trainer
maps the file, reads it as --token-dtype uint16 (train.toml), cuts it into windows of
--seq-len + 1 ids and holds the last tenth out for evaluation. Any tokenizer's ids work the same
way: write them with tofile, set --vocab-size above the largest id (and --token-dtype uint32 for
a vocabulary over 65536). `prepare.py OUT --check` then compares the run's last evaluation loss
with a uniform guess over the vocabulary (ln 512 = 6.24). The chapter is far too short to learn
much language from; give it a corpus of your own as TEXT.
"""
import collections
import json
import math
import os
import re
import sys

import numpy as np

VOCAB = 512
out = sys.argv[1]
if "--check" in sys.argv:
    with open(os.path.join(out, "run", "summary.json")) as f:
        summary = json.load(f)
    loss = summary["eval_loss"]
    print(f"last evaluation loss {loss:.3f}, a uniform guess {math.log(VOCAB):.3f}")
    # One chapter is far too little text to learn much language from: the held-out windows can
    # only be predicted about as well as the words' frequencies allow.
    sys.exit(0 if loss < math.log(VOCAB) - 0.4 else 1)

here = os.path.dirname(os.path.abspath(__file__))
text_path = sys.argv[2] if len(sys.argv) > 2 else os.path.join(
    here, "..", "..", "data", "pride-and-prejudice-ch1.txt")
with open(text_path, encoding="utf-8") as f:
    tokens = re.findall(r"\w+|[^\w\s]", f.read().lower())
counts = collections.Counter(tokens)
vocab = [word for word, _ in counts.most_common(VOCAB - 1)] + ["<unk>"]
index = {word: i for i, word in enumerate(vocab)}
ids = np.array([index.get(t, VOCAB - 1) for t in tokens], dtype=np.uint16)
os.makedirs(out, exist_ok=True)
ids.tofile(os.path.join(out, "train.bin"))
with open(os.path.join(out, "vocab.txt"), "w", encoding="utf-8") as f:
    f.write("\n".join(vocab) + "\n")
print(f"wrote {out}/train.bin ({len(ids)} ids, {len(counts)} distinct tokens) and {out}/vocab.txt")
