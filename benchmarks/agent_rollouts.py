"""BunshinRL's rollout configurations on real agent workspaces (paper sections 5.2-5.3, Figs. 6-11).

The entry point of the benchmark, kept at this path for .ci/run, the Makefile, the docs and the
tests; the benchmark itself is the package benchmarks/rollouts/ (its usage text, printed by
--help, is benchmarks/rollouts/cli.py's docstring):

python benchmarks/agent_rollouts.py [--quick] --out DIR [--seeds 3 | --seed S] [--families code,shop]
                                    [--regime paper|local|batch] [--exploration decaying|constant]
                                    [--placements live,fork_first] [--snapshot-policies cost,depth]
                                    [--audit all|sample|off] [--check-families] [--settle SECONDS]
python benchmarks/agent_rollouts.py --merge DIR0 DIR1 DIR2 --out DIR   (per-seed runs -> one result)
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

# The repository (bunshinfork, bunshinrl) and benchmarks/ (agent_policy, the rollouts package).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollouts.cli import main

if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
