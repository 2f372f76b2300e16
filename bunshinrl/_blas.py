"""Keep BLAS single-threaded in rollout processes (imported first by the package).

bunshinfork forks (CRIU, helpers) from many threads at once, and OpenBLAS's fork handler
deadlocks when its thread pool runs during concurrent forks: rollouts hung in
blas_thread_shutdown_. OpenBLAS starts that pool when it is loaded, so the setting must come
before numpy's first import; the selector's models are tiny and need no BLAS threads.
"""

import os
import sys
import warnings

if "numpy" in sys.modules and os.environ.get("OPENBLAS_NUM_THREADS") != "1":
    warnings.warn("numpy was imported before bunshinrl without OPENBLAS_NUM_THREADS=1; concurrent "
                  "workspace forks can then deadlock in OpenBLAS's fork handler", RuntimeWarning, stacklevel=2)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
