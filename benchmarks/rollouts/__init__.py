"""The rollout benchmark (benchmarks/agent_rollouts.py, its thin entry point) as a package of
small modules, one job each:

  regimes   how a reasoning step is priced (the regimes), the run's sizes and the preamble
  tasks     the task families and check_family before a family meets the cache
  configs   one configuration (CRIU, Base, Spec, Full and their variants): its core and agent
  sampler   the host memory of a configuration's workspaces over an epoch
  driver    an epoch, a seed: the rows written per epoch and per configuration
  stats     mean and spread over seeds, paired ratios, placements and snapshot policies
  targets   the issue's targets with what was reached, why a target was missed, the wall time
  figures   the paper's figures from the JSON
  results   the JSON of a run, and --merge of per-seed runs
  cli       the command line (its usage text is this benchmark's documentation)

The modules import the agent as `agent_policy` (benchmarks/ on sys.path, as the entry point sets).
"""
