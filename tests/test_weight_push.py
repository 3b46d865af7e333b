"""
A weight push into the real vLLM CPU engine says something only when something is wrong. vLLM's
reload_weights warns "<layer>: Failed to load weights" for each layer that none of the pushed
weights went to, and puts that layer's own tensors back. Of the tiny Qwen2 model's layers that is
one, the RotaryEmbedding, on every push: its one tensor is a buffer, the cos/sin table computed from
the config, and it keeps the table. The engine drops that warning (engine.keep_reload_warning) and
keeps it for a layer with parameters that was not sent, which would generate with stale weights.
"""

import logging

import pytest
import torch
from transformers import AutoTokenizer

from padded import load_causal_lm
from nanoagent.engine import RELOAD_LOGGER, VLLMEngine, keep_reload_warning, stop_token_ids


class Warnings(logging.Handler):
    """The messages vLLM's reload logger lets through (its filters run before any handler)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def engine(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = VLLMEngine(tiny_model_dir,
                        stop_token_ids(tok),
                        max_model_len=128,
                        dtype="float32",
                        seed=0,
                        compile=False)
    yield engine
    del engine
    # its world of one goes with it (tests/conftest.py: process_group)
    from vllm.distributed import cleanup_dist_env_and_memory
    cleanup_dist_env_and_memory()


def rotary_tables(model):
    return {name: buffer.clone() for name, buffer in model.named_buffers() if "rotary_emb" in name}


def test_a_weight_push_warns_only_of_a_layer_with_parameters_left_out(engine, tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    logger, warnings = logging.getLogger(RELOAD_LOGGER), Warnings()
    logger.addHandler(warnings)
    try:
        [before] = engine.llm.apply_model(rotary_tables)
        # one table, shared by the layers
        assert list(before) == ["model.layers.0.self_attn.rotary_emb.cos_sin_cache"]
        logger.removeFilter(keep_reload_warning)  # what vLLM says of a whole push, unfiltered
        engine.load_weights(model.named_parameters(remove_duplicate=False))
        assert warnings.messages == ["RotaryEmbedding: Failed to load weights"]
        [after] = engine.llm.apply_model(rotary_tables)
        # the table it warned of, as it was
        assert all(torch.equal(before[name], after[name]) for name in before)

        logger.addFilter(keep_reload_warning)
        warnings.messages.clear()
        engine.load_weights(model.named_parameters(remove_duplicate=False))
        assert warnings.messages == []
        engine.load_weights((name, p)
                            for name, p in model.named_parameters(remove_duplicate=False)
                            if name != "model.norm.weight")
        # a layer with parameters left out still warns
        assert warnings.messages == ["RMSNorm: Failed to load weights"]
    finally:
        logger.removeHandler(warnings)
        logger.addFilter(keep_reload_warning)
