#!/usr/bin/env bash
# fourth device call of 11-26: first/decode and the headline after the inference-mode fix
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
R=$OUT/first; mkdir -p $R/decode $R/headline
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $R/times.txt; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.csv 2>&1
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" > $R/versions.txt 2>&1
stamp start
timeout 185 python3 -m kvcompress.cli bench speed --out $R/decode --model llama-3.1-8b \
  --methods full,snapkv,snapkv:kv_bits=4,shadowkv:rank=160:outliers=48:ratio=0.0156 --budget 2048 --lengths 32768 \
  --batches 1 --steps 16 --warmup 3 --compile 2>&1 | grep -v "Warning\|F.scaled\|return F" > $R/decode/log.txt
stamp decode-done
left=$(( 265 - $(date +%s) + t0 )); [ $left -lt 20 ] && left=20
timeout $left python3 -m kvcompress.cli bench headline --preset gpu --lengths 16384 --batches 2 \
  --steps 16 --warmup 3 --out $R/headline 2>&1 | grep -v "Warning\|F.scaled\|return F" > $R/headline.txt
stamp headline-done
