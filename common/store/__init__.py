"""Getting results out: `genq export` and its formats, and S3 (URIs, upload, download, the
shipper). Imports common.queue and common.data; imported by services."""
