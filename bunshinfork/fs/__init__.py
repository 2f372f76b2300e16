"""File-system subsystem (paper §4.5): a workspace's root file system and its private layer.

Each workspace mounts an overlayfs: shared read-only lower layers (rootfs.py: the host's
/usr under a generated skeleton, a debootstrap, a directory or an OCI image) plus a private
upper layer (layers.py), a btrfs subvolume where the storage allows (btrfs.py). A fork
snapshots the upper while the source is frozen; each clone gets a writable copy of it over
the same lowers, so unchanged files share one page cache.
"""

from .btrfs import loop_devices_for, setup_btrfs_loop, teardown_btrfs_loop

__all__ = ["loop_devices_for", "setup_btrfs_loop", "teardown_btrfs_loop"]
