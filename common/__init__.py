"""Shared building blocks of genq's services, in rooms by concern (queue, data, store, report,
sglang) beside a few loose modules every service uses (cli, errors, log, net, params). Services
import common/, never each other."""
