#!/usr/bin/env bash
# make speedrun: the HotpotQA search agent on one GPU node, from nothing to report.md.
#   install -> prepare HotpotQA -> embed + index the Wikipedia corpus -> RL (torchrun over all GPUs)
#   -> evaluate on the validation set -> report.md (metrics, curves, wall time per stage, GPU-hours)
# A stage that finished is skipped on a rerun (delete $OUT/done/<stage> to redo it); an interrupted
# index build or training run resumes where it stopped. Settings come from the environment:
#   NGPU=8 MODEL=Qwen/Qwen2.5-3B-Instruct ALGO=grpo OUT=out/speedrun TRAIN_SIZE=20000 VAL_SIZE=500 \
#   ENCODER=intfloat/e5-base-v2 EXTRA="steps=300 train.lr=5e-7" make speedrun
# Offline inputs: SOURCE=<folder of HotpotQA JSON files> CORPUS=<corpus JSONL>; NGPU=1 without a GPU
# runs every stage on the CPU with gloo (tests/test_speedrun.py does, with the tiny model).
set -euo pipefail

NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
ALGO=${ALGO:-grpo}
OUT=${OUT:-out/speedrun}
DATA=${DATA:-data/hotpotqa}
TRAIN_SIZE=${TRAIN_SIZE:-20000}
VAL_SIZE=${VAL_SIZE:-500}
SOURCE=${SOURCE:-}
CORPUS=${CORPUS:-BeIR/hotpotqa}
ENCODER=${ENCODER:-intfloat/e5-base-v2}
QUERY_PREFIX=${QUERY_PREFIX-"query: "}
PASSAGE_PREFIX=${PASSAGE_PREFIX-"passage: "}
EXTRA=${EXTRA:-}
PY=${PY:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
if [ "$NGPU" -lt 1 ]; then echo "speedrun: no GPU found (nvidia-smi -L); set NGPU, or run make demo on a CPU" >&2; exit 1; fi
mkdir -p "$OUT/done"

stage() {  # stage NAME COMMAND...: run once, append its wall time to stages.tsv
    local name=$1; shift
    if [ -f "$OUT/done/$name" ]; then echo "== $name: done before, skipped"; return; fi
    echo "== $name: $*"
    local start=$SECONDS
    "$@"
    printf '%s\t%s\n' "$name" "$((SECONDS - start))" >> "$OUT/stages.tsv"
    touch "$OUT/done/$name"
}

stage install make install
stage data $PY prepare_data.py --task=hotpotqa --out="$DATA" --train-size="$TRAIN_SIZE" --val-size="$VAL_SIZE" \
    ${SOURCE:+--source="$SOURCE"}
stage index $TORCHRUN --standalone --nproc_per_node="$NGPU" build_index.py --corpus="$CORPUS" --out="$DATA/index" \
    --encoder="$ENCODER" --query-prefix="$QUERY_PREFIX" --passage-prefix="$PASSAGE_PREFIX"
# shellcheck disable=SC2086  # EXTRA is a list of key=value overrides
stage train $TORCHRUN --standalone --nproc_per_node="$NGPU" train.py --config=hotpotqa algo="$ALGO" model="$MODEL" \
    run_dir="$OUT/run" data.train_path="$DATA/train.parquet" data.val_path="$DATA/val.parquet" \
    task.index_dir="$DATA/index" $EXTRA
# the run's own config.json (rollout.py reads it beside the export): the budgets and sampling it
# trained with, EXTRA's included
stage eval $PY rollout.py --model="$OUT/run/hf" --data="$DATA/val.parquet" --index="$DATA/index" \
    --out="$OUT/val.jsonl" --greedy
$PY report.py --run="$OUT/run" --eval="$OUT/val.jsonl" --stages="$OUT/stages.tsv" --gpus="$NGPU" --out="$OUT/report.md"
