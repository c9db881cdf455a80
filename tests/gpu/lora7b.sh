#!/usr/bin/env bash
# Issue 27 on a 7B-shaped model (or 14B: MODEL below; random weights, built once by jobs.bench), from the repo
# root on the GPU machine after the gpu-site bundle is unpacked (docs/gpu.md): the adapter push of r=16 on every
# projection, merged into the weights and served from vLLM's LoRA slot (`learner.lora.serve`), one after the other
# in one call; then three
# GSPO steps with the slot and a 4-bit learner base (the 24 GiB goal: 23.91 GiB in use at peak on an H100 with
# kv_cache_gib 0.5, 24.40 with 1; docs/gpu.md), alone on the GPU (NVML reads the whole device). Results under
# $OUT/lora7b/.
#   bash tests/gpu/lora7b.sh [push|step|all]
# BUDGET=24: the step run under `rollout.gpu_memory_budget_gib` (the learner's allocator capped at its share; the job
# refused before Ray if the estimate says it does not fit), results in step-adapter-4bit-kv05-b24.json.
# MODEL=qwen14b-random: the same for the 14B shape (issue 27's 48 GiB goal; `rlsys tune` estimates its step at 41.78
# GiB with these settings, docs/gpu.md), results under $OUT/lora14b/. The random model is built once under
# /tmp/rlsys-bench (the 14B one ~30 GB on disk).
set -u
source "$(dirname "$0")/device_env.sh"
model=${MODEL:-qwen7b-random}
case $model in  # the directory, and vLLM's share in the push benchmark (weights ~14.2 / 27.5 GiB, and the rest)
  qwen7b-random) name=lora7b vllm_gib=30 ;;
  qwen14b-random) name=lora14b vllm_gib=45 ;;
  *) name=lora-$model vllm_gib=${VLLM_GIB:-40} ;;
esac
dir=$out/$name; mkdir -p "$dir"
what=${1:-all}
if [ "$what" != step ]; then
  for serve in ${SERVES:-merged adapter}; do
    python3 scripts/lora_push_bench.py --model "$model" --rank 16 --serve $serve --budget-gib $vllm_gib \
      --cache /tmp/rlsys-bench --out "$dir/push-$serve.json" > "$dir/push-$serve.log" 2>&1
    echo "push $serve rc=$?: $(tail -2 "$dir/push-$serve.log" | tr '\n' ' ')"
  done
fi
if [ "$what" != push ]; then
  step=step-adapter-4bit-kv05${BUDGET:+-b$BUDGET}
  python3 -m jobs.bench step --config configs/tictactoe-tiny-cpu.toml --model "$model" --cache /tmp/rlsys-bench \
    --steps 3 --random-reward --out "$dir/$step.json" rollout.engine=vllm rollout.enforce_eager=true \
    rollout.batch_size=4 rollout.n_samples=8 rollout.max_new_tokens=64 rollout.max_model_len=512 \
    rollout.kv_cache_gib=0.5 learner.mini_bs=1 learner.adam_8bit=true model.gradient_checkpointing=true \
    logging.tensorboard=false learner.lora.enabled=true learner.lora.rank=16 learner.lora.serve=adapter \
    learner.lora.base_4bit=true sync.canary_tol=5 ${BUDGET:+rollout.gpu_memory_budget_gib=$BUDGET} \
    > "$dir/$step.log" 2>&1
  echo "step rc=$?: $(grep -E "GPU memory|canary" "$dir/$step.log" | tail -2 | tr '\n' ' ')"
  grep "^GPU process" "$dir/$step.log" | head -4  # alone on the GPU: vLLM's engine core and the learner first
fi
