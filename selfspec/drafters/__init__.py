"""Every built-in source of drafts, each a `selfspec.Drafter`."""
