# Sourced by the GPU scripts (run_on_device.sh, session.sh) on the GPU machine, from the repo root: the
# unpacked wheel set (/tmp/gpu-site, docs/gpu.md ("Running the GPU checks")), the repo and .devcarry/extra (small pure-Python
# packages the GPU image lacks, e.g. tomli_w) on PYTHONPATH, and the environment every GPU run of rlsys wants.
out=${OUT:-gpu-logs}; mkdir -p "$out"
export PYTHONPATH=/tmp/gpu-site/site:$PWD:$PWD/.devcarry/extra${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/gpu-site/site/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_ALLOW_INSECURE_SERIALIZATION=1 VLLM_USE_FLASHINFER_SAMPLER=0 RAY_AUTH_MODE=token
export RLSYS_CACHE=/tmp/rlsys-cache
# lives PIDFILE: the process whose pid the file holds still runs (the `wait`s of session.sh and all.sh stop at once
# otherwise: a queue that never started or died is not waited on, a wait costs device time)
lives() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
# detach LOG CMD...: CMD in a session of its own (setsid), so that it outlives the device call that starts it, its stdin
# /dev/null and its stdout and stderr LOG, nothing else. A `(cd DIR && CMD > LOG 2>&1 &)` leaves the forked `&&` list
# holding the caller's stdout until CMD ends: `bash tests/gpu/all.sh start | tail -4` waited for the whole suite there
# and the start call was cut at its 90 s limit (2026-12-06)
detach() { local log=$1; shift; setsid nohup "$@" > "$log" 2>&1 < /dev/null & }
