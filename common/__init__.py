"""Shared building blocks in rooms by concern (queue, data, store, report, sglang) beside a few
loose modules; services import common/, never each other."""
