"""Terminal clients of a running server over HTTP (``sluice models``); they import
nothing of the server."""
