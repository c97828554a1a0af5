"""Shared building blocks of genq's services: settings, Redis schema, scripts, data set access."""
