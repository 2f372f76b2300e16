"""Process subsystem (paper §4.3): capture and rebuild a workspace's whole process tree.

The tree is rooted at the workspace's init (csrc/init.c, driven over its control socket).
CRIU dumps it while the workspace is frozen and restores it inside fresh pid, mount, net,
ipc and uts namespaces, so every pid, parent link, session and thread inside the namespace
is identical in each clone while host pids differ.
"""

from .options import dump_opts, restore_opts
from .tree import ProcInfo, tree

__all__ = ["ProcInfo", "dump_opts", "restore_opts", "tree"]
