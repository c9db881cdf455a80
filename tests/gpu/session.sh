#!/usr/bin/env bash
# One device session's GPU work as a queue that outlives the device call starting it (a call lasts at most
# 10 minutes, the runs longer; a process in its own session runs until the machine goes back). From the repo
# root, after the gpu-site and qwen bundles are unpacked (docs/gpu.md, "Running the GPU checks"):
#   bash tests/gpu/session.sh start      # starts the queue with setsid (it converts the GGUF once first), returns
#   bash tests/gpu/session.sh wait S     # waits up to S s (less if the queue ends), then copies results to $OUT
# The queue: the Qwen 0.5B tic-tac-toe runs of RUNS (NAME=key=value,key=value ...), and the whole-game run, at the same
# time (each vLLM with a fixed KV cache: rollout.kv_cache_gib), the first alone until it sampled (its start-up
# is the fresh machine's); then the benchmarks of docs/performance.md one after another, alone on the GPU.
# RUNS=none: the benchmarks only (no Qwen bundle needed), e.g. RUNS=none BENCH="startup bench-step" ... start
# A run of another config: NAME@CONFIG=overrides, e.g. RUNS="gsm@configs/gsm-qwen0.5b.toml=seed=0".
# FIRST_ALONE=0: start every run 20 s apart at once (when the start-up is not what is measured).
# AFTER_SUITE=1: convert the GGUF now, start the runs once the GPU suite started before it (tests/gpu/all.sh start)
# has ended: one call starts both, e.g. `RLSYS_COMMIT=... BENCH=none WAIT_S=5 bash tests/gpu/all.sh start;
# AFTER_SUITE=1 RUNS=... bash tests/gpu/session.sh start 5`, and the waits after it need no hand in between.
# At most MAX_RUNS runs at once (default: the GPU's memory / RUN_GIB, 24: a Qwen 0.5B tic-tac-toe run at
# kv_cache_gib 3 held 20-23 GiB, and a fourth beside three died of CUDA OOM on an H100, 2026-12-05): the others wait
# for a slot. STAGGER_S (20): the seconds between two starts.
set -u
source "$(dirname "$0")/device_env.sh"  # $out, PYTHONPATH, the GPU environment
S=${RLSYS_SESSION_DIR:-/tmp/rlsys-session} runs=${RLSYS_RUNS_DIR:-/tmp/qwen-runs}
mkdir -p "$S" "$runs"
gguf=${GGUF:-/tmp/qwen/qwenpack/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
log() { echo "[$(date +%T)] $*" >> "$S/queue.log"; }

train() {  # train NAME ARGS...: one rlsys train in the background, its log beside its run directory
  local name=$1; shift
  log "$name: rlsys train $*"
  ( timeout -k 15 "${RUN_S:-1500}" python3 -m rlsys.cli train --run-dir "$runs/$name" "$@" > "$runs/$name.log" 2>&1
    echo "rc=$?" >> "$runs/$name.log"; log "$name: $(tail -1 "$runs/$name.log")"
    python3 -m rlsys.cli report "$runs/$name" --window 20 > "$runs/$name.report" 2>&1 ) &
}

slots() {  # runs that fit the GPU at once: MAX_RUNS, else its memory / RUN_GIB (one at least)
  local mib
  if [ -n "${MAX_RUNS:-}" ]; then echo "$MAX_RUNS"; return; fi
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  echo $(( ${mib:-0} / 1024 / ${RUN_GIB:-24} > 1 ? ${mib:-0} / 1024 / ${RUN_GIB:-24} : 1 ))
}

wait_for_slot() {  # until fewer than $max runs are running (one ended)
  while (( $(jobs -rp | wc -l) >= max )); do wait -n; done
}

queue() {
  echo $$ > "$S/queue.pid"  # `wait` checks that this process lives
  # the GGUF's conversion here, detached, not in the start call: it took 136 s on a fresh H200 (2026-12-04) and a
  # start call cut at 120 s killed it there, so no run started and the waits after it waited on nothing (2026-12-05)
  [ "${RUNS:-}" = none ] || python3 -c "import sys, time; t=time.time(); from rlsys.models.resolve import resolve_model; print(resolve_model(sys.argv[1])); print(f'convert {time.time()-t:.1f} s')" "$gguf" >> "$S/queue.log" 2>&1
  if [ "${AFTER_SUITE:-0}" = 1 ]; then  # the conversion beside the suite, the runs after it (timings of each alone)
    local suite=${RLSYS_ALL_DIR:-/tmp/rlsys-all}
    log "waiting for the GPU suite to end ($suite)"
    while [ ! -f "$suite/done" ] && lives "$suite/run.pid"; do sleep 2; done
    log "the suite has ended"
  fi
  export RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION=0.04  # several local Rays: 30% of RAM each does not fit
  local common=(--ckpt "$gguf" ${FLAGS:-} rollout.kv_cache_gib=${KV_GIB:-3} eval.every=100 ${EXTRA:-})  # flags, then dotted
  local first=1 spec name ov cfg max
  max=$(slots); log "at most $max run(s) at once"
  [ "${RUNS:-}" = none ] && RUNS=  # benchmarks only
  for spec in ${RUNS-lr1e-5=learner.lr=1e-5}; do  # NAME=dotted.key=value,dotted.key=value
    name=${spec%%=*} ov=${spec#*=} cfg=configs/tictactoe-qwen0.5b.toml
    case $name in *@*) cfg=${name#*@} name=${name%%@*} ;; esac
    wait_for_slot
    train "$name" --config "$cfg" --max-steps "${STEPS:-400}" "${common[@]}" ${ov//,/ }
    if (( first )) && [ "${FIRST_ALONE:-1}" = 1 ]; then  # alone until its first step (a fresh machine's start-up)
      first=0
      for _ in $(seq 60); do [ -s "$runs/$name/metrics.jsonl" ] || grep -q "^rc=" "$runs/$name.log" && break; sleep 5; done
      log "$name: first step logged"
    else
      sleep "${STAGGER_S:-20}"  # vLLM picks its ports at start: keep the starts apart
    fi
  done
  [ -n "${GAME_STEPS:-}" ] && { wait_for_slot; train game --config configs/tictactoe-game-qwen0.5b.toml \
    --max-steps "$GAME_STEPS" "${common[@]}" eval.every=0; }
  wait
  log "training runs done"
  if [ -n "${BENCH:-}" ]; then
    log "benchmarks: $BENCH"
    OUT=$S/bench STEPS=$BENCH bash tests/gpu/run_on_device.sh > "$S/bench.out" 2>&1
  fi
  log "queue done"; touch "$S/done"
}

collect() {
  cp "$S/queue.log" "$out/" 2>/dev/null
  for r in "$runs"/*.log; do [ -f "$r" ] && grep -v "Loading weights" "$r" | tail -25 > "$out/tail-$(basename "$r")"; done
  tar czf "$out/runs.tgz" --exclude checkpoints -C "$runs" . 2>/dev/null
  [ -d "$S/bench" ] && tar czf "$out/bench.tgz" -C "$S" bench
  cat "$S/queue.log"; nvidia-smi --query-gpu=memory.used --format=csv,noheader
  for r in "$runs"/*/metrics.jsonl; do [ -f "$r" ] && echo "$(basename "$(dirname "$r")"): $(wc -l < "$r") steps"; done
}

case ${1:?start or wait} in
  start)
    [ -f /tmp/gpu-site/.done ] || { echo "gpu-site is not unpacked whole (/tmp/gpu-site/.done missing): carry its parts first"; exit 1; }
    { nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
      python3 -c "import vllm, torch, ray, transformers, bitsandbytes; print('vllm', vllm.__version__, 'torch', torch.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__, 'bnb', bitsandbytes.__version__)"
    } >> "$S/queue.log" 2>&1
    log "converting $gguf"; echo "$*; RUNS=${RUNS:-} EXTRA=${EXTRA:-} GAME_STEPS=${GAME_STEPS:-} BENCH=${BENCH:-}" >> "$S/queue.log"
    rm -f "$S/done" "$S/queue.pid"
    # the queue runs from a copy of this tree: later calls re-send the working tree, edits and all
    src=/tmp/rlsys-src; rm -rf "$src"; mkdir -p "$src"
    tar cf - --exclude=./.devcarry/parts --exclude=./.git . | tar xf - -C "$src"
    (cd "$src" && detach "$S/queue.out" bash tests/gpu/session.sh queue)
    sleep "${2:-5}"; collect ;;
  queue) queue ;;
  wait)  # returns at once when no queue lives (never started, killed, or a fresh machine): a wait costs device time
    for _ in $(seq "$(( ${2:-60} / 5 ))"); do
      [ -f "$S/done" ] && break
      if ! lives "$S/queue.pid"; then
        echo "session.sh wait: no queue is running on this machine (see $S/queue.out); not waiting"; break
      fi
      sleep 5
    done
    collect ;;
esac
