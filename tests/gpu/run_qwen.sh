#!/usr/bin/env bash
# Qwen2.5-Coder-0.5B-Instruct on tic-tac-toe, on the GPU machine (docs/results.md has what it measured).
# From the repo root, after the gpu-site and qwen bundles are unpacked (../shared/device/README.md):
#   MODE=sweep LRS="1e-5 3e-6" STEPS=100 bash tests/gpu/run_qwen.sh     # one run per learning rate
#   MODE=resume RUN=lr1e-5 LR=1e-5 STEPS=400 bash tests/gpu/run_qwen.sh          # continue a run (same machine)
#   MODE=game STEPS=40 bash tests/gpu/run_qwen.sh                          # whole games (multi-turn)
# Runs live in /tmp/qwen-runs/<name>; everything but checkpoints comes back as $OUT/<mode>.tgz.
set -u
source "$(dirname "$0")/device_env.sh"  # $out, PYTHONPATH, the GPU environment
gguf=${GGUF:-/tmp/qwen/qwenpack/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
runs=/tmp/qwen-runs; mkdir -p "$runs"
budget=${BUDGET_S:-560}  # the device call's limit is 600 s
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$out/summary.log"; }
left() { echo $((budget - SECONDS)); }
train() {  # train NAME TIMEOUT_S ARGS...
  local name=$1 limit=$2; shift 2
  (( limit > 30 )) || { log "$name: skipped, ${limit}s left"; return 1; }
  log "$name: rlsys train $* (timeout ${limit}s)"
  timeout -k 15 "$limit" python3 -m rlsys.cli train --run-dir "$runs/$name" "$@" > "$runs/$name.log" 2>&1
  local rc=$?
  log "$name: rc=$rc"; grep -E "^eval\[|Traceback|Error" "$runs/$name.log" | tail -8 | tee -a "$out/summary.log"
  tail -3 "$runs/$name.log" >> "$out/summary.log"
}
{ nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
  python3 -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
} >> "$out/summary.log" 2>&1
if [ ! -d "$RLSYS_CACHE/models" ] || ! ls "$RLSYS_CACHE"/models/gguf-*/.rlsys-gguf > /dev/null 2>&1; then
  log "converting $gguf"
  python3 -c "import sys, time; t=time.time(); from rlsys.models.resolve import resolve_model; print(resolve_model(sys.argv[1])); print(f'convert {time.time()-t:.1f} s')" "$gguf" 2>&1 | tail -4 | tee -a "$out/summary.log"
fi
case ${MODE:-sweep} in
  sweep)
    n=$(echo ${LRS:-1e-5} | wc -w)
    for lr in ${LRS:-1e-5}; do
      train "lr$lr" $(( $(left) / n )) --config configs/tictactoe-qwen0.5b.toml --ckpt "$gguf" --lr "$lr" \
        --max-steps "${STEPS:-100}" eval.at_end=false ${EXTRA:-}
      n=$((n - 1))
    done ;;
  resume)
    train "${RUN:?RUN=name of the run to continue}" "$(left)" --config configs/tictactoe-qwen0.5b.toml \
      --ckpt "$gguf" --resume auto --max-steps "${STEPS:-400}" --lr "${LR:?set LR to the learning rate of the run}" ${EXTRA:-} ;;
  game)
    train game "$(left)" --config configs/tictactoe-game-qwen0.5b.toml --ckpt "$gguf" --max-steps "${STEPS:-40}" ${EXTRA:-} ;;
esac
tar czf "$out/${MODE:-sweep}.tgz" --exclude checkpoints -C "$runs" . 2>/dev/null
log "done"
