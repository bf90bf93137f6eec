"""The command lines: `main` (the `selfspec` program and its subcommands: demo, bench, tune, profile, export,
architectures), `commands` (bench and tune), `demo`, `options` (the target options they share) and `loop_profile`
(where one decoding iteration's time goes: `python -m selfspec.cli.loop_profile`)."""
