"""Data in and out: data sets read by row index, output shards, the run manifest and recovery from
shards. Imports common.queue; imported by services, common.store and common.report."""
