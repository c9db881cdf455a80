#!/usr/bin/env bash
# verl 0.9.1 doing rlsys's tic-tac-toe GSPO work (issue 25, docs/peers.md). Started once on a GPU (2026-12-07): verl's
# config check accepted every override below, then its trainer stopped at a missing module (TransferQueue, now
# packed); it has not trained a step yet (docs/peers.md says how far it went).
#
#   MODEL=/path/to/qwen-folder OUT=/tmp/peers/verl bash scripts/peers/verl_gspo.sh
#
# Needs the peer-verl bundle first on PYTHONPATH (scripts/peers/pack.sh verl), then rlsys's gpu-site and the tree:
#   export PYTHONPATH=/tmp/peer-verl/site:/tmp/gpu-site/site:$PWD
# The same work as scripts/peers/trl_gspo.py: rlsys's 2048 boards and prompt (scripts/peers/verl_data.py), rlsys's
# reward (scripts/peers/verl_reward.py), 4 boards x 4 samples, one update per step in micro-batches of 4, 96 new
# tokens at temperature 1, lr 1e-5 with 5 warm-up steps, 8-bit AdamW (bitsandbytes), fp32 weights with bf16 compute
# (verl's FSDP default), GSPO's sequence ratio and seq-mean-token-mean aggregation with rlsys's clip 3e-4 / 4e-4, no KL,
# vLLM colocated (gpu_memory_utilization 0.2), 100 steps, then an HF folder for `rlsys eval`.
set -euo pipefail
MODEL=${MODEL:?the Hugging Face folder of Qwen2.5-Coder-0.5B-Instruct (rlsys converts the GGUF)}
OUT=${OUT:-/tmp/peers/verl}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
python3 "$here/verl_data.py" --model "$MODEL" --out "$OUT/data"
date +%s.%N > "$OUT/t0"
python3 -m verl.trainer.main_ppo \
  data.train_files="$OUT/data/train.parquet" data.val_files="$OUT/data/val.parquet" \
  data.train_batch_size=4 data.max_prompt_length=512 data.max_response_length=96 \
  data.filter_overlong_prompts=False data.truncation=error data.shuffle=True data.seed=2026 \
  actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.model.use_remove_padding=True \
  actor_rollout_ref.model.enable_gradient_checkpointing=False \
  actor_rollout_ref.actor.strategy=fsdp \
  actor_rollout_ref.actor.optim.lr=1e-5 actor_rollout_ref.actor.optim.lr_warmup_steps=5 \
  actor_rollout_ref.actor.optim.weight_decay=0.0 actor_rollout_ref.actor.optim.clip_grad=1.0 \
  actor_rollout_ref.actor.optim.optimizer=AdamW8bit actor_rollout_ref.actor.optim.optimizer_impl=bitsandbytes.optim \
  actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.actor.ppo_epochs=1 \
  actor_rollout_ref.actor.policy_loss.loss_mode=gspo actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean \
  actor_rollout_ref.actor.clip_ratio_low=0.0003 actor_rollout_ref.actor.clip_ratio_high=0.0004 \
  actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=4 actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.2 actor_rollout_ref.rollout.max_model_len=1024 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
  algorithm.adv_estimator=grpo algorithm.norm_adv_by_std_in_grpo=True algorithm.use_kl_in_reward=False \
  reward.custom_reward_function.path="$here/verl_reward.py" reward.custom_reward_function.name=compute_score \
  reward.num_workers=1 \
  trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_training_steps=100 trainer.total_epochs=1 \
  trainer.val_before_train=False trainer.test_freq=-1 trainer.save_freq=100 \
  trainer.default_local_dir="$OUT/ckpt" trainer.logger='["console","file"]' \
  trainer.project_name=rlsys_peers trainer.experiment_name=verl_gspo \
  2>&1 | tee "$OUT/train.log"
# the FSDP checkpoint of step 100 to an HF folder for `rlsys eval --ckpt "$OUT/final"`
python3 -m verl.model_merger merge --backend fsdp \
  --local_dir "$OUT/ckpt/global_step_100/actor" --target_dir "$OUT/final"
