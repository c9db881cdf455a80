#!/usr/bin/env bash
# Issue #9 on the nvidia-h200-x2 kind: the tic-tac-toe bench job on one GPU, with world_size=2 (two co-located
# engine + learner pairs) and with tp_size=2 (one engine over both GPUs), same model, seed and global batch,
# 20 timed steps each; then one table (python -m jobs.bench compare) into $OUT/two-gpu.md. From the repo root,
# after the gpu-site bundle is unpacked (docs/gpu.md, "Running the GPU checks"); each run well under 4 minutes.
#   bash tests/gpu/two_gpu.sh                      # all three, ~10 minutes: split with RUNS="one ws2" etc.
# Keep NCCL_NVLS_ENABLE=0 and the other multicast-off variables the machine sets (KINDS.md).
set -u
source "$(dirname "$0")/device_env.sh"  # $out, PYTHONPATH, the GPU environment
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
BENCH=/tmp/rlsys-bench
MODEL=${MODEL:-qwen0.5b-random}
STEPS=${STEPS:-20}
# the job of docs/performance.md's step bench: 8 boards x 8 samples x 64 tokens, 8-bit Adam, eager vLLM, seed 0
COMMON="--config configs/tictactoe-tiny-cpu.toml --model $MODEL --cache $BENCH --steps $STEPS --warmup 2 --random-reward"
SET="seed=0 rollout.batch_size=8 rollout.n_samples=8 rollout.max_new_tokens=64 learner.mini_bs=8 \
  learner.adam_8bit=true rollout.max_model_len=512 rollout.enforce_eager=true logging.tensorboard=false"
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$out/two-gpu-summary.log" 2>&1
env | grep -E '^NCCL_' >> "$out/two-gpu-summary.log"
run() {  # run NAME OVERRIDES...   (RUNS="one ws2 tp2" picks)
  local name=$1; shift
  case " ${RUNS:-one ws2 tp2} " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout -k 10 "${RUN_S:-280}" python3 -m jobs.bench step $COMMON --run-dir "/tmp/rlsys-two-gpu-$name" \
    --out "$out/two-gpu-$name.json" $SET "$@" > "$out/two-gpu-$name.log" 2>&1
  echo "=== $name: rc=$? in $((SECONDS - t0)) s ($*)" | tee -a "$out/two-gpu-summary.log"
  grep -h -E "^overhead|^tokens/s|^GPU memory|rlsys: (startup|engines|.*learner rank)|WARNING" "$out/two-gpu-$name.log" \
    | tail -12 >> "$out/two-gpu-summary.log"
}
run one cluster.world_size=1
run ws2 cluster.world_size=2
run tp2 cluster.world_size=2 cluster.tp_size=2
specs=()
for name in one ws2 tp2; do [ -f "$out/two-gpu-$name.json" ] && specs+=("$name=$out/two-gpu-$name.json"); done
[ ${#specs[@]} -gt 0 ] && python3 -m jobs.bench compare "${specs[@]}" | tee "$out/two-gpu.md"
# the learner ranks' weights must stay bit-equal: train/rank_weight_spread is logged every step with 2 ranks
for name in ws2 tp2; do
  f=/tmp/rlsys-two-gpu-$name/metrics.jsonl
  [ -f "$f" ] && python3 -c "import json,sys; v=[json.loads(l).get('train/rank_weight_spread') for l in open(sys.argv[1])]; \
print(sys.argv[2], 'rank_weight_spread per step:', v)" "$f" "$name" | tee -a "$out/two-gpu-summary.log"
done
