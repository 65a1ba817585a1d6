#!/usr/bin/env bash
# second device call of 11-26: the GQA lower-right check, the 4 failed tests, first/decode, headline
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
R=$OUT/first; mkdir -p $R
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $R/times.txt; }
stamp start
timeout 60 python3 - <<'PY' 2>&1 | grep -v Warning | grep -v "F.scaled" | tee $R/gqa_check.txt
import torch, time
from torch.nn.attention.bias import causal_lower_right
from kvcompress.storage.attention import dense_attention
torch.manual_seed(0)
for q_len, seq in ((64, 256), (4096, 32768)):
    q = torch.randn(1, 32, q_len, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, seq, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    for _ in range(2):
        t = time.perf_counter(); out = dense_attention(q, k, v, causal_lower_right(q_len, seq), 0.088); torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    msg = f"q {q_len} over {seq}: {1000 * (time.perf_counter() - t):.1f} ms, peak above inputs {peak:.0f} MiB"
    if q_len == 64:
        kr, vr = (x.double().repeat_interleave(4, 1) for x in (k, v))
        logits = (q.double() @ kr.transpose(-1, -2)) * 0.088
        logits = logits.masked_fill(~torch.ones(q_len, seq, dtype=torch.bool, device="cuda").tril(seq - q_len), -1e300)
        ref = logits.softmax(-1) @ vr
        msg += f", rel error {((out.double() - ref).norm() / ref.norm()).item():.2e}"
    print(msg)
PY
stamp gqa-done
timeout 120 python3 -m pytest -q -p no:cacheprovider "tests/test_offload.py::test_triton_kernels_match_torch_ops_in_the_interpreter" \
  "tests/test_offload.py::test_gpu_decode_step_never_synchronizes_and_matches_cpu" \
  "tests/test_stored_context.py::test_the_command_line_asks_a_stored_file_per_question" \
  "tests/test_stored_context.py::test_on_a_gpu_the_store_lives_in_host_memory_and_answers_as_the_joined_prompt" 2>&1 | tail -30 > $R/tests.txt
grep -E "passed|failed" $R/tests.txt; stamp tests-done
mkdir -p $R/decode
timeout 230 python3 -m kvcompress.cli bench speed --out $R/decode --model llama-3.1-8b \
  --methods full,snapkv,snapkv:kv_bits=4,shadowkv:rank=160:outliers=48:ratio=0.0156 --budget 2048 --lengths 32768 \
  --batches 1 --steps 16 --warmup 3 --compile > $R/decode/log.txt 2>&1
stamp decode-done rc=$?
mkdir -p $R/headline
left=$(( 415 - $(date +%s) + t0 )); [ $left -lt 30 ] && left=30
timeout $left python3 -m kvcompress.cli bench headline --preset gpu --lengths 16384 --batches 2 \
  --steps 16 --warmup 3 --out $R/headline > $R/headline.txt 2>&1
stamp headline-done rc=$?
