#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
timeout 150 python3 tmp_gpu3.py 2>&1 | grep -v "Warning\|F.scaled\|return F" > $OUT/diag.txt
echo "diag rc=$?"
timeout 100 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=long \
  "tests/test_offload.py::test_gpu_decode_step_never_synchronizes_and_matches_cpu" \
  "tests/test_stored_context.py::test_the_command_line_asks_a_stored_file_per_question" > $OUT/tests.txt 2>&1
grep -E "passed|failed" $OUT/tests.txt
