"""Math word problems with a calculator tool: GSM8K-style questions from reasoning-gym's `gsm_symbolic`
templates (shipped as JSONL, split by template), `calculate(expression)` as often as the model likes, then
`answer(value)`, at most 6 turns.

calculator.py (the safe evaluator), dataset.py (items, files), prompt.py (system prompt, tools), episode.py (the
turn rules and the outcome, shared by agent and reward), agent.py, reward.py (OUTCOMES, outcome, reward,
summarize, validate_item), perturb.py (held-out perturbations). Data: scripts/make_gsm_data.py. docs/envs.md.
Plug-ins: `--agent-fn rlsys.envs.gsm.agent:agent --reward-fn-path rlsys.envs.gsm.reward:reward`.
"""
