"""bunshinfork: create, run commands in, and live-fork container workspaces."""

__version__ = "0.1.0"
