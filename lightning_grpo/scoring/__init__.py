"""Scoring rollouts on the trainer: the `TrainerScorer` plug point, its feature uids and `resolve_scorer`
(`trainer_scorer`), `score_step` (`step`), the collator that carries each scorer's inputs (`collator`), the packing of
scorer inputs (`packing`) and the built-in reward-model and feature-matching scorers (`builtin_scorers`)."""
