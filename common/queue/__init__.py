"""The task queue: every Redis key of a run (keys), the Lua scripts that move tasks through RQ's
states and their call shapes, registering a run and keeping it queued. Imported by every
service and by the other rooms of common/."""
