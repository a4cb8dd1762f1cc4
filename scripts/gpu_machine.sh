#!/usr/bin/env bash
# What this project runs on a lent GPU machine (16 cores, one H100, Python 3.12,
# no network), which this 2-core CPU box cannot do. See docs/benchmarks.md,
# "GPU machine", for the figures it gave and how the wheels got there.
#
#   scripts/gpu_machine.sh setup WHEEL_DIR  install torch/triton/NCCL wheels and this
#                                           package into /tmp/site (no network needed)
#   scripts/gpu_machine.sh nccl             scripts/gpu_check.py: NCCL default group,
#                                           our gloo groups beside it, inductor on CUDA
#   scripts/gpu_machine.sh bench            the guard collective at 2/4/8 ranks (1 host)
#                                           and 8 ranks as 2 hosts, plus the scale model
#   scripts/gpu_machine.sh test [ARGS]      the test suite (pytest-xdist when present)
#
# Every subcommand after setup expects `export PYTHONPATH=/tmp/site` (setup prints
# the environment to use). Results go to $OUT when it is set.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
out="${OUT:-/tmp/cc-gpu-out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
site=/tmp/site

env_lines() {
  # The machine's own torch venv holds the CUDA libraries (cu13) torch needs beside
  # the NCCL carried in; ours come first on the paths.
  local nv
  nv="$("$py" - <<'EOF'
import glob, os, site, sys
dirs = []
for base in [p for p in sys.path if p.endswith("site-packages")]:
    dirs += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib")))
print(":".join(dirs))
EOF
)"
  echo "export PYTHONPATH=$site"
  echo "export LD_LIBRARY_PATH=$site/nvidia/nccl/lib:$nv\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
  # torch 2.13 was built against cuDNN 9.20; the image has 9.19 (used for nothing here)
  echo "export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1"
}

case "${1:-}" in
  setup)
    wheels="${2:?setup needs the folder holding the wheels}"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$wheels"/*.whl || exit 1
    "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
      --target "$site" . || exit 1
    env_lines > /tmp/cc-gpu-env.sh
    # shellcheck disable=SC1091
    . /tmp/cc-gpu-env.sh
    "$py" - <<'EOF'
import torch, triton, msgpack
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "gpu", torch.cuda.get_device_name(0), "nccl", torch.cuda.nccl.version(), "from", torch.__file__)
import compiler_collectives
print("compiler_collectives", compiler_collectives.__version__, "from", compiler_collectives.__file__)
EOF
    echo "environment: . /tmp/cc-gpu-env.sh"
    ;;
  nccl)
    TORCH_COMPILER_COLLECTIVES=1 COMPILER_COLLECTIVES_GUARDS=1 \
      "$py" -m torch.distributed.run --nproc-per-node 1 scripts/gpu_check.py --json "$out/gpu_check.json" \
      2>&1 | tee "$out/gpu_check.log"
    ;;
  bench)
    {
      "$py" scripts/bench_guard.py --worlds 2 4 8 --calls 300 --blocks 7
      "$py" scripts/bench_guard.py --worlds 8 --hosts 2 --calls 300 --blocks 7
      "$py" scripts/guard_scale_model.py
    } 2>&1 | tee "$out/bench_guard.log"
    ;;
  test)
    shift
    xdist=()
    "$py" -c "import xdist" 2>/dev/null && xdist=(-n 8)
    "$py" -m pytest -q "${xdist[@]}" "$@" 2>&1 | tee "$out/tests.log"
    ;;
  *)
    sed -n '2,16p' "$0"
    exit 2
    ;;
esac
