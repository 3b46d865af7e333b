"""
Index build and search speed on this machine (prints figures; asserts nothing).

    python bench/bench_index.py                  # packaged MiniLM, CPU
    python bench/bench_index.py --passages 4000 --encoder PATH

1. Build: build_index.py end to end (copy into the document store, embed, FAISS flat index) on
   passages of HotpotQA's length: the BeIR HotpotQA corpus averages about 46 words per passage
   (title + text), so synthetic-world passages are joined until each has at least 46 words.
   Passages/s, median of --repeats fresh builds, and the encoder alone on the same texts; then the
   projected time to index the full corpus (5,233,329 passages) at that rate.
2. Search: IndexRetriever.search with a batch of 64 questions (one turn of 64 live trajectories):
   queries/s for encoding + FAISS + reading the passages, over the index built above.
3. FAISS alone at scale: flat inner-product search of 64 queries over 1M random unit vectors
   (the encoder's width), scaled linearly to 5.23M, and IVF (nlist 4096, nprobe 64) over the same
   1M, which is why big corpora want --index-type=ivf (or hnsw) on a CPU.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import build_index  # noqa: E402
from bench.timing import median_time  # noqa: E402
from nanoagent.retriever import (IndexRetriever, encode, load_encoder, packaged_minilm_path,  # noqa: E402
                                 passage_text)
from nanoagent.tasks.synthetic import make_split  # noqa: E402

HOTPOTQA_PASSAGES = 5_233_329
HOTPOTQA_WORDS = 46


def hotpotqa_length_passages(n):
    """n passages of >= 46 words, made by joining synthetic passages (a big enough world)."""
    scale = max(1, n // 60)
    train, val, corpus = make_split(seed=0, people=200 * scale, companies=40 * scale, cities=50 * scale,
                                    countries=10 * scale)
    out, words, texts = [], 0, []
    for p in corpus:
        texts.append(p["text"])
        words += len(p["text"].split())
        if words >= HOTPOTQA_WORDS:
            out.append({"id": str(len(out)), "title": p["title"], "text": " ".join(texts)})
            words, texts = 0, []
            if len(out) == n:
                break
    return out, [r["question"] for r in train + val]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passages", type=int, default=2000)
    parser.add_argument("--encoder", default=None, help="default: the packaged all-MiniLM-L6-v2")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=int, default=1_000_000, help="vectors in the FAISS-only benchmark")
    args = parser.parse_args()
    import faiss
    import torch
    encoder_path = args.encoder or packaged_minilm_path()
    encoder = load_encoder(encoder_path)
    passages, questions = hotpotqa_length_passages(args.passages)
    words = statistics.mean(len(passage_text(p).split()) for p in passages)
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"faiss {faiss.__version__}, cuda {torch.cuda.is_available()} | "
          f"encoder {os.path.basename(encoder_path.rstrip('/'))} | "
          f"{len(passages)} passages of {words:.0f} words on average")

    # 1. build
    tmp = tempfile.mkdtemp()
    corpus = os.path.join(tmp, "corpus.jsonl")
    with open(corpus, "w") as f:
        import json
        f.writelines(json.dumps(p) + "\n" for p in passages)
    out = os.path.join(tmp, "index")

    def build():
        shutil.rmtree(out, ignore_errors=True)
        build_index.main([f"--corpus={corpus}", f"--out={out}", f"--encoder={encoder_path}",
                          f"--batch-size={args.batch_size}"])

    build()  # warm-up (and the index for the search benchmark)
    texts = [passage_text(p) for p in passages]
    t_encode = median_time(lambda: encode(encoder, texts, batch_size=args.batch_size), args.repeats)
    t_build = median_time(build, args.repeats)
    rate = len(passages) / t_build
    print(f"build (end to end): {rate:.0f} passages/s | "
          f"encoder alone: {len(passages) / t_encode:.0f} passages/s (median of {args.repeats})")
    print(f"projected: the full HotpotQA corpus ({HOTPOTQA_PASSAGES:,} passages) in "
          f"{HOTPOTQA_PASSAGES / rate / 3600:.1f} h on this machine; "
          f"divide by the speed-up of your GPUs x their number under torchrun")

    # 2. search through the tool's path
    retriever = IndexRetriever(out, encoder)
    batch = questions[:64]
    retriever.search(batch, 3)
    t_search = median_time(lambda: retriever.search(batch, 3), max(5, args.repeats))
    t_query_encode = median_time(lambda: encode(encoder, batch), max(5, args.repeats))
    print(f"search, batch of 64, top-3, {len(passages)} passages: {64 / t_search:.0f} queries/s "
          f"({t_search * 1000:.0f} ms per batch, of which encoding {t_query_encode * 1000:.0f} ms)")

    # 3. FAISS alone at scale
    dim = retriever.meta["dim"]
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((args.scale, dim), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    queries = vectors[rng.choice(args.scale, 64, replace=False)] + 0.01
    flat = faiss.IndexFlatIP(dim)
    flat.add(vectors)
    t_flat = median_time(lambda: flat.search(queries, 3), args.repeats)
    projected = t_flat * HOTPOTQA_PASSAGES / args.scale
    print(f"faiss flat, 64 queries over {args.scale:,} x {dim}: {t_flat * 1000:.0f} ms -> "
          f"over {HOTPOTQA_PASSAGES:,}: ~{projected:.1f} s per batch of 64 ({64 / projected:.0f} queries/s)")
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, 4096, faiss.METRIC_INNER_PRODUCT)
    start = time.perf_counter()
    ivf.train(vectors[: 4096 * 39])
    ivf.add(vectors)
    t_ivf_build = time.perf_counter() - start
    ivf.nprobe = 64
    t_ivf = median_time(lambda: ivf.search(queries, 3), args.repeats)
    print(f"faiss ivf4096 nprobe 64, same 1M: build {t_ivf_build:.0f} s, "
          f"search {t_ivf * 1000:.0f} ms per batch of 64 ({64 / t_ivf:.0f} queries/s; "
          f"cost grows ~linearly with the corpus at fixed nlist, ~sqrt with nlist = 4 sqrt(N))")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
