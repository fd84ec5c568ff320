#!/usr/bin/env python3
"""PyTorch side of scripts/bench-embed-vs-pytorch.sh.

  bench_embed_pytorch.py gen DIR L [L ...]
      Writes DIR/lenL.txt: 64 lines of L-2 common words (one WordPiece token
      each), so that [CLS] + words + [SEP] is L tokens. Deterministic.

  bench_embed_pytorch.py serve MODEL_DIR THREADS
      Loads the model with sentence-transformers on CPU, sets
      torch.set_num_threads(THREADS), prints "ready <versions>", then for
      every stdin line "FILE BATCH" embeds the file's lines once as a
      warm-up and once timed (encode(texts, batch_size=BATCH)) and prints
      the timed inputs/s.
"""

import random
import sys
import time

WORDS = (
    "the a man woman child dog cat car house tree city river water light sound music book "
    "red blue green old new big small good time day night world people family school work "
    "open runs jumps walks reads plays sings quickly slowly under over near far happy"
).split()

LINES = 64


def gen(out_dir, lengths):
    for length in lengths:
        rng = random.Random(1000 + length)
        with open(f"{out_dir}/len{length}.txt", "w", encoding="utf-8") as f:
            for _ in range(LINES):
                f.write(" ".join(rng.choice(WORDS) for _ in range(length - 2)) + "\n")


def serve(model_dir, threads):
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(model_dir, device="cpu")
    import sentence_transformers

    print(
        f"ready torch {torch.__version__} sentence-transformers {sentence_transformers.__version__} "
        f"threads {torch.get_num_threads()}",
        flush=True,
    )
    for line in sys.stdin:
        path, batch = line.split()
        batch = int(batch)
        with open(path, encoding="utf-8") as f:
            texts = f.read().rstrip("\n").split("\n")
        with torch.inference_mode():
            model.encode(texts, batch_size=batch)  # warm-up
            t = time.perf_counter()
            model.encode(texts, batch_size=batch)
            dt = time.perf_counter() - t
        print(f"{len(texts) / dt:.1f}", flush=True)


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "gen":
        gen(sys.argv[2], [int(x) for x in sys.argv[3:]])
    elif len(sys.argv) == 4 and sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
