#!/usr/bin/env bash
# The side-by-side of issue 25 on the GPU machine (docs/peers.md); first run 2026-12-05 (rlsys, trl).
# From the repo root, after the gpu-site, qwen and peer-NAME bundles are unpacked (docs/peers.md, "GPU session"):
#   bash scripts/peers/device.sh start NAME    # NAME: rlsys | rlsys-default | trl | verl; detached (setsid), returns
#   bash scripts/peers/device.sh wait NAME S   # waits up to S s; once the run ended, `rlsys eval` on its final
#                                              # model (same held-out boards, --perturb); copies the results to $OUT
#   EXTRA="rollout.kv_cache_gib=4" bash scripts/peers/device.sh start rlsys   # more overrides for the rlsys run
#   RANDOM_MODEL=1 bash scripts/peers/device.sh start verl   # a random model instead of the GGUF's (no Qwen bundle
#                                              # needed): does the framework start and train at all (verl's first
#                                              # start, 2026-12-07, stopped at a missing module)
# One run at a time, alone on the GPU. Every run gets the same GPU memory log: nvidia-smi's memory.used each second
# (mem.csv; the peak is its max), whatever the framework reports itself.
set -u
source tests/gpu/device_env.sh  # $out, PYTHONPATH=/tmp/gpu-site/site:$PWD:..., the GPU environment
cmd=${1:?start|wait} peer=${2:?rlsys|rlsys-default|trl|verl}
P=/tmp/peers/$peer; mkdir -p "$P"
gguf=${GGUF:-/tmp/qwen/qwenpack/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
config=configs/tictactoe-qwen0.5b.toml
# rlsys on the peers' work: 4 boards x 4 samples, no dynamic sampling (so no unanimous groups in the batch either:
# the config refuses them without it), 100 steps, no evals inside the timed run
equal_work="max_steps=100 max_train_minutes=120 rollout.n_samples=4 algo.dynamic_sampling=false
  algo.unanimous_groups=0 algo.unanimous_baseline=none eval.at_start=false eval.at_end=false
  checkpoint.save_interval=100"

model_folder() {  # rlsys's conversion of the GGUF (cached; up to 136 s on a fresh machine: give `start` 300 s)
  if [ "${RANDOM_MODEL:-0}" = 1 ]; then  # jobs.bench's random Qwen2.5-0.5B shape, rlsys's tiny tokenizer: plumbing only
    python3 -c "from pathlib import Path; from jobs.bench_models import model_folder as m
print(m('qwen0.5b-random', Path('/tmp/rlsys-bench')))" | tail -1
    return
  fi
  python3 -c "import sys; from rlsys.models.resolve import resolve_model; print(resolve_model(sys.argv[1]))" "$gguf" | tail -1
}

start() {
  local M; M=$(model_folder)
  setsid nohup bash -c "while true; do nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits; sleep 1; done" \
    > "$P/mem.csv" 2>/dev/null < /dev/null & echo $! > "$P/mem.pid"
  date +%s.%N > "$P/t_command"
  case $peer in
    trl) PYTHONPATH=/tmp/peer-trl/site:$PYTHONPATH setsid nohup bash -c \
           "python3 scripts/peers/trl_gspo.py --model '$M' --out '$P'; echo rc=\$?" > "$P/run.log" 2>&1 < /dev/null & ;;
    verl) PYTHONPATH=/tmp/peer-verl/site:$PYTHONPATH MODEL=$M OUT=$P setsid nohup bash -c \
           "bash scripts/peers/verl_gspo.sh; echo rc=\$?" > "$P/run.log" 2>&1 < /dev/null & ;;
    rlsys) setsid nohup bash -c "python3 -m rlsys.cli train --config $config --ckpt '$gguf' --run-dir '$P/run' \
           $(echo $equal_work) ${EXTRA:-}; echo rc=\$?" > "$P/run.log" 2>&1 < /dev/null & ;;
    rlsys-default) setsid nohup bash -c "python3 -m rlsys.cli train --config $config --ckpt '$gguf' --run-dir '$P/run' \
           max_steps=100 max_train_minutes=120 eval.at_start=false eval.at_end=false checkpoint.save_interval=100; \
           echo rc=\$?" > "$P/run.log" 2>&1 < /dev/null & ;;
    *) echo "device.sh: unknown peer $peer"; exit 2 ;;
  esac
  echo "device.sh: $peer started; logs in $P"
}

final_model() {  # the folder `rlsys eval --ckpt` takes; a LoRA checkpoint (the config's) merged first
  case $peer in
    rlsys*) local ck="$P/run/checkpoints/$(cat "$P/run/checkpoints/latest" 2>/dev/null)"
            if [ -f "$ck/adapter_config.json" ]; then
              python3 -m rlsys.cli export --merge "$ck" "$P/final" >> "$P/eval.log" 2>&1 && echo "$P/final"
            else echo "$P/run"; fi ;;
    *) echo "$P/final" ;;
  esac
}

wait_for() {
  local deadline=$(( $(date +%s) + ${1:-500} ))
  if [ ! -f "$P/run.log" ]; then  # never started here (a start call cut short, a fresh machine): do not wait
    echo "device.sh: no $peer run on this machine ($P/run.log missing); not waiting"; deadline=0
  fi
  while ! grep -q '^rc=' "$P/run.log" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
  if grep -q '^rc=' "$P/run.log"; then kill "$(cat "$P/mem.pid")" 2>/dev/null; fi
  if grep -q '^rc=0' "$P/run.log" && [ ! -f "$P/eval.json" ]; then  # a failed run has no model to score
    local m; m=$(final_model)
    python3 -m jobs.eval --ckpt "$m" --config $config --perturb --json "$P/eval.json" >> "$P/eval.log" 2>&1
  fi
  mkdir -p "$out/$peer"
  cp "$P"/*.json "$P"/*.jsonl "$P"/*.log "$P"/mem.csv "$P"/t_command "$out/$peer/" 2>/dev/null
  # the Ray workers' own logs (verl's and TRL's actors print there, not to run.log: verl's second start went quiet
  # at `create worker group` with nothing on the GPU, 2026-12-07): the last 200 lines of each, one file
  for f in /tmp/ray/session_latest/logs/worker-*.{err,out}; do
    [ -s "$f" ] && { echo "== $f"; tail -200 "$f"; }
  done > "$out/$peer/ray-workers-tail.log" 2>/dev/null
  [ -d "$P/run" ] && cp "$P"/run/*.jsonl "$P"/run/*.toml "$out/$peer/" 2>/dev/null
  tail -3 "$P/run.log"; echo "peak memory.used MiB: $(cut -d, -f2 "$P/mem.csv" | sort -n | tail -1)"
}

case $cmd in
  start) start ;;
  wait) wait_for "${3:-500}" ;;
  *) echo "usage: device.sh start|wait NAME [S]"; exit 2 ;;
esac
