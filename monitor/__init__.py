"""The monitor service: a web page, the status JSON, Prometheus metrics and a progress file."""
