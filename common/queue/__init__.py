"""The task queue: a run's Redis keys, the Lua scripts that move tasks through RQ's states,
registering a run and keeping it queued. Imported by every service and common/'s other rooms."""
