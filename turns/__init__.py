"""A turn, the unit of a conversation (`genq produce --turns all`): turn k is a row's k-th
assistant message, made anew given the turns made before it.

- check.py: whether a row's conversation can be made a prompt of, checked before its first
  request (and of the data set's first rows by produce).
- splice.py: pure functions of a row's messages: where its turns are, a turn's prompt, what
  follows a made turn (the row's results for its calls, matched by meaning, or a Stop).
- state.py: where a conversation stands, as Redis keeps it between turns (turn.lua writes it).
- engine.py: the consumer's loop over a conversation's turns, one request at a time.
- export.py: the accepted generations of every conversation, as lines or as conversations,
  and the figures `genq status` shows.

docs/REFERENCE.md, "Turns", says the rules for users; docs/DESIGN.md says why.
"""
