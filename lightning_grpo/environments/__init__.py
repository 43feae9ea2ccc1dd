"""Environments for the multi-turn recipes (TRL's `environment_factory`): objects with state across a conversation's
turns, whose public methods are the policy's tools."""
