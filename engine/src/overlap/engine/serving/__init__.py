"""Serving: the engine's wire protocol, the engine server (the pod's engine container) and the client the sidecar
uses to talk to it. Everything here but the server's engine loop installs without torch."""
