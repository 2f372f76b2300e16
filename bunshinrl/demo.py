"""`python -m bunshinrl.demo [--long]`: the short GRPO run, now bunshinrl.training.demo."""

import sys

from .training.demo import main

if __name__ == "__main__":
    sys.exit(main())
