"""Serving benchmark on a real engine (vLLM CPU build): environment, server, load, metrics."""
