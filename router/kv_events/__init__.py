"""vLLM's KV-cache events: what each replica's prefix cache stores and evicts, as it happens."""
