"""A turn, the unit of a conversation (`genq produce --turns all`): turn k is a row's k-th
assistant message, made anew given the turns made before it.

- check.py: whether a row's conversation can be made a prompt of, checked before its first
  request (and of the data set's first rows by produce).
- splice.py: pure functions of a row's messages: where its turns are, a turn's prompt, what
  follows a made turn (the row's results for its calls, matched by meaning, or a Stop).
- state.py: where a conversation stands, as Redis keeps it between turns (turn.lua writes it).
- conversations.py: the rows of `export --format conversations`.

The domain only, so every room of common/ may read it: the consumer's loop over a
conversation's turns is consumer/turns.py; export, recover and `--redo missing` of conversations
sit beside those of answers (store/export_turns.py, data/recovery_turns.py, producer/rewind.py).

docs/REFERENCE.md, "Turns", says the rules for users; docs/DESIGN.md says why.
"""
