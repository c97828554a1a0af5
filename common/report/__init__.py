"""Status and figures: the status read from Redis, its rate/ETA/percentile maths, advice,
failures, and the table people read. Imports common.queue; imported by services."""
