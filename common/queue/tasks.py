"""The callable every genq RQ job names, so RQ tools show a meaningful function and an
`rq worker` pointed at a genq queue by mistake fails each job with a clear message."""

from __future__ import annotations

FUNC = "genq.common.queue.tasks.generate"


def generate(index: int) -> None:
    raise RuntimeError(f"genq task {index} must be run by `genq consume`, not by an rq worker")
