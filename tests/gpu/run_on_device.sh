#!/usr/bin/env bash
# Every GPU check of rlsys, each on its own (one failing does not hide the others), logs into $OUT.
# On the GPU machine, after the gpu-site bundle is unpacked (docs/gpu.md, "Running the GPU checks"), from the repo root:
#   bash tests/gpu/run_on_device.sh
# Performance steps (docs/performance.md): compile, cold, startup, startup-eager, startup-eager-v1, startup-fulldecode,
# bench-step-fulldecode, machine,
# startup-eager-spawn, bench-step, bench-step-sleep, bench-step-awake,
# bench-step-graphs, bench-proxy, bench-sync15, budget-1.5b, bench-learner, bench-learner-micro, bench-learner-common,
# profile-learner,
# fingerprint,
# e.g. STEPS="startup startup-eager bench-step bench-proxy bench-sync15 budget-1.5b" bash tests/gpu/run_on_device.sh
# Small pure-Python packages the GPU image lacks (tomli_w) travel in .devcarry/extra.
set -u
source "$(dirname "$0")/device_env.sh"  # $out, PYTHONPATH, the GPU environment
step() {  # step NAME TIMEOUT_S COMMAND...   (STEPS="name ..." runs only those)
  local name=$1 limit=$2; shift 2
  case " ${STEPS:-gpu-engine bench-sync gpu-job} " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  echo "=== $name: $*" | tee -a "$out/summary.log"
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$out/summary.log"
  grep -h -E "^MEASURE|passed|failed|error|rlsys: (startup|memory|learner memory|vLLM gpu|prefetched)|page cache|^overhead|^tokens/s|^GPU memory|^median|^refit|^step breakdown|^proxy overhead" \
    "$out/$name.log" | tail -40 >> "$out/summary.log"
}
{ nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
  python3 -c "import vllm, torch, ray, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
} > "$out/summary.log" 2>&1
step gpu-engine ${ENGINE_S:-200} python3 -m pytest -m gpu tests/gpu/test_vllm_engine.py -q -s -p no:cacheprovider
step bench-sync ${BENCH_S:-230} python3 -m jobs.bench sync --model qwen0.5b-random tiny --out "$out/bench-sync.json"
step gpu-job ${JOB_S:-240} python3 -m pytest -m gpu tests/gpu/test_vllm_job.py -q -s -p no:cacheprovider -k "${JOB_K:-sleep2}"
# --- performance (docs/performance.md); each step well under 4 minutes on an H200 ---
BENCH=/tmp/rlsys-bench  # the random Qwen2.5-shaped models are built here once (python -m jobs.bench model)
TTT="--config configs/tictactoe-tiny-cpu.toml"
# what `pip install` does and the packed wheel set skipped (pack.sh installs with --no-compile): byte-compile the
# site once, so that a fresh machine's first start-up measures vLLM's start and not CPython compiling 15k modules
step compile ${COMPILE_S:-300} bash -c "python3 -m compileall -q -j 0 /tmp/gpu-site/site > /dev/null; \
  find /tmp/gpu-site/site -name '*.pyc' | wc -l"
# a fresh machine's state on this one: vLLM's, Triton's, torch's and CUDA's caches gone, the page cache dropped
# (where the container may: it says which)
step cold ${COLD_S:-60} bash -c "rm -rf ~/.cache/vllm ~/.triton ~/.cache/torch ~/.cache/flashinfer ~/.nv /tmp/torchinductor_*; \
  sync; (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null && echo 'page cache dropped' || echo 'page cache NOT dropped'"
# start-up from `rlsys train` to the first sampled token, cold: CUDA graphs + torch.compile (the default), then eager
# STARTUP_PY: the interpreter command of the timed process, e.g. "python3 -X importtime" (the rest stay python3)
startup_cmd() {  # startup_cmd NAME [OVERRIDE ...]: the script of one `rlsys train` step into /tmp/rlsys-NAME
  local dir=/tmp/rlsys-$1; shift  # (the random model is built first, before the process whose start-up is timed;
  # until 2026-12-01 evening the timed process was exec'd by bash and its clock began with that build: ~20-25 s
  # of a fresh machine's, ~1 s of a warm one's, start-up numbers were the model build)
  echo "M=\$(python3 -m jobs.bench model --model qwen0.5b-random --cache $BENCH | tail -1) && rm -rf $dir && \
${STARTUP_PY:-python3} -m rlsys.cli train $TTT --ckpt \$M --max-steps 1 --run-dir $dir logging.progress=false $*; \
exit \$?"  # not the script's last command: bash would exec it in place, and its start time would be the script's
}
step startup ${STARTUP_S:-280} bash -c "$(startup_cmd startup)"
step startup-eager ${STARTUP_S:-200} bash -c "$(startup_cmd startup-eager rollout.enforce_eager=true ${STARTUP_SET:-})"
# eager with vLLM's V1 model runner (`rollout.model_runner=v1`, i.e. VLLM_USE_V2_MODEL_RUNNER=0): the V2 runner's
# ~47 Triton kernels (input preparation, sampling, logprobs) compile on an empty ~/.triton at a machine's first start
step startup-eager-v1 ${STARTUP_S:-200} bash -c "$(startup_cmd startup-eager-v1 rollout.enforce_eager=true \
  rollout.model_runner=v1 ${STARTUP_SET:-})"
# CUDA graphs of decode without torch.compile (`rollout.graph_mode=full_decode`): the compile's share of `startup`
step startup-fulldecode ${STARTUP_S:-200} bash -c "$(startup_cmd startup-fulldecode rollout.graph_mode=full_decode)"
# what a first start pays once a machine, each part on its own (after a start-up step, these are warm): the GPU's
# persistence mode, torch's import, CUDA's initialisation, the driver's imports
step machine ${MACHINE_S:-120} bash -c "nvidia-smi -q | grep -iE 'persistence mode|driver version|cuda version'; \
  uptime; free -g | head -2; for i in 1 2; do python3 -c 'import time; t=time.time(); import torch; \
i=time.time(); torch.cuda.init(); print(f\"MEASURE import torch {i-t:.1f} s, CUDA init {time.time()-i:.1f} s\")'; done; \
  python3 -c 'import time; t=time.time(); import jobs.job; print(f\"MEASURE import jobs.job {time.time()-t:.1f} s\")'"
# eager again, with the engine core spawned (vLLM's own way in a Ray actor) instead of forked from rlsys's server
step startup-eager-spawn ${STARTUP_S:-200} bash -c "$(startup_cmd startup-eager-spawn rollout.enforce_eager=true \
  rollout.engine_process=spawn)"
# the step-time breakdown: 0.5B random, 64 episodes x 64 tokens per step, 8-bit Adam, 4 timed steps after 1 warm-up
STEP_ARGS="--model qwen0.5b-random --cache $BENCH --steps 4 --random-reward"  # options first, overrides after
STEP_SET="rollout.batch_size=8 rollout.n_samples=8 rollout.max_new_tokens=64 learner.mini_bs=8 learner.adam_8bit=true \
  rollout.max_model_len=512 logging.tensorboard=false"
# the job's defaults (rollout.keep_awake auto: awake on the H200), eager
step bench-step ${BENCH_STEP_S:-420} python3 -m jobs.bench step $TTT $STEP_ARGS --run-dir /tmp/rlsys-bench-step \
  --out "$out/bench-step.json" $STEP_SET rollout.enforce_eager=${STEP_EAGER:-true}
# the engine put to sleep (level 1) between phases, as before keep_awake auto
step bench-step-sleep ${BENCH_STEP_S:-420} python3 -m jobs.bench step $TTT $STEP_ARGS --run-dir /tmp/rlsys-bench-sleep \
  --out "$out/bench-step-sleep.json" $STEP_SET rollout.enforce_eager=true rollout.keep_awake=false
# the engine kept awake between phases, explicitly (no sleep/wake: weights pushed into the awake engine)
step bench-step-awake ${BENCH_STEP_S:-420} python3 -m jobs.bench step $TTT $STEP_ARGS --run-dir /tmp/rlsys-bench-awake \
  --out "$out/bench-step-awake.json" $STEP_SET rollout.enforce_eager=true rollout.keep_awake=true
# awake, CUDA graphs + torch.compile (the steady-state side of the start-up choice), the canary every 4th push
step bench-step-graphs ${BENCH_STEP_S:-420} python3 -m jobs.bench step $TTT $STEP_ARGS --run-dir /tmp/rlsys-bench-graphs \
  --out "$out/bench-step-graphs.json" $STEP_SET rollout.enforce_eager=false rollout.keep_awake=true sync.canary_every=4
# the same without torch.compile: full CUDA graphs of decode only (rollout.graph_mode=full_decode)
step bench-step-fulldecode ${BENCH_STEP_S:-420} python3 -m jobs.bench step $TTT $STEP_ARGS --run-dir /tmp/rlsys-bench-fulldecode \
  --out "$out/bench-step-fulldecode.json" $STEP_SET rollout.enforce_eager=false rollout.graph_mode=full_decode \
  rollout.keep_awake=true sync.canary_every=4
# direct vLLM generate vs the agent path, 16 prompts x 8 samples = 128 in flight, 128 tokens each
step bench-proxy ${BENCH_PROXY_S:-300} python3 -m jobs.bench proxy $TTT --model qwen0.5b-random --cache $BENCH --rounds 3 \
  --env-workers ${PROXY_WORKERS:-auto,2} --out "$out/bench-proxy.json" rollout.batch_size=16 rollout.n_samples=8 rollout.max_new_tokens=128 \
  rollout.max_model_len=512 rollout.engine_max_batch=128 env.max_concurrency=128 rollout.enforce_eager=${PROXY_EAGER:-true}
# the learner alone on gsm-shaped batches (configs/gsm-qwen0.5b.toml: LoRA, 8-bit Adam, mini_bs 4, no prefix sharing
# since the twelfth session), a random 0.5B:
# the rows of a prompt sorted by length against their sampled order (issue 24, item 3)
step bench-learner ${BENCH_LEARNER_S:-300} python3 -m jobs.bench learner --model qwen0.5b-random --cache $BENCH --steps 5 \
  --out "$out/bench-learner.json"
# the learner's micro-batches by count and by padded tokens (learner.micro_batch_tokens), with and without prefix
# sharing (two passes through the layers a micro-batch: scripts/learner_dispatch_probe.py): is the host what bounds
# it? (the two row orders above trained at the same speed on the H200 though one ran 13% fewer positions)
# (twelfth session: sharing 5.80 s a step, none 2.98 s; the gsm config turned it off)
step bench-learner-micro ${BENCH_LEARNER_S:-420} python3 -m jobs.bench learner --model qwen0.5b-random --cache $BENCH \
  --steps 5 --variant sharing=learner.prefix_sharing=true --variant nosharing=learner.prefix_sharing=false \
  --variant sharing-tok16k=learner.prefix_sharing=true,learner.micro_batch_tokens=16384 \
  --variant nosharing-tok16k=learner.prefix_sharing=false,learner.micro_batch_tokens=16384 \
  --variant nosharing-mbs8=learner.prefix_sharing=false,learner.mini_bs=8 \
  --out "$out/bench-learner-micro.json"
# the tic-tac-toe learner with and without the groups' common-prefix pass (learner.common_prefix_pass: on for a CPU
# learner since 2026-12-06, where it took the README job's learner 0.38 -> 0.35 s; off on CUDA until this measures it):
# 4 boards x 4 samples, ~234-token prompts of which ~210 are the shared system prompt, answers of ~35 tokens
step bench-learner-common ${BENCH_LEARNER_S:-300} python3 -m jobs.bench learner --config configs/tictactoe-qwen0.5b.toml \
  --model qwen0.5b-random --cache $BENCH --steps 10 --warmup 2 --groups 4 --samples 4 --prompt-tokens 234 \
  --common-tokens 210 --answer-min 20 --answer-max 60 --variant common=learner.common_prefix_pass=true \
  --variant nocommon=learner.common_prefix_pass=false --out "$out/bench-learner-common.json"
# where a micro-batch's time goes (the GPU's arithmetic for 4 rows of ~900 tokens is ~30-70 ms): the config's learner
# (no prefix sharing) under torch.profiler, its top operators by CUDA and CPU time, beside prefix sharing, and sharing
# with 16 rows or a 16k-position budget
step profile-learner ${PROFILE_S:-420} python3 scripts/profile_learner.py --out "$out/profile-learner" \
  --variants recipe,sharing,mbs16,tok16k
# the weight fingerprint's reductions, the first way and rlsys's (issue 24, item 4)
step fingerprint ${FINGERPRINT_S:-120} python3 scripts/fingerprint_bench.py --repeats 30 --out "$out/fingerprint.json"
# the weight push of a 1.5B model (goal < 10 ms/GiB)
step bench-sync15 ${BENCH_S:-240} python3 -m jobs.bench sync --model qwen1.5b-random --cache $BENCH --out "$out/bench-sync15.json"
# the tic-tac-toe job with a random 1.5B model under a 24 GiB budget: 3 steps after a warm-up, peak memory per phase
step budget-1.5b ${BUDGET_S:-280} python3 -m jobs.bench step $TTT --model qwen1.5b-random --cache $BENCH --steps 3 \
  --random-reward --run-dir /tmp/rlsys-budget --out "$out/budget-1.5b.json" rollout.gpu_memory_budget_gib=24 \
  rollout.batch_size=8 rollout.n_samples=8 rollout.max_new_tokens=64 learner.mini_bs=2 learner.adam_8bit=true \
  model.gradient_checkpointing=true rollout.max_model_len=512 rollout.enforce_eager=true logging.tensorboard=false
for f in /tmp/rlsys-startup/metrics.jsonl /tmp/rlsys-startup-eager/metrics.jsonl /tmp/rlsys-startup-eager-spawn/metrics.jsonl \
    /tmp/rlsys-startup-fulldecode/metrics.jsonl; do
  [ -f "$f" ] && cp "$f" "$out/$(basename "$(dirname "$f")")-metrics.jsonl"
done
nvidia-smi --query-gpu=memory.used --format=csv >> "$out/summary.log" 2>&1
echo "=== done in $SECONDS s" | tee -a "$out/summary.log"
