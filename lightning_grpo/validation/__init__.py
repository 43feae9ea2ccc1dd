"""Held-out validation: the conversations the policy holds on held-out prompts (`rollouts`), and the metrics over
them, rewards weighted as in training, pass@k and mean@k (`metrics`)."""
