"""Plain logic with no dependency on sglang internals; hooks adapt sglang call sites to it."""
