#!/usr/bin/env bash
# Every GPU check of rlsys, each on its own (one failing does not hide the others), logs into $OUT.
# On the GPU machine, after the gpu-site bundle is unpacked (../shared/device/README.md), from the repo root:
#   bash tests/gpu/run_on_device.sh
# Small pure-Python packages the GPU image lacks (tomli_w) travel in .devcarry/extra.
set -u
out=${OUT:-gpu-logs}; mkdir -p "$out"
export PYTHONPATH=/tmp/gpu-site/site:$PWD:$PWD/.devcarry/extra${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/gpu-site/site/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_ALLOW_INSECURE_SERIALIZATION=1 VLLM_USE_FLASHINFER_SAMPLER=0 RAY_AUTH_MODE=token
export RLSYS_CACHE=/tmp/rlsys-cache
step() {  # step NAME TIMEOUT_S COMMAND...   (STEPS="name ..." runs only those)
  local name=$1 limit=$2; shift 2
  case " ${STEPS:-gpu-engine bench-sync gpu-job} " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  echo "=== $name: $*" | tee -a "$out/summary.log"
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$out/summary.log"
  grep -h -E "^MEASURE|passed|failed|error" "$out/$name.log" | tail -40 >> "$out/summary.log"
}
{ nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
  python3 -c "import vllm, torch, ray, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
} > "$out/summary.log" 2>&1
step gpu-engine ${ENGINE_S:-200} python3 -m pytest -m gpu tests/gpu/test_vllm_engine.py -q -s -p no:cacheprovider
step bench-sync ${BENCH_S:-230} python3 -m jobs.bench sync --model qwen0.5b-random tiny --out "$out/bench-sync.json"
step gpu-job ${JOB_S:-150} python3 -m pytest -m gpu tests/gpu/test_vllm_job.py -q -s -p no:cacheprovider -k "${JOB_K:-sleep2}"
echo "=== done in $SECONDS s" | tee -a "$out/summary.log"
