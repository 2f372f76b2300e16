"""`bunshin doctor`: what this host offers bunshin (doctor.run_checks); needs no root."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from .. import doctor
from .common import Verb, json_args, print_json


def run(args: argparse.Namespace) -> int:
    checks = doctor.run_checks()
    if args.json:
        print_json([{**asdict(c), "level": c.level} for c in checks])
    else:
        print(doctor.format_checks(checks))
    return 1 if doctor.failed_required(checks) else 0


configure = json_args
VERB = Verb("doctor", "check what this host offers bunshin", configure, run, needs_root=False)
