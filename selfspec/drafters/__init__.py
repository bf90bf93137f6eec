"""Every built-in source of drafts, each a `selfspec.Drafter` (the interface is the engine's, `engine.drafter`).

`ngram` drafts without the model (prompt lookup); `early_exit`, `medusa` and `eagle` draft with the target's own
weights and its trained heads (`selfspec.heads`: a drafter imports its kind of heads, never the reverse); `merged`
verifies several drafters' proposals as one tree; `build` turns `SelfSpeculative`'s arguments into drafters.
"""
