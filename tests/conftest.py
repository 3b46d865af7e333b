"""Shared fixtures: the tiny model (built once per session, no downloads) and offline settings."""

import os

# Set before anything imports vLLM or the hub client: in-process engine (needed to reach the
# model for weight reloads), a small CPU KV cache, and no network.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from nanoagent.tiny import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_model")))
