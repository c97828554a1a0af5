"""The SGLang HTTP client: the only code that knows the server's wire format. Imported by the
consumer and the producer's probe."""
