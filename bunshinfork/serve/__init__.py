"""`bunshin serve`: E2B's HTTP API (control plane and envd) over bunshin workspaces.

The unmodified e2b SDKs (Python, JavaScript) point E2B_API_URL and E2B_SANDBOX_URL at one
port; requests that carry E2b-Sandbox-Id are envd's, the rest the control plane's. envd's
Connect-RPC services are the generated ASGI applications shipped in the e2b package, with
handlers that run on the host against bunshin's async API (no daemon inside a workspace).

Modules: app (routing, auth), rest (control plane), envd (process and filesystem services,
/files, /health), ports (`<port>-<id>.<domain>` proxy), store (the server's sandbox registry).
E2B's semantics themselves (lifetimes, list paging, metrics, pause to disk) are
bunshinfork.e2b.lifecycle's, which the in-process Sandbox runs too.
"""

from .app import make_app

__all__ = ["make_app"]
