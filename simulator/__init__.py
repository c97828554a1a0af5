"""An SGLang-faithful simulated server: same endpoints and shapes, continuous batching, faults."""
