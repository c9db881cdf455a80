"""Whole games of tic-tac-toe through the proxy: X (the policy) against a seeded opponent, one
`choose_square` call per turn, O's reply and the new board coming back as the tool result.

dataset.py (items, splits), opponent.py (random / minimax with a blunder rate), prompt.py (the
single-move env's prompts + tool result text), episode.py (the game as a state machine over turn
records, shared by agent and reward), turns.py (turn records, the assistant echo), agent.py, reward.py.
Plug-ins: `--agent-fn rlsys.envs.tictactoe_game.agent:agent --reward-fn-path rlsys.envs.tictactoe_game.reward:reward`.
"""
