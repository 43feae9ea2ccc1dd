"""`python -m lightning_grpo.cli ...` is `lightning-grpo ...`."""

from .app import main

if __name__ == "__main__":
    main()
