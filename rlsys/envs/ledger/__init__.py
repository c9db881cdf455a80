"""A ticket ledger behind three tools: "narrow action, automatic verdict".

The model must move exactly the tickets a task selects through a legal workflow
(open -> in_progress -> resolved -> closed) with `list_tickets`, `read_ticket` and `update_ticket`,
and touch nothing else. prompt.py (what the model sees, held-out perturbations), ledger.py (the state
machine), episode.py (turns -> tool results, and the verdict), dataset.py (seeded worlds, splits),
agent.py (the tool loop; the state lives in the episode), reward.py (replays and judges).
Plug-ins: `--agent-fn rlsys.envs.ledger.agent:agent --reward-fn-path rlsys.envs.ledger.reward:reward`.
"""
