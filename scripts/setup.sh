#!/usr/bin/env bash
# Create .venv and install kvcompress into it.
# torch: an existing install is reused (the GPU machines ship their own); otherwise the CPU wheel
# torch==2.13.0 is installed, never a bare `torch` that would pull gigabytes of CUDA wheels.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if "$PYTHON" -c "import torch" 2>/dev/null; then
    # Expose the outer interpreter's site-packages (torch, and whatever else it has) to the venv.
    outer=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    inner=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$outer" > "$inner/_kvcompress_outer_site.pth"
    echo "setup: reusing torch from $outer"
  else
    "$VENV/bin/python" -m pip install -q torch==2.13.0
  fi
fi
"$VENV/bin/python" -m pip install -q -e ".[dev]"
"$VENV/bin/python" -c "import torch, transformers; print(f'setup: torch {torch.__version__}, transformers {transformers.__version__}')"
