"""genq's producer: registers a run and keeps its unfinished prompt indices queued."""
