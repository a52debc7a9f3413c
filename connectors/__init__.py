"""The vLLM side of pdconnect: the PDConnector, its scheduler and worker halves, the planner."""
