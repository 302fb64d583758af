"""Load generation, benchmarks and the vLLM stand-in."""
