#!/usr/bin/env bash
# Every GPU test and the three benchmarks (weight push, step, proxy) in one command, on the GPU machine, from the
# repo root, after the gpu-site bundle is unpacked (docs/gpu.md, "Running the GPU checks"):
#   RLSYS_COMMIT=<sha> bash tests/gpu/all.sh            # logs and summary.md into $OUT
# The test files run side by side (each job test has its own local Ray and a 6 GiB vLLM budget), then the
# benchmarks one after another, alone on the GPU. The work runs detached (setsid), so that a device call that ends
# first does not end it: the command waits up to WAIT_S (default 570 s) and copies what is there;
# `bash tests/gpu/all.sh wait` in a later call of the same machine waits again and copies the rest.
# BENCH=none skips the benchmarks (e.g. while training runs share the GPU and their timings would mean nothing).
set -u
source "$(dirname "$0")/device_env.sh"  # $out, PYTHONPATH, the GPU environment
W=${RLSYS_ALL_DIR:-/tmp/rlsys-all}

collect() {
  cp "$W"/*.log "$W/summary.md" "$out/" 2>/dev/null
  cp "$W"/*.json "$out/" 2>/dev/null
  cat "$W/summary.md" 2>/dev/null
}

wait_done() {
  local limit=${1:-${WAIT_S:-570}} t0=$SECONDS
  while [ ! -f "$W/done" ] && (( SECONDS - t0 < limit )); do
    if ! lives "$W/run.pid"; then
      echo "all.sh: no suite is running on this machine (see /tmp/rlsys-all.out); not waiting"; break
    fi
    sleep 5
  done
  collect
  [ -f "$W/done" ] || ! lives "$W/run.pid" || echo "(still running: bash tests/gpu/all.sh wait)"
}

tests() {  # name, then pytest arguments: one background pytest, its log and its closing line in the summary
  local name=$1; shift
  # every test of the files named, marked `gpu` or not (test_ipc_plumbing.py's are unmarked: the plumbing with
  # fakes, which CI runs too; `-m gpu` deselected all 15 of them in the first run)
  ( timeout -k 15 "${TEST_S:-900}" python3 -m pytest -q -s -p no:cacheprovider "$@" > "$W/$name.log" 2>&1
    echo "rc=$?" >> "$W/$name.log" ) &
}

run() {
  rm -rf "$W"; mkdir -p "$W"
  echo $$ > "$W/run.pid"  # wait_done stops waiting once this process is gone
  local t0=$SECONDS
  {
    echo "# GPU suite: $(date -u +%F' '%T) UTC, commit ${RLSYS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -c "import vllm, torch, ray, transformers, bitsandbytes as b; print('vllm', vllm.__version__, 'torch', \
torch.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__, 'bitsandbytes', b.__version__)"
    echo '```'
  } > "$W/summary.md" 2>&1
  export RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION=0.04  # several local Rays at once: 30% of RAM each does not fit
  # the Ray-executor job after the engine tests in one process, as `pytest -m gpu tests/gpu` runs them: those set
  # VLLM_WORKER_MULTIPROC_METHOD=spawn, under which vLLM's engine core once started a Ray of its own
  tests engine-ipc-ray tests/gpu/test_vllm_engine.py tests/gpu/test_ipc_plumbing.py tests/gpu/test_adam8bit_resume.py \
    "tests/gpu/test_vllm_job.py::test_three_trained_steps_on_the_gpu_with_vllm[ray]"
  tests job-sleep tests/gpu/test_vllm_job.py -k "sleep1 or sleep2"
  tests job-awake-fp32 tests/gpu/test_vllm_job.py -k "awake or fp32master or overlap"
  tests job-faults tests/gpu/test_vllm_job.py -k "push_fails"
  tests lora tests/gpu/test_lora_gpu.py tests/gpu/test_learner_attention.py  # learner.lora: adapter pushes merged into vLLM, 4-bit base, the job; cudnn_attention
  tests lora-adapter tests/gpu/test_lora_adapter_gpu.py  # learner.lora.serve = adapter: vLLM's LoRA slot, the job
  wait
  {
    echo; echo "## Tests ($((SECONDS - t0)) s, side by side)"; echo; echo '```'
    for f in "$W"/engine-ipc-ray.log "$W"/job-*.log "$W"/lora*.log; do
      echo "$(basename "$f" .log): $(grep -E '(passed|failed|error)' "$f" | tail -1) $(tail -1 "$f")"
    done
    grep -h -E "^(FAILED|ERROR) " "$W"/*.log | head -20
    grep -h "^MEASURE" "$W"/*.log | grep -E "adam8bit|canary_engine_shift|canary_logp_diff|fault|lora" | head -60
    echo '```'
  } >> "$W/summary.md"
  if [ "${BENCH:-}" != none ]; then
    local b=/tmp/rlsys-bench b0=$SECONDS
    bench() {  # name, then the jobs.bench arguments
      local name=$1; shift
      timeout -k 15 "${BENCH_S:-400}" python3 -m jobs.bench "$@" --out "$W/bench-$name.json" > "$W/bench-$name.log" 2>&1
      echo "bench $name: rc=$?" >> "$W/bench.rc"
    }
    local ttt="--config configs/tictactoe-tiny-cpu.toml"
    bench sync sync --model qwen0.5b-random tiny --cache $b
    bench step step $ttt --model qwen0.5b-random --cache $b --steps 4 --random-reward --run-dir /tmp/rlsys-all-step \
      rollout.batch_size=8 rollout.n_samples=8 rollout.max_new_tokens=64 learner.mini_bs=8 learner.adam_8bit=true \
      rollout.max_model_len=512 logging.tensorboard=false rollout.enforce_eager=true
    bench proxy proxy $ttt --model qwen0.5b-random --cache $b --rounds 3 --env-workers auto \
      rollout.batch_size=16 rollout.n_samples=8 rollout.max_new_tokens=128 rollout.max_model_len=512 \
      rollout.engine_max_batch=128 env.max_concurrency=128 rollout.enforce_eager=true
    {
      echo; echo "## Benchmarks ($((SECONDS - b0)) s, one after another)"; echo; echo '```'
      cat "$W/bench.rc"
      grep -h -E "^(overhead|tokens/s|median|refit|step breakdown|proxy overhead|GPU memory)|ms/GiB|total" \
        "$W"/bench-*.log | head -40
      echo '```'
    } >> "$W/summary.md"
  fi
  echo; echo "all done in $((SECONDS - t0)) s" >> "$W/summary.md"
  touch "$W/done"
}

case ${1:-start} in
  start)
    src=/tmp/rlsys-all-src; rm -rf "$src"; mkdir -p "$src"  # later calls re-send the tree: run from a copy
    tar cf - --exclude=./.devcarry/parts --exclude=./.git . | tar xf - -C "$src"
    rm -rf "$W"; mkdir -p "$W"
    (cd "$src" && RLSYS_COMMIT=${RLSYS_COMMIT:-} detach /tmp/rlsys-all.out bash tests/gpu/all.sh run)
    sleep 5; wait_done ;;
  run) run ;;
  wait) wait_done "${2:-}" ;;
esac
