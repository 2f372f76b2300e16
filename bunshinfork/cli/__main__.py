"""`python -m bunshinfork.cli`: the `bunshin` script."""

import sys

from . import main

sys.exit(main())
