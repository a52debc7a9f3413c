"""pdconnect: the parts of the P/D service that need no vLLM (protocol, transports, router, tools)."""
