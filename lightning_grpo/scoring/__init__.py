"""Scoring rollouts on the trainer: `TrainerScorer` (`scorer`), `score_step` (`step`), the collator that carries each
scorer's inputs (`collator`), the packing of scorer inputs (`packing`) and the built-in scorers (`scorers`)."""
