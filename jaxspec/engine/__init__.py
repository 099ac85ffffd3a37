"""The engine: decode state, prefill, the vanilla and speculative loops, rejection sampling and
the runner."""
