"""The decoding loop, which knows a drafter only through the `Drafter` interface (`drafter`).

`loop` runs a `generate` call: the prefill, then iterations of choose a drafter, draft, verify, accept and commit.
Its parts: `call` (the working state of one call and the commit of an iteration), `state` (the rows, right-aligned
over one cache), `verify` (the accept-reject rule), `tree` (candidate trees as data), `adaptive` (gamma and the
drafter from the speedup equation), `generation` (`model.generate`'s arguments and output) and `stats`.
"""
