"""Lightning callbacks for async GRPO, installed as `lightning_grpo.callbacks`."""

__all__: list[str] = []
